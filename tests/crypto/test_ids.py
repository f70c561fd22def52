"""Keyed chunk ids."""

from __future__ import annotations

import hashlib
import hmac
import os

import pytest

from sealfs.crypto.ids import FEATURES_SIZE, MIN_SIMILAR_SIZE, chunk_id, similarity_features

KEY = bytes.fromhex("0ce47391acaa391773e33cb031f0629a5a01574948274b47c3969131aacec0fc")
GOLDEN = "20deacafd2f7c08a09772de28defbc32c120595e940c75182c32e0993a10549f"


def test_golden_chunk_id() -> None:
    assert chunk_id(KEY, b"hello chunk").hex() == GOLDEN


def test_matches_stdlib_hmac() -> None:
    data = bytes(range(256)) * 100
    expected = hmac.new(KEY, data, hashlib.sha256).digest()
    assert chunk_id(KEY, data) == expected
    assert chunk_id(KEY, bytearray(data)) == expected
    assert chunk_id(KEY, memoryview(data)) == expected


def test_keyed_not_a_plain_hash() -> None:
    assert chunk_id(KEY, b"x") != hashlib.sha256(b"x").digest()
    assert chunk_id(KEY, b"x") != chunk_id(bytes(32), b"x")


def test_bad_key_size() -> None:
    with pytest.raises(ValueError):
        chunk_id(bytes(16), b"x")


def test_similarity_features_are_keyed_hashes_of_the_chunk_s_ends() -> None:
    data = os.urandom(MIN_SIMILAR_SIZE + 2000)
    features = similarity_features(KEY, data)
    assert len(features) == FEATURES_SIZE
    edited = data[:1000] + b"edit" + data[2000:]  # neither end touched
    assert similarity_features(KEY, edited) == features
    head_changed = similarity_features(KEY, b"x" + data[1:])
    assert head_changed[:8] != features[:8] and head_changed[8:] == features[8:]
    assert similarity_features(bytes(32), data) != features
    assert features[:8] != chunk_id(KEY, data[:512])[:8]  # not a small chunk's id
    assert similarity_features(KEY, data[: MIN_SIMILAR_SIZE - 1]) == b""  # too short to be worth a base
