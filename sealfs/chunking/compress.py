"""zstd compression for sealed payloads, used only where it pays.

Compression, not AES, is the expensive step of the write path (perf notes:
zstd level 3 at ~166 MB/s against AES-GCM at ~9 GB/s), so incompressible data
is detected on a small sample and stored raw. Decompression is bounded so a
hostile or corrupt frame cannot balloon memory.
"""

from __future__ import annotations

import os
import threading

import zstandard

from sealfs.errors import FormatError

_SAMPLE = 64 * 1024
_local = threading.local()
# zstd cuts input into jobs of at least this size for its worker threads.
_JOB_SIZE = 512 * 1024
_PARALLEL_WORKERS = max(2, min(4, os.cpu_count() or 2))
_parallel_lock = threading.Lock()  # one multi-threaded context, used by one caller at a time
_parallel: dict[int, zstandard.ZstdCompressor] = {}


def _compressor(level: int) -> zstandard.ZstdCompressor:
    # Compressor objects are not thread-safe; one per thread and level.
    cache: dict[int, zstandard.ZstdCompressor] = _local.__dict__.setdefault("c", {})
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level)
    return cache[level]


def _parallel_compress(data: bytes | bytearray | memoryview, level: int) -> bytes:
    """One standard frame made by zstd's worker threads (readers cannot tell the difference).

    A single context serves every caller: it owns worker threads and job buffers, so
    one per thread would cost memory, and callers of this path are rare (see
    maybe_compress) and would compete for the same cores anyway.
    """
    with _parallel_lock:
        compressor = _parallel.get(level)
        if compressor is None:
            params = zstandard.ZstdCompressionParameters.from_level(
                level, threads=_PARALLEL_WORKERS, job_size=_JOB_SIZE
            )
            compressor = _parallel[level] = zstandard.ZstdCompressor(compression_params=params)
        packed: bytes = compressor.compress(data)
    return packed


def maybe_compress(
    data: bytes | bytearray | memoryview, level: int = 1, *, parallel: bool = False
) -> bytes | None:
    """Return the compressed bytes if they save at least 3 %, else None (store raw).

    parallel: spread one large input over several cores. Meant for a commit
    that a caller waits for (fsync): a checkpoint of one chunk would otherwise
    leave every core but one idle while its writer waits. Throughput-bound
    paths seal many chunks at once and gain nothing from it.
    """
    if len(data) > 2 * _SAMPLE:
        sample = _compressor(level).compress(data[:_SAMPLE])
        if len(sample) > _SAMPLE * 0.95:
            return None
    if parallel and len(data) > _JOB_SIZE:
        packed = _parallel_compress(data, level)
    else:
        packed = _compressor(level).compress(data)
    return packed if len(packed) < len(data) * 0.97 else None


def decompress(data: bytes, max_size: int) -> bytes:
    """Inverse of maybe_compress; FormatError if the frame is bad or would exceed max_size.

    zstd allocates what a frame header claims and only applies max_output_size
    to frames that claim nothing, so the claim is checked here first.
    """
    try:
        claimed = zstandard.frame_content_size(data)
        if claimed > max_size:
            raise FormatError(f"compressed payload claims {claimed} bytes, over {max_size}")
        out: bytes = zstandard.ZstdDecompressor().decompress(data, max_output_size=max_size)
    except zstandard.ZstdError as exc:
        raise FormatError(f"corrupt compressed payload: {exc}") from None
    return out
