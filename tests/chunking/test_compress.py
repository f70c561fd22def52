"""Compression of sealed payloads: when it is used, and that every path reads back."""

from __future__ import annotations

import json
import os

import pytest
import zstandard

from sealfs.chunking.compress import (
    MAX_DELTA_WINDOW_LOG,
    compress_delta,
    decompress,
    decompress_delta,
    maybe_compress,
)
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


def test_a_difference_reads_back_with_its_base_only() -> None:
    base = checkpoint_like(MiB)
    data = base[:300_000] + b"an edit in the middle" + base[300_000:]
    frame = compress_delta(data, base)
    assert len(frame) < 200  # the edit and a few matches: the base holds the rest
    assert decompress_delta(frame, base, 4 * MiB) == data
    other = base[:-1] + b"!"  # a base other than the writer's: zstd's checksum catches it
    with pytest.raises(FormatError, match="checksum"):
        decompress_delta(frame, other, 4 * MiB)
    with pytest.raises(FormatError, match="claims"):
        decompress_delta(frame, base, len(data) - 1)


def test_a_difference_asking_for_a_larger_window_is_refused() -> None:
    """The window bounds what a reader allocates; a writer needs at most 2^23 (a 4 MiB
    base and a 4 MiB chunk)."""
    params = zstandard.ZstdCompressionParameters(window_log=MAX_DELTA_WINDOW_LOG + 1)
    stream = zstandard.ZstdCompressor(compression_params=params).compressobj()
    frame = stream.compress(os.urandom(1000)) + stream.flush()  # no size: the window stays
    assert zstandard.get_frame_parameters(frame).window_size > 1 << MAX_DELTA_WINDOW_LOG
    with pytest.raises(FormatError, match="too much memory"):
        decompress_delta(frame, b"base", 4 * MiB)
