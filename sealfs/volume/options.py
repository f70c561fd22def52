"""Tunables of a mounted volume, with the defaults the README documents."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VolumeOptions:
    commit_interval: float = 1.0  # seconds between background commits
    sync_on_close: bool = False  # close(2) waits for a commit
    read_only: bool = False
    io_threads: int = 8  # store requests and sealing work in flight (plus RESERVED_WORKERS)
    chunk_cache_bytes: int = 32 << 20  # decrypted chunks kept in memory
    flush_threshold: int = 32 << 20  # buffered bytes that start an early flush
    max_buffered: int = 64 << 20  # buffered bytes at which writers wait
    max_dirty_files: int = 2048  # files with unsealed bytes at which writers wait
    max_pending_records: int = 64 << 20  # bytes of records awaiting a commit at which changes wait
    # Keep the index that finds a similar chunk to store a new one as a difference from
    # (tens of MiB for a large volume): only a writer of new file data needs it.
    index_similar: bool = True
