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

from sealfs.errors import FormatError

CHUNK_ID_SIZE = 32


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
    """A sorted, non-overlapping list of extents with range replacement."""

    __slots__ = ("_extents", "_starts")

    def __init__(self, extents: list[Extent] | None = None) -> None:
        self._extents: list[Extent] = list(extents or [])
        self._starts: list[int] = [e.start for e in self._extents]

    def __iter__(self) -> Iterator[Extent]:
        return iter(self._extents)

    def __len__(self) -> int:
        return len(self._extents)

    def _span(self, start: int, end: int) -> tuple[int, int]:
        """Index range of the extents that overlap [start, end)."""
        i = bisect_right(self._starts, start) - 1
        if i < 0 or self._extents[i].end <= start:
            i += 1
        j = bisect_left(self._starts, end)
        return i, max(i, j)

    def pieces(self, start: int, end: int) -> list[Extent]:
        """The extents overlapping [start, end), clipped to it."""
        i, j = self._span(start, end)
        return [e.clip(start, end) for e in self._extents[i:j]]

    def covering(self, pos: int) -> Extent | None:
        """The whole extent that holds byte pos, or None in a hole."""
        i = bisect_right(self._starts, pos) - 1
        if i >= 0 and self._extents[i].end > pos:
            return self._extents[i]
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
        self._extents[i:j] = middle
        self._starts[i:j] = [e.start for e in middle]

    def truncate(self, size: int) -> None:
        """Forget every byte at or beyond size."""
        if self._extents and self._extents[-1].end > size:
            self.replace(size, self._extents[-1].end, [])

    def chunks(self) -> set[bytes]:
        """The ids of every chunk this map references."""
        return {e.chunk for e in self._extents}

    def to_wire(self) -> list[list[object]]:
        return [[e.start, e.length, e.chunk, e.chunk_offset] for e in self._extents]

    @classmethod
    def from_wire(cls, rows: object) -> ExtentMap:
        """Parse and check a wire list: sorted, non-overlapping extents or FormatError."""
        if not isinstance(rows, list):
            raise FormatError("malformed extent list")
        extents = [extent_from_wire(row) for row in rows]
        for before, after in pairwise(extents):
            if after.start < before.end:
                raise FormatError("overlapping extents in metadata")
        return cls(extents)


def extent_from_wire(row: object) -> Extent:
    """Parse one [start, length, chunk, chunk_offset] row; FormatError if malformed."""
    if not (isinstance(row, list) and len(row) == 4):
        raise FormatError("malformed extent record")
    start, length, chunk, offset = row
    if not (
        _natural(start) and _natural(offset) and isinstance(length, int) and length > 0
    ) or not (isinstance(chunk, bytes) and len(chunk) == CHUNK_ID_SIZE):
        raise FormatError("malformed extent record")
    return Extent(start, length, chunk, offset)


def _natural(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
