import os

from sealfs.chunking.fastcdc import MAX_CHUNK, MIN_CHUNK, Chunker


def test_lengths_cover_the_input_and_respect_bounds() -> None:
    data = os.urandom(12 * 1024 * 1024)
    lengths = Chunker(seed=7).cut(data)
    assert sum(lengths) == len(data)
    assert all(n <= MAX_CHUNK for n in lengths)
    assert all(n >= MIN_CHUNK for n in lengths[:-1])


def test_empty_input_has_no_chunks() -> None:
    assert Chunker(seed=1).cut(b"") == []


def test_an_insertion_at_the_start_only_changes_the_first_chunks() -> None:
    data = os.urandom(16 * 1024 * 1024)
    chunker = Chunker(seed=3)
    before = _pieces(data, chunker.cut(data))
    edited = b"x" * 1000 + data
    after = _pieces(edited, chunker.cut(edited))
    shared = len(set(before) & set(after))
    assert shared >= len(before) - 2


def test_the_seed_changes_the_cut_points() -> None:
    data = os.urandom(16 * 1024 * 1024)
    assert Chunker(seed=1).cut(data) != Chunker(seed=2).cut(data)


def _pieces(data: bytes, lengths: list[int]) -> list[bytes]:
    out, pos = [], 0
    for n in lengths:
        out.append(data[pos : pos + n])
        pos += n
    return out
