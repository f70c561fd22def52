"""AES-256-GCM seal/open: known answers, round trips, and refusal of tampering."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sealfs.crypto import aead
from sealfs.errors import FormatError, IntegrityError

KEY = bytes(range(32))
NONCE = bytes(range(100, 112))

# Pinned output of seal(KEY, b"sealfs golden plaintext", b"ad", NONCE).
GOLDEN_SEALED = bytes.fromhex(
    "6465666768696a6b6c6d6e6f3b7ebf0a1f9a76f9510e3b8db4451a9123ab687eee14873c5570bd"
    "4a2d6a4bcb7480cd095cec47"
)


def test_a_prefix_goes_before_the_nonce_and_is_not_authenticated() -> None:
    sealed = aead.seal(KEY, b"sealfs golden plaintext", b"ad", NONCE, prefix=b"HDR")
    assert sealed == b"HDR" + GOLDEN_SEALED
    assert aead.open_sealed(KEY, sealed[3:], b"ad") == b"sealfs golden plaintext"


def test_gcm_spec_test_case_14() -> None:
    # McGrew & Viega, "The Galois/Counter Mode of Operation", test case 14:
    # an independent check that seal is plain AES-256-GCM with nonce prepended.
    sealed = aead.seal(bytes(32), bytes(16), b"", nonce=bytes(12))
    assert sealed[:12] == bytes(12)
    assert sealed[12:28].hex() == "cea7403d4d606b6e074ec5d3baf39d18"
    assert sealed[28:].hex() == "d0d1c8a799996bf0265b98b5d48ab919"


def test_golden_vector() -> None:
    assert aead.seal(KEY, b"sealfs golden plaintext", b"ad", nonce=NONCE) == GOLDEN_SEALED
    assert aead.open_sealed(KEY, GOLDEN_SEALED, b"ad") == b"sealfs golden plaintext"


@given(plaintext=st.binary(max_size=4096), ad=st.binary(max_size=64))
def test_round_trip(plaintext: bytes, ad: bytes) -> None:
    sealed = aead.seal(KEY, plaintext, ad)
    assert len(sealed) == len(plaintext) + aead.NONCE_SIZE + aead.TAG_SIZE
    assert aead.open_sealed(KEY, sealed, ad) == plaintext
    assert aead.open_sealed(KEY, memoryview(sealed), ad) == plaintext


def test_accepts_bytearray_and_memoryview_plaintext() -> None:
    for plaintext in (bytearray(b"abc"), memoryview(b"abc")):
        assert aead.open_sealed(KEY, aead.seal(KEY, plaintext, b""), b"") == b"abc"


def test_random_nonces_differ() -> None:
    nonces = {aead.seal(KEY, b"x", b"")[:12] for _ in range(64)}
    assert len(nonces) == 64


@pytest.mark.parametrize("position", [0, 11, 12, 20, len(GOLDEN_SEALED) - 1])
def test_flipped_bit_is_refused(position: int) -> None:
    tampered = bytearray(GOLDEN_SEALED)
    tampered[position] ^= 0x01
    with pytest.raises(IntegrityError):
        aead.open_sealed(KEY, bytes(tampered), b"ad")


def test_wrong_ad_or_key_is_refused() -> None:
    with pytest.raises(IntegrityError):
        aead.open_sealed(KEY, GOLDEN_SEALED, b"other")
    with pytest.raises(IntegrityError):
        aead.open_sealed(bytes(32), GOLDEN_SEALED, b"ad")


def test_too_short_is_format_error() -> None:
    with pytest.raises(FormatError):
        aead.open_sealed(KEY, bytes(27), b"")
    with pytest.raises(IntegrityError):  # exactly nonce + tag: parses, fails auth
        aead.open_sealed(KEY, bytes(28), b"")


def test_caller_bugs_are_value_errors() -> None:
    with pytest.raises(ValueError, match="key"):
        aead.seal(bytes(16), b"", b"")
    with pytest.raises(ValueError, match="nonce"):
        aead.seal(KEY, b"", b"", nonce=bytes(8))
