"""The index of similarity features (sealfs.meta.similar)."""

from __future__ import annotations

from sealfs.chunking.similarity import FEATURE_SIZE
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
    """set_chunks (a snapshot's table) indexes rows in table order: the last are kept,
    and a difference's features name its base."""
    table = {b"%032d" % n: ChunkInfo(1 << 20, 1000, features(f"{n}a", f"{n}b")) for n in range(5)}
    table[b"delta".ljust(32)] = ChunkInfo(1 << 20, 10, features("4a", "4b", "x"), b"%032d" % 4)
    state = MetaState()
    state.set_chunks(table)
    assert len(state.similar) == 11  # the delta's 4a and 4b replaced chunk 4's
    assert state.similar_roots(features("4a", "x")) == [b"%032d" % 4]
    assert state.similar_roots(features("0a", "0b")) == [b"%032d" % 0]
    state.similar = FeatureIndex(limit=4)  # a chunk's features, then the next chunk's
    state.set_chunks(table)
    assert state.similar_roots(features("0a", "0b")) == []
    assert state.similar_roots(features("4a", "x")) == [b"%032d" % 4]


def test_only_whole_chunks_of_the_table_are_offered() -> None:
    """A read of a difference takes its base and nothing more: a root whose row has a
    base (or no row) is never offered, whatever the index still says of it."""
    state, chunk = MetaState(), b"B" * 32
    state.put_chunk(chunk, ChunkInfo(1 << 20, 1000, features("a", "b")))
    assert state.similar_roots(features("a", "b")) == [chunk]
    state.put_chunk(chunk, ChunkInfo(1 << 20, 10, b"", b"X" * 32))  # its row has a base now
    assert state.similar_roots(features("a", "b")) == []
    state.similar.add(features("c", "d"), b"N" * 32)  # no row
    assert state.similar_roots(features("c", "d")) == []


def test_the_bases_rows_name_are_known_with_or_without_a_row() -> None:
    state, base = MetaState(), b"B" * 32
    state.put_chunk(b"D" * 32, ChunkInfo(1 << 20, 10, b"", base))
    assert state.is_base(base) and not state.is_base(b"D" * 32)
    state.set_chunks({b"E" * 32: ChunkInfo(1 << 20, 10)})
    assert not state.is_base(base)
