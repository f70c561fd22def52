"""The index of similarity features (sealfs.meta.similar)."""

from __future__ import annotations

import random

import pytest

from sealfs.chunking.similarity import FEATURE_SIZE
from sealfs.meta import ops
from sealfs.meta.model import ChunkInfo, MetaState
from sealfs.meta.similar import FeatureIndex


def features(*names: str) -> bytes:
    return b"".join(name.encode().ljust(FEATURE_SIZE, b".") for name in names)


def test_two_features_name_a_chunk_and_the_newest_chunk_with_a_feature_wins() -> None:
    index = FeatureIndex()
    index.add(features("a", "b", "c"), b"old")
    assert index.roots(features("a", "x")) == []  # one piece alike is no likeness
    assert index.roots(features("a", "b", "x")) == [b"old"]
    index.add(features("b", "c", "d"), b"new")
    # a shares only a with new now: new has the most votes, old too few
    assert index.roots(features("a", "b", "c", "d")) == [b"new"]
    index.add(features("e", "f", "g"), b"third")
    assert index.roots(features("a", "b", "c", "e", "f", "g", "h")) == [b"third", b"new"]


def test_the_index_keeps_the_newest_features_only() -> None:
    """Eight features a chunk, a bound of 32: the newer half fills at 16, then it is
    the older half, and the older one's features are dropped."""
    index = FeatureIndex(limit=32)
    rows = [features(*(f"{n}-{k}" for k in range(8))) for n in range(9)]
    for n, row in enumerate(rows):
        index.add(row, b"chunk %d" % n)
        assert len(index) <= 32
    assert [index.roots(row) for row in rows[:6]] == [[]] * 6
    assert [index.roots(row) for row in rows[6:]] == [[b"chunk %d" % n] for n in (6, 7, 8)]


def test_a_snapshot_loaded_indexes_its_newest_rows() -> None:
    """A writer's index begins with the table's rows in table order: the last are kept,
    and a difference's features name its base."""
    table = {b"%032d" % n: ChunkInfo(1 << 20, 1000, features(f"{n}a", f"{n}b")) for n in range(5)}
    table[b"delta".ljust(32)] = ChunkInfo(1 << 20, 10, features("4a", "4b", "x"), b"%032d" % 4)
    state = MetaState()
    state.set_chunks(table)
    state.index_features()
    assert state.similar is not None
    assert len(state.similar) == 11  # the delta's 4a and 4b replaced chunk 4's
    assert state.similar_roots(features("4a", "x")) == [b"%032d" % 4]
    assert state.similar_roots(features("0a", "0b")) == [b"%032d" % 0]
    state.index_features(limit=4)  # a chunk's features, then the next chunk's
    assert state.similar_roots(features("0a", "0b")) == []
    assert state.similar_roots(features("4a", "x")) == [b"%032d" % 4]


def test_a_state_that_stores_no_chunk_keeps_no_features() -> None:
    """A read-only mount's state and compaction's throwaway ones never look a chunk up:
    they keep the bases (in use through their differences) but no features."""
    state, base = MetaState(), b"B" * 32
    state.set_chunks({b"A" * 32: ChunkInfo(1 << 20, 1000, features("a", "b"))})
    state.put_chunk(b"D" * 32, ChunkInfo(1 << 20, 10, features("c", "d"), base))
    assert state.similar is None
    assert state.similar_roots(features("a", "b")) == []
    assert state.is_base(base)
    state.index_features()
    assert state.similar_roots(features("a", "b")) == [b"A" * 32]
    assert state.similar_roots(features("c", "d")) == [] == state.similar_roots(b"")


