"""Similarity features: which chunks share them, and which do not."""

from __future__ import annotations

import hashlib
import random

from sealfs.chunking.similarity import (
    FEATURE_SIZE,
    MAX_FEATURES,
    MIN_SIMILAR_SIZE,
    PIECES_PER_END,
    similarity_features,
    split_features,
)

KEY = bytes.fromhex("0ce47391acaa391773e33cb031f0629a5a01574948274b47c3969131aacec0fc")


def counter_stream(count: int) -> bytes:
    """SHA-256 of 0, 1, 2, ... (4 bytes big-endian each), concatenated."""
    return b"".join(hashlib.sha256(i.to_bytes(4, "big")).digest() for i in range(count))


def random_bytes(seed: int, size: int) -> bytes:
    """Fixed bytes: where content-defined cuts fall is then fixed too (an edit a few
    bytes from a cut candidate may move the next cut, with a chance of about 1 in 200)."""
    return random.Random(seed).randbytes(size)


def test_golden_similarity_features() -> None:
    """The example of docs/format.md, section 4."""
    features = similarity_features(KEY, counter_stream(2048))
    assert features.hex() == (
        "c34f4450d5c323048cd71f6608dc0d4c798235035188879b06855e01b026b524"
        "fce3f18b870e396c59ba8104ce6e1b22de3d3a619134a68ad316eab1b21d44d1"
    )


def test_an_edit_inside_a_chunk_keeps_its_features() -> None:
    data = random_bytes(1, MIN_SIMILAR_SIZE * 4)
    features = split_features(similarity_features(KEY, data))
    assert len(features) == MAX_FEATURES and all(len(f) == FEATURE_SIZE for f in features)
    middle = len(data) // 2
    edited = data[:middle] + b"an edit of another length" + data[middle + 3 :]
    assert split_features(similarity_features(KEY, edited)) == features


def test_an_edit_near_an_end_costs_a_piece_of_it_not_the_end() -> None:
    """The pieces are cut by content: after an edit in the first one, the second is cut
    where it was, and a chunk edited at both edges still shares a feature per end."""
    data = random_bytes(2, MIN_SIMILAR_SIZE * 2)
    features = split_features(similarity_features(KEY, data))
    edited = b"x" + data[10:-10] + b"y"
    shared = set(features) & set(split_features(similarity_features(KEY, edited)))
    assert features[1] in shared and features[-2] in shared
    assert features[0] not in shared and features[-1] not in shared


def test_features_are_keyed_and_small_chunks_have_none() -> None:
    data = random_bytes(3, MIN_SIMILAR_SIZE)
    assert similarity_features(bytes(32), data) != similarity_features(KEY, data)
    assert similarity_features(KEY, data[:-1]) == b""


def test_pieces_of_one_byte_repeated_give_no_feature() -> None:
    """Zeros (sparse and binary files) at an end say nothing about the rest."""
    assert similarity_features(KEY, bytes(MIN_SIMILAR_SIZE * 2)) == b""
    head = random_bytes(4, MIN_SIMILAR_SIZE)
    features = split_features(similarity_features(KEY, head + bytes(MIN_SIMILAR_SIZE)))
    head_only = split_features(similarity_features(KEY, head))[:PIECES_PER_END]
    assert features == head_only
