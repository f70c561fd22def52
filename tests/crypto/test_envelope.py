"""The sealed-object envelope: golden bytes, tamper matrix, hostile input."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from hypothesis import given
from hypothesis import strategies as st

from sealfs.crypto.envelope import (
    ENVELOPE_OVERHEAD,
    FLAG_DELTA,
    FLAG_ZSTD,
    ObjectKind,
    chunk_binding,
    generation_binding,
    open_object,
    read_envelope_epoch,
    seal_object,
)
from sealfs.errors import FormatError, IntegrityError, UnsupportedVersionError

KEY = bytes(range(32))
NONCE = bytes(range(100, 112))
VOLUME_ID = bytes(range(16))
CHUNK_ID = bytes(range(32, 64))
BINDING = chunk_binding(VOLUME_ID, CHUNK_ID)

# seal_object(KEY, CHUNK, BINDING, b"chunk data", flags=FLAG_ZSTD, epoch=3, nonce=NONCE)
GOLDEN_CHUNK = bytes.fromhex(
    "53465301010100036465666768696a6b6c6d6e6f2b73ab0812c932ff4a03c7024713319f7e12446e011d74864a75"
)
# seal_object(KEY, SEGMENT, generation_binding(VOLUME_ID, 7), b"segment", nonce=NONCE)
GOLDEN_SEGMENT = bytes.fromhex(
    "53465301020000006465666768696a6b6c6d6e6f3b7eb90b1c8722df49bc73cc99a2be68d933a285baab9e"
)

ALLOWED = (FormatError, IntegrityError)  # UnsupportedVersionError is a FormatError


def test_golden_chunk() -> None:
    sealed = seal_object(
        KEY, ObjectKind.CHUNK, BINDING, b"chunk data", flags=FLAG_ZSTD, epoch=3, nonce=NONCE
    )
    assert sealed == GOLDEN_CHUNK
    assert open_object(KEY, ObjectKind.CHUNK, BINDING, sealed, epoch=3) == (
        FLAG_ZSTD,
        b"chunk data",
    )


def test_golden_chunk_independently() -> None:
    # Rebuild the documented layout by hand with the raw AEAD primitive.
    header = b"SFS" + bytes([1, ObjectKind.CHUNK, FLAG_ZSTD]) + (3).to_bytes(2, "big")
    body = AESGCM(KEY).encrypt(NONCE, b"chunk data", header + VOLUME_ID + CHUNK_ID)
    assert header + NONCE + body == GOLDEN_CHUNK


def test_golden_segment() -> None:
    binding = generation_binding(VOLUME_ID, 7)
    assert binding == VOLUME_ID + bytes(7) + b"\x07"
    assert seal_object(KEY, ObjectKind.SEGMENT, binding, b"segment", nonce=NONCE) == GOLDEN_SEGMENT
    assert open_object(KEY, ObjectKind.SEGMENT, binding, GOLDEN_SEGMENT) == (0, b"segment")


def test_overhead() -> None:
    assert ENVELOPE_OVERHEAD == 36
    assert len(GOLDEN_CHUNK) == ENVELOPE_OVERHEAD + len(b"chunk data")


def _flip(data: bytes, position: int, mask: int = 0x01) -> bytes:
    out = bytearray(data)
    out[position] ^= mask
    return bytes(out)


# Tamper matrix: each case must raise, and never yield plaintext.
TAMPER_CASES = {
    "magic": (_flip(GOLDEN_CHUNK, 0), FormatError),
    "version": (_flip(GOLDEN_CHUNK, 3, 0x02), UnsupportedVersionError),
    "kind-unknown": (_flip(GOLDEN_CHUNK, 4, 0x80), FormatError),
    "kind-other": (_flip(GOLDEN_CHUNK, 4, 0x03), IntegrityError),  # 1 -> 2 (segment)
    "reserved-flag": (_flip(GOLDEN_CHUNK, 5, 0x80), FormatError),
    "zstd-flag-cleared": (_flip(GOLDEN_CHUNK, 5, 0x01), IntegrityError),
    "delta-flag-for-zstd": (_flip(GOLDEN_CHUNK, 5, 0x03), IntegrityError),  # 0x01 -> 0x02
    "delta-flag-with-zstd": (_flip(GOLDEN_CHUNK, 5, 0x02), FormatError),
    "delta-flag-on-segment": (_flip(GOLDEN_SEGMENT, 5, 0x02), FormatError),
    "epoch": (_flip(GOLDEN_CHUNK, 7), IntegrityError),
    "nonce-first": (_flip(GOLDEN_CHUNK, 8), IntegrityError),
    "nonce-last": (_flip(GOLDEN_CHUNK, 19), IntegrityError),
    "body": (_flip(GOLDEN_CHUNK, 22), IntegrityError),
    "tag": (_flip(GOLDEN_CHUNK, len(GOLDEN_CHUNK) - 1, 0x80), IntegrityError),
    "truncated-tag": (GOLDEN_CHUNK[:-1], IntegrityError),
    "truncated-below-overhead": (GOLDEN_CHUNK[:35], FormatError),
    "truncated-header": (GOLDEN_CHUNK[:5], FormatError),
    "empty": (b"", FormatError),
    "appended": (GOLDEN_CHUNK + b"\x00", IntegrityError),
}


@pytest.mark.parametrize("case", sorted(TAMPER_CASES))
def test_tamper_matrix(case: str) -> None:
    data, error = TAMPER_CASES[case]
    with pytest.raises(error):
        open_object(KEY, ObjectKind.CHUNK, BINDING, data)


@pytest.mark.parametrize(
    "binding",
    [
        chunk_binding(VOLUME_ID, bytes(32)),  # another chunk id: renamed object
        chunk_binding(bytes(16), CHUNK_ID),  # another volume
    ],
)
def test_swapped_chunk_binding(binding: bytes) -> None:
    with pytest.raises(IntegrityError):
        open_object(KEY, ObjectKind.CHUNK, binding, GOLDEN_CHUNK)


@pytest.mark.parametrize(
    "binding", [generation_binding(VOLUME_ID, 8), generation_binding(bytes(16), 7)]
)
def test_swapped_generation_binding(binding: bytes) -> None:
    with pytest.raises(IntegrityError):
        open_object(KEY, ObjectKind.SEGMENT, binding, GOLDEN_SEGMENT)


def test_segment_replayed_as_snapshot() -> None:
    with pytest.raises(IntegrityError, match="SNAPSHOT"):
        open_object(KEY, ObjectKind.SNAPSHOT, generation_binding(VOLUME_ID, 7), GOLDEN_SEGMENT)


def test_wrong_epoch_and_wrong_key() -> None:
    with pytest.raises(IntegrityError, match="epoch"):
        open_object(KEY, ObjectKind.CHUNK, BINDING, GOLDEN_CHUNK, epoch=2)
    with pytest.raises(IntegrityError):
        open_object(bytes(32), ObjectKind.CHUNK, BINDING, GOLDEN_CHUNK)


def test_read_envelope_epoch() -> None:
    assert read_envelope_epoch(GOLDEN_CHUNK) == 3
    assert read_envelope_epoch(memoryview(GOLDEN_SEGMENT)) == 0
    with pytest.raises(FormatError):
        read_envelope_epoch(b"SFS")


def test_caller_bugs_are_value_errors() -> None:
    with pytest.raises(ValueError, match="flags"):
        seal_object(KEY, ObjectKind.CHUNK, BINDING, b"", flags=0x04)
    with pytest.raises(ValueError, match="flags"):
        seal_object(KEY, ObjectKind.CHUNK, BINDING, b"", flags=FLAG_DELTA | FLAG_ZSTD)
    segment = generation_binding(VOLUME_ID, 7)
    with pytest.raises(ValueError, match="flags"):
        seal_object(KEY, ObjectKind.SEGMENT, segment, b"", flags=FLAG_DELTA)
    with pytest.raises(ValueError, match="epoch"):
        seal_object(KEY, ObjectKind.CHUNK, BINDING, b"", epoch=1 << 16)
    with pytest.raises(ValueError, match="binding"):
        seal_object(KEY, ObjectKind.CHUNK, VOLUME_ID, b"")
    with pytest.raises(ValueError, match="binding"):
        open_object(KEY, ObjectKind.SEGMENT, b"", GOLDEN_SEGMENT)
    with pytest.raises(ValueError):
        chunk_binding(VOLUME_ID, bytes(31))
    with pytest.raises(ValueError):
        generation_binding(VOLUME_ID, -1)


@given(
    kind=st.sampled_from(ObjectKind),
    plaintext=st.binary(max_size=2048),
    flags=st.sampled_from([0, FLAG_ZSTD]),
    epoch=st.integers(0, 0xFFFF),
    gen=st.integers(0, (1 << 64) - 1),
)
def test_round_trip(kind: ObjectKind, plaintext: bytes, flags: int, epoch: int, gen: int) -> None:
    binding = (
        chunk_binding(VOLUME_ID, gen.to_bytes(32, "big"))
        if kind is ObjectKind.CHUNK
        else generation_binding(VOLUME_ID, gen)
    )
    sealed = seal_object(KEY, kind, binding, plaintext, flags=flags, epoch=epoch)
    assert read_envelope_epoch(sealed) == epoch
    assert open_object(KEY, kind, binding, memoryview(sealed), epoch=epoch) == (flags, plaintext)


@given(data=st.binary(max_size=256))
def test_arbitrary_bytes_only_raise_format_or_integrity(data: bytes) -> None:
    with pytest.raises(ALLOWED):
        open_object(KEY, ObjectKind.CHUNK, BINDING, data)


@given(tail=st.binary(max_size=128), kind=st.integers(0, 255), flags=st.integers(0, 255))
def test_plausible_headers_only_raise_format_or_integrity(
    tail: bytes, kind: int, flags: int
) -> None:
    data = b"SFS\x01" + bytes([kind, flags]) + b"\x00\x00" + tail
    with pytest.raises(ALLOWED):
        open_object(KEY, ObjectKind.CHUNK, BINDING, data)