@pytest.mark.parametrize("limit", [2, 16, 64, 65])
def test_a_writers_index_begins_with_as_many_of_the_newest_rows_as_the_bound_holds(
    limit: int,
) -> None:
    """Rows of two to nine features (one shared by some), and rows of none: the rows the
    index names are the table's last ones, as many as fit under the bound (one at
    least), and a chunk added after is found as with an index fed every row."""
    rng = random.Random(limit)
    table = {}
    for n in range(60):
        names = [f"{n}-{k}" for k in range(rng.choice([0, 2, 5, 8]))]
        names += ["shared"] * (bool(names) and n % 3 == 0)
        table[b"%032d" % n] = ChunkInfo(1 << 20, 1000, features(*names))
    state = MetaState()
    state.set_chunks(table)
    state.index_features(limit)
    assert state.similar is not None and len(state.similar) <= max(limit, 9)
    rows = [(cid, info.features) for cid, info in table.items() if info.features]
    named = [cid for cid, row in rows if state.similar_roots(row[:16]) == [cid]]
    first = len(rows) - len(named)
    assert first > 0  # the table holds more features than any bound here
    assert named == [cid for cid, _ in rows[first:]]  # the newest ones, every one
    counts = [len(row) // 8 for _, row in rows]
    assert sum(counts[first:]) <= limit or len(named) == 1
    assert sum(counts[first - 1 :]) > limit  # no room for the row before them
    # The newer half is left under half the bound, as add leaves it: chunks stored
    # after keep the index within the bound add alone keeps (a row's features over
    # it), and push the table's rows out in turn.
    new_rows = [features(*(f"new-{n}-{k}" for k in range(8))) for n in range(40)]
    for n, row in enumerate(new_rows):
        state.put_chunk(b"N%031d" % n, ChunkInfo(1 << 20, 1000, row))
        assert len(state.similar) < limit + 8
        assert state.similar_roots(row) == [b"N%031d" % n]
    assert [cid for cid, row in rows if state.similar_roots(row[:16])] == []


def test_a_chunk_put_again_is_the_newest_row_for_the_next_writers_index() -> None:
    """A difference written again whole (its base was found damaged) comes after the
    later differences from that base once its records are replayed, so the next
    writer offers it, not the damaged base, as the base of the next version. The
    engine's own record keeps the row in place: its index has the chunk newest."""
    base, repaired, later = b"B" * 32, b"R" * 32, b"L" * 32
    shared = features("a", "b", "c")
    records = [
        ops.chunk(base, ChunkInfo(1 << 20, 1000, shared)),
        ops.chunk(repaired, ChunkInfo(1 << 20, 10, shared, base)),
        ops.chunk(later, ChunkInfo(1 << 20, 10, shared, base)),
        ops.chunk(repaired, ChunkInfo(1 << 20, 1000, shared)),
    ]
    replayed = MetaState()
    for op in records:
        ops.apply(replayed, op)
    assert list(replayed.chunks) == [base, later, repaired]
    assert replayed.chunks_stored_bytes == 2010
    replayed.index_features()
    assert replayed.similar_roots(shared) == [repaired]
    live = MetaState()
    live.index_features()
    for op in records:
        ops.apply(live, op, live=True)
    assert list(live.chunks) == [base, repaired, later]
    assert live.chunks_stored_bytes == 2010
    assert live.similar_roots(shared) == [repaired]


def test_a_table_set_after_the_index_began_is_indexed_instead() -> None:
    """The index of a state whose whole table is replaced names the new table's chunks,
    with the same bound, and none of the old one's."""
    state, old, new = MetaState(), b"O" * 32, b"N" * 32
    state.set_chunks({old: ChunkInfo(1 << 20, 1000, features("a", "b"))})
    state.index_features(limit=16)
    assert state.similar_roots(features("a", "b")) == [old]
    state.set_chunks({new: ChunkInfo(1 << 20, 1000, features("c", "d"))})
    assert state.similar is not None and state.similar.limit == 16
    assert state.similar_roots(features("c", "d")) == [new]
    assert len(state.similar) == 2


def test_only_whole_chunks_of_the_table_are_offered() -> None:
    """A read of a difference takes its base and nothing more: a root whose row has a
    base (or no row) is never offered, whatever the index still says of it."""
    state, chunk = MetaState(), b"B" * 32
    state.index_features()
    state.put_chunk(chunk, ChunkInfo(1 << 20, 1000, features("a", "b")))
    assert state.similar_roots(features("a", "b")) == [chunk]
    state.put_chunk(chunk, ChunkInfo(1 << 20, 10, b"", b"X" * 32))  # its row has a base now
    assert state.similar_roots(features("a", "b")) == []
    assert state.similar is not None
    state.similar.add(features("c", "d"), b"N" * 32)  # no row
    assert state.similar_roots(features("c", "d")) == []


def test_the_bases_rows_name_are_known_with_or_without_a_row() -> None:
    state, base = MetaState(), b"B" * 32
    state.put_chunk(b"D" * 32, ChunkInfo(1 << 20, 10, b"", base))
    assert state.is_base(base) and not state.is_base(b"D" * 32)
    state.set_chunks({b"E" * 32: ChunkInfo(1 << 20, 10)})
    assert not state.is_base(base)
