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


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("size", [1, 200_000, 512 * 1024 + 1, 3 * MiB + 17])
def test_compressible_data_round_trips(size: int, parallel: bool) -> None:
    data = checkpoint_like(size) if size > 1 else b"a"
    packed = maybe_compress(data, parallel=parallel)
    if size == 1:
        assert packed is None  # nothing to save on one byte
        return
    assert packed is not None and len(packed) < len(data) * 0.97
    assert decompress(packed, 4 * MiB) == data


def test_parallel_compression_makes_one_standard_frame() -> None:
    """Readers (any zstd decoder) must not be able to tell which path made a payload."""
    data = checkpoint_like(2 * MiB)
    packed = maybe_compress(data, parallel=True)
    assert packed is not None
    params = zstandard.get_frame_parameters(packed)
    assert params.content_size == len(data)
    assert zstandard.ZstdDecompressor().decompress(packed) == data


@pytest.mark.parametrize("parallel", [False, True])
def test_incompressible_data_is_stored_raw(parallel: bool) -> None:
    assert maybe_compress(os.urandom(MiB), parallel=parallel) is None


def test_decompress_refuses_output_beyond_the_bound() -> None:
    packed = maybe_compress(b"\0" * (2 * MiB))
    assert packed is not None
    with pytest.raises(FormatError):
        decompress(packed, MiB)


def test_decompress_refuses_a_corrupt_frame() -> None:
    with pytest.raises(FormatError, match="corrupt compressed payload"):
        decompress(b"\x28\xb5\x2f\xfd garbage", MiB)
