"""Extent maps: which slice of which chunk holds each byte range of a file.

An extent may reference a slice of a chunk, so truncation and overwrites
never need to rewrite old chunks. Ranges with no extent are holes and read
as zeros. Extents never overlap and are kept sorted by file offset.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from sealfs.crypto.ids import CHUNK_ID_SIZE
from sealfs.errors import FormatError


@dataclass(frozen=True, slots=True)
class Extent:
    """Bytes [start, start + length) of a file are chunk[chunk_offset : chunk_offset + length]."""

    start: int
    length: int
    chunk: bytes
    chunk_offset: int

    @property
    def end(self) -> int:
        return self.start + self.length

    def clip(self, start: int, end: int) -> Extent:
        """The part of this extent inside [start, end) (the caller ensures they overlap)."""
        lo, hi = max(self.start, start), min(self.end, end)
        return Extent(lo, hi - lo, self.chunk, self.chunk_offset + (lo - self.start))


class ExtentMap:
    """A sorted, non-overlapping list of extents with range replacement.

    A map decoded from a snapshot keeps its wire rows until first used: most
    files are never touched after a mount, and mount time is what a user of
    a volume with many files waits for.
    """

    __slots__ = ("_extents", "_mapped", "_starts", "_wire")

    def __init__(self, extents: list[Extent] | None = None) -> None:
        self._extents: list[Extent] = list(extents) if extents else []
        self._starts: list[int] = [e.start for e in self._extents]
        self._mapped = sum(e.length for e in self._extents)  # bytes not in a hole
        self._wire: list[Any] | None = None

    @classmethod
    def from_wire(cls, rows: object) -> ExtentMap:
        """A map over wire rows, parsed (and checked: FormatError) on first use."""
        if type(rows) is not list:
            raise FormatError("malformed extent list")
        emap = cls.__new__(cls)  # no __init__: this runs once per file at mount
        emap._extents, emap._starts, emap._mapped, emap._wire = [], [], -1, rows
        return emap

    def _parsed(self) -> list[Extent]:
        if self._wire is not None:
            extents = [extent_from_wire(row) for row in self._wire]
            for before, after in pairwise(extents):
                if after.start < before.end:
                    raise FormatError("overlapping extents in metadata")
            self._extents, self._starts = extents, [e.start for e in extents]
            self._mapped = sum(e.length for e in extents)
            self._wire = None
        return self._extents

    def __iter__(self) -> Iterator[Extent]:
        return iter(self._parsed())

    def mapped_bytes(self) -> int:
        """How many bytes of the file extents hold: its size less its holes.

        Asked by every stat of the file, so a map still in wire form is summed
        from its rows (once) rather than parsed: parsing builds an object per
        extent, and a listing would parse every file of the directory. A
        malformed row counts for nothing here; reading the file reports it.
        """
        if self._wire is not None and self._mapped < 0:
            self._mapped = sum(
                row[1]
                for row in self._wire
                if type(row) is list and len(row) == 4 and type(row[1]) is int and row[1] > 0
            )
        return self._mapped

    def __len__(self) -> int:
        return len(self._wire) if self._wire is not None else len(self._extents)

    def _span(self, start: int, end: int) -> tuple[int, int]:
        """Index range of the extents that overlap [start, end)."""
        extents = self._parsed()
        i = bisect_right(self._starts, start) - 1
        if i < 0 or extents[i].end <= start:
            i += 1
        j = bisect_left(self._starts, end)
        return i, max(i, j)

    def pieces(self, start: int, end: int) -> list[Extent]:
        """The extents overlapping [start, end), clipped to it (none if it is empty)."""
        if start >= end:  # _span would give the extent holding start, clipped to nothing
            return []
        i, j = self._span(start, end)
        return [e.clip(start, end) for e in self._extents[i:j]]

    def covering(self, pos: int) -> Extent | None:
        """The whole extent that holds byte pos, or None in a hole."""
        extents = self._parsed()
        i = bisect_right(self._starts, pos) - 1
        if i >= 0 and extents[i].end > pos:
            return extents[i]
        return None

    def replace(self, start: int, end: int, new: list[Extent]) -> None:
        """Drop all coverage of [start, end), then insert new (which must lie inside it)."""
        i, j = self._span(start, end)
        middle: list[Extent] = []
        if i < j and self._extents[i].start < start:
            middle.append(self._extents[i].clip(self._extents[i].start, start))
        middle.extend(new)
        if i < j and self._extents[j - 1].end > end:
            middle.append(self._extents[j - 1].clip(end, self._extents[j - 1].end))
        self._mapped += sum(e.length for e in middle) - sum(e.length for e in self._extents[i:j])
        self._extents[i:j] = middle
        self._starts[i:j] = [e.start for e in middle]

    def truncate(self, size: int) -> None:
        """Forget every byte at or beyond size."""
        extents = self._parsed()
        if extents and extents[-1].end > size:
            self.replace(size, extents[-1].end, [])

    def chunk_ids(self) -> Iterator[bytes]:
        """The id of each extent's chunk (repeats included), without parsing a map still
        in wire form: `sealfs status` asks this of every file, and parsing them all
        held the mount's event loop for seconds on a volume of 100,000 files. A
        malformed row counts for nothing here; reading the file reports it."""
        if self._wire is None:
            return (e.chunk for e in self._extents)
        return (row[2] for row in self._wire if type(row) is list and len(row) == 4)

    def to_wire(self) -> list[Any]:
        if self._wire is not None:
            return self._wire
        return [[e.start, e.length, e.chunk, e.chunk_offset] for e in self._extents]


def extent_from_wire(row: object) -> Extent:
    """Parse one [start, length, chunk, chunk_offset] row; FormatError if malformed."""
    if type(row) is not list or len(row) != 4:
        raise FormatError("malformed extent record")
    start, length, chunk, offset = row
    # type() rather than isinstance(): True is not a number here.
    if (
        type(start) is not int
        or type(length) is not int
        or type(offset) is not int
        or type(chunk) is not bytes
        or start < 0
        or length <= 0
        or offset < 0
        or len(chunk) != CHUNK_ID_SIZE
    ):
        raise FormatError("malformed extent record")
    return Extent(start, length, chunk, offset)
