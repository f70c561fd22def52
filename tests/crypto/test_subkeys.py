"""HKDF subkeys: pinned values, checked against an independent RFC 5869 implementation."""

from __future__ import annotations

import hashlib
import hmac

import pyfastcdc
import pytest

from sealfs.crypto.subkeys import Subkeys, derive_subkeys, hkdf_sha256

MASTER_KEY = bytes(range(0x40, 0x60))
VOLUME_ID = bytes(range(16))

GOLDEN = {
    "chunk_key": "f8e17ed1fc003d50370b4237caab8ac9b718f91ffa8f8b0c45f4ae2c08f13933",
    "chunk_id_key": "0ce47391acaa391773e33cb031f0629a5a01574948274b47c3969131aacec0fc",
    "chunk_id_blake3_key": "ed0d77220cb5d674e3a9800560913c55721c099fb3edf4937d45166be5e0df9d",
    "meta_key": "691aaad112715774a2ccc25f3a2c016a3777bf8b65eaa911497af225af6934b8",
    "header_mac_key": "6ed3ca92963f48d23337837c6b2be0508961a601e7c36db2658bc43a5bd7e2c3",
}
GOLDEN_SEED = 108758606


def rfc5869(ikm: bytes, salt: bytes, info: bytes, length: int) -> bytes:
    """HKDF-SHA256 written from RFC 5869 with the standard library only."""
    prk = hmac.new(salt, ikm, hashlib.sha256).digest()
    okm, block = b"", b""
    for counter in range(1, -(-length // 32) + 1):
        block = hmac.new(prk, block + info + bytes([counter]), hashlib.sha256).digest()
        okm += block
    return okm[:length]


def test_hkdf_rfc5869_test_case_1() -> None:
    okm = hkdf_sha256(bytes([0x0B]) * 22, bytes(range(13)), bytes(range(0xF0, 0xFA)), 42)
    assert okm.hex() == (
        "3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf34007208d5b887185865"
    )


def test_golden_subkeys() -> None:
    keys = derive_subkeys(MASTER_KEY, VOLUME_ID)
    assert {name: getattr(keys, name).hex() for name in GOLDEN} == GOLDEN
    assert keys.chunker_seed == GOLDEN_SEED


@pytest.mark.parametrize(
    ("field", "label"),
    [
        ("chunk_key", b"chunk-encryption"),
        ("chunk_id_key", b"chunk-id"),
        ("chunk_id_blake3_key", b"chunk-id-blake3"),
        ("meta_key", b"metadata"),
        ("header_mac_key", b"header-mac"),
    ],
)
def test_labels_match_independent_hkdf(field: str, label: bytes) -> None:
    expected = rfc5869(MASTER_KEY, VOLUME_ID, b"sealfs/v1/" + label, 32)
    assert getattr(derive_subkeys(MASTER_KEY, VOLUME_ID), field) == expected


def test_chunker_seed_independently() -> None:
    raw = rfc5869(MASTER_KEY, VOLUME_ID, b"sealfs/v1/chunker-seed", 8)
    assert int.from_bytes(raw, "big") & 0x7FFFFFFF == GOLDEN_SEED


def test_seed_fits_pyfastcdc() -> None:
    seed = derive_subkeys(MASTER_KEY, VOLUME_ID).chunker_seed
    assert 0 <= seed < 2**31
    pyfastcdc.FastCDC(1 << 20, seed=seed)


def test_subkeys_are_distinct_and_volume_specific() -> None:
    a = derive_subkeys(MASTER_KEY, VOLUME_ID)
    b = derive_subkeys(MASTER_KEY, bytes(16))
    fields = ("chunk_key", "chunk_id_key", "chunk_id_blake3_key", "meta_key", "header_mac_key")
    keys_a = {getattr(a, name) for name in fields}
    assert len(keys_a) == len(fields)
    assert keys_a.isdisjoint({getattr(b, name) for name in fields})


def test_repr_hides_keys() -> None:
    keys = derive_subkeys(MASTER_KEY, VOLUME_ID)
    text = repr(keys)
    assert text == "Subkeys()"
    assert isinstance(keys, Subkeys)


def test_bad_sizes_are_value_errors() -> None:
    with pytest.raises(ValueError):
        derive_subkeys(bytes(16), VOLUME_ID)
    with pytest.raises(ValueError):
        derive_subkeys(MASTER_KEY, bytes(32))
