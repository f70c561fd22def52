"""ExtentMap against a flat, byte-per-slot reference."""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sealfs.errors import FormatError
from sealfs.meta.extents import Extent, ExtentMap

SIZE = 120
CHUNKS = [bytes([k]) * 32 for k in range(4)]

Flat = list[tuple[bytes, int] | None]


@st.composite
def new_extents(draw: st.DrawFn, start: int, end: int) -> list[Extent]:
    """Non-overlapping extents inside [start, end), with holes between some of them."""
    cuts = sorted(draw(st.sets(st.integers(start, end), max_size=8)) | {start, end})
    out = []
    for lo, hi in pairwise(cuts):
        if hi > lo and draw(st.booleans()):
            out.append(Extent(lo, hi - lo, draw(st.sampled_from(CHUNKS)), draw(st.integers(0, 50))))
    return out


@st.composite
def operations(draw: st.DrawFn) -> list[tuple[str, int, int, list[Extent]]]:
    result = []
    for _ in range(draw(st.integers(0, 12))):
        if draw(st.integers(0, 4)) == 0:
            result.append(("truncate", draw(st.integers(0, SIZE)), 0, []))
        else:
            start = draw(st.integers(0, SIZE))
            end = draw(st.integers(start, SIZE))
            result.append(("replace", start, end, draw(new_extents(start, end))))
    return result


def check_invariants(emap: ExtentMap) -> None:
    extents = list(emap)
    for e in extents:
        assert e.length > 0
        assert e.start >= 0 and e.chunk_offset >= 0
    for before, after in pairwise(extents):
        assert before.end <= after.start
    assert len(emap) == len(extents)
    decoded = ExtentMap.from_wire(emap.to_wire())
    assert decoded.mapped_bytes() == emap.mapped_bytes()
    assert decoded.to_wire() == emap.to_wire()


def flat_of(emap: ExtentMap) -> Flat:
    flat: Flat = [None] * SIZE
    for e in emap:
        for k in range(e.length):
            flat[e.start + k] = (e.chunk, e.chunk_offset + k)
    return flat


@given(operations(), st.integers(0, SIZE), st.integers(0, SIZE))
def test_extent_map_matches_a_flat_reference(
    ops: list[tuple[str, int, int, list[Extent]]], a: int, b: int
) -> None:
    emap = ExtentMap()
    ref: Flat = [None] * SIZE
    for kind, start, end, new in ops:
        if kind == "truncate":
            emap.truncate(start)
            ref[start:] = [None] * (SIZE - start)
        else:
            emap.replace(start, end, new)
            ref[start:end] = [None] * (end - start)
            for e in new:
                for k in range(e.length):
                    ref[e.start + k] = (e.chunk, e.chunk_offset + k)
        check_invariants(emap)
        assert flat_of(emap) == ref
        assert emap.mapped_bytes() == SIZE - ref.count(None)  # kept up to date, not recounted

    lo, hi = min(a, b), max(a, b)
    pieces = emap.pieces(lo, hi)
    got: Flat = [None] * SIZE
    for p in pieces:
        assert lo <= p.start and p.end <= hi and p.length > 0
        for k in range(p.length):
            got[p.start + k] = (p.chunk, p.chunk_offset + k)
    assert got[lo:hi] == ref[lo:hi]
    assert pieces == sorted(pieces, key=lambda p: p.start)

    for pos in range(SIZE):
        cover = emap.covering(pos)
        if ref[pos] is None:
            assert cover is None
        else:
            assert cover is not None and cover.start <= pos < cover.end
            assert (cover.chunk, cover.chunk_offset + pos - cover.start) == ref[pos]
            assert cover in list(emap)


def test_replace_splits_an_extent_around_new_data() -> None:
    emap = ExtentMap([Extent(0, 100, CHUNKS[0], 0)])
    emap.replace(40, 60, [Extent(45, 10, CHUNKS[1], 7)])
    assert list(emap) == [
        Extent(0, 40, CHUNKS[0], 0),
        Extent(45, 10, CHUNKS[1], 7),
        Extent(60, 40, CHUNKS[0], 60),
    ]
    assert set(emap.chunk_ids()) == {CHUNKS[0], CHUNKS[1]}


def test_an_empty_range_has_no_pieces() -> None:
    """Random seeds found it: an empty range inside an extent gave one empty piece."""
    emap = ExtentMap([Extent(0, 2, CHUNKS[0], 0)])
    assert emap.pieces(1, 1) == []
    assert emap.pieces(0, 0) == []
    assert emap.pieces(2, 2) == []
    assert emap.pieces(1, 0) == []


def test_truncate_clips_the_last_extent() -> None:
    emap = ExtentMap([Extent(0, 10, CHUNKS[0], 0), Extent(20, 10, CHUNKS[1], 3)])
    emap.truncate(25)
    assert list(emap) == [Extent(0, 10, CHUNKS[0], 0), Extent(20, 5, CHUNKS[1], 3)]
    emap.truncate(5)
    assert list(emap) == [Extent(0, 5, CHUNKS[0], 0)]
    emap.truncate(0)
    assert list(emap) == []


def test_mapped_bytes_of_a_map_in_wire_form_need_no_parse() -> None:
    """stat asks for them: a damaged row must fail the read of the file, not its stat."""
    rows = [[0, 10, CHUNKS[0], 0], [20, 5, CHUNKS[1], 3], ["damaged"]]
    emap = ExtentMap.from_wire(rows)
    assert emap.mapped_bytes() == 15
    with pytest.raises(FormatError):
        list(emap)


def test_chunk_ids_of_a_map_in_wire_form_need_no_parse() -> None:
    """status asks every file for them: it must neither parse the maps a mount left in
    wire form (seconds with 100,000 files, on the event loop) nor fail on a damaged one."""
    rows = [[0, 10, CHUNKS[0], 0], [20, 5, CHUNKS[1], 3], [30, 5, CHUNKS[0], 7], ["damaged"]]
    emap = ExtentMap.from_wire(rows)
    assert list(emap.chunk_ids()) == [CHUNKS[0], CHUNKS[1], CHUNKS[0]]
    assert emap._wire is rows  # still unparsed
    parsed = ExtentMap([Extent(0, 4, CHUNKS[2], 0), Extent(8, 2, CHUNKS[3], 1)])
    assert set(parsed.chunk_ids()) == {CHUNKS[2], CHUNKS[3]}
