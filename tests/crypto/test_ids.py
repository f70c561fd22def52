"""Keyed chunk ids: BLAKE3's keyed_hash mode, pinned to the BLAKE3 team's vectors."""

from __future__ import annotations

import hashlib

import pytest

from sealfs.crypto.ids import chunk_id

# The chunk-id-blake3 subkey of tests/crypto/test_subkeys.py's master key and volume id.
KEY = bytes.fromhex("ed0d77220cb5d674e3a9800560913c55721c099fb3edf4937d45166be5e0df9d")
GOLDEN = "6d04cf01f9e86d2b296cb89330a5f7e4232d786a4dad52652582298bc98098a4"

# From the BLAKE3 reference repository's test_vectors/test_vectors.json: its key, its
# input (the bytes 0, 1, ..., 250 repeated), and the first 32 bytes of "keyed_hash".
SPEC_KEY = b"whats the Elvish word for friend"
SPEC_KEYED_HASH = {
    0: "92b2b75604ed3c761f9d6f62392c8a9227ad0ea3f09573e783f1498a4ed60d26",
    1: "6d7878dfff2f485635d39013278ae14f1454b8c0a3a2d34bc1ab38228a80c95b",
    1025: "357dc55de0c7e382c900fd6e320acc04146be01db6a8ce7210b7189bd664ea69",
}


def test_golden_chunk_id() -> None:
    assert chunk_id(KEY, b"hello chunk").hex() == GOLDEN


@pytest.mark.parametrize("length", sorted(SPEC_KEYED_HASH))
def test_matches_the_blake3_reference_vectors(length: int) -> None:
    data = bytes(i % 251 for i in range(length))
    assert chunk_id(SPEC_KEY, data).hex() == SPEC_KEYED_HASH[length]


def test_every_buffer_type_names_alike() -> None:
    data = bytes(range(256)) * 100
    expected = chunk_id(KEY, data)
    assert chunk_id(KEY, bytearray(data)) == expected
    assert chunk_id(KEY, memoryview(data)) == expected
    assert chunk_id(KEY, memoryview(b"xx" + data)[2:]) == expected


def test_keyed_not_a_plain_hash() -> None:
    assert chunk_id(KEY, b"x") != hashlib.sha256(b"x").digest()
    assert chunk_id(KEY, b"x") != chunk_id(bytes(32), b"x")
    assert len(chunk_id(KEY, b"x")) == 32


def test_bad_key_size() -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        chunk_id(bytes(16), b"x")
