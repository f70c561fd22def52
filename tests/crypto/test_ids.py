"""Keyed chunk ids."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from sealfs.crypto.ids import chunk_id

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
