"""Compression of sealed payloads: when it is used, and that every path reads back."""

from __future__ import annotations

import json
import os

import pytest
import zstandard

from sealfs.chunking.compress import decompress, maybe_compress
from sealfs.errors import FormatError

MiB = 1 << 20


def checkpoint_like(size: int) -> bytes:
    """JSON records: compressible, but not trivially (counters and random hex)."""
    out = bytearray()
    k = 0
    while len(out) < size:
        record = {"step": k, "id": os.urandom(8).hex(), "text": f"observation {k % 97}"}
        out += json.dumps(record).encode() + b"\n"
        k += 1
    return bytes(out[:size])


@pytest.mark.parametrize("size", [1, 200_000, 512 * 1024 + 1, 3 * MiB + 17])
def test_compressible_data_round_trips(size: int) -> None:
    data = checkpoint_like(size) if size > 1 else b"a"
    packed = maybe_compress(data)
    if size == 1:
        assert packed is None  # nothing to save on one byte
        return
    assert packed is not None and len(packed) < len(data) * 0.97
    assert decompress(packed, 4 * MiB) == data


def test_frames_record_their_content_size() -> None:
    """decompress() bounds memory by the size a frame claims: every frame must claim one."""
    data = checkpoint_like(2 * MiB)
    packed = maybe_compress(data)
    assert packed is not None
    assert zstandard.get_frame_parameters(packed).content_size == len(data)


def test_incompressible_data_is_stored_raw() -> None:
    assert maybe_compress(os.urandom(MiB)) is None


def test_decompress_refuses_output_beyond_the_bound() -> None:
    packed = maybe_compress(b"\0" * (2 * MiB))
    assert packed is not None
    with pytest.raises(FormatError):
        decompress(packed, MiB)


def test_decompress_refuses_a_corrupt_frame() -> None:
    with pytest.raises(FormatError, match="corrupt compressed payload"):
        decompress(b"\x28\xb5\x2f\xfd garbage", MiB)
