"""What `sealfs status` shows about a running volume, as a JSON-ready dict."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from sealfs.errors import FencedError
from sealfs.meta import ops
from sealfs.store.base import request_counts

if TYPE_CHECKING:
    from sealfs.volume.engine import Volume


def volume_status(volume: Volume) -> dict[str, Any]:
    """Generation, commit state, sizes and cache use; no names, no contents."""
    meta = volume.meta
    files = [i for i in meta.inodes.values() if i.is_reg]
    logical = sum(i.size for i in files)
    referenced: set[bytes] = set()
    for inode in files:
        assert inode.extents is not None
        referenced |= inode.extents.chunks()
    chunk_plain = sum(meta.chunks[c].plain_size for c in referenced if c in meta.chunks)
    stored = sum(meta.chunks[c].stored_size for c in referenced if c in meta.chunks)
    store = volume.store
    cache_bytes = store.cache_bytes() if hasattr(store, "cache_bytes") else None
    requests = request_counts(store)  # S3 stores count their requests; others give None
    return {
        "pid": os.getpid(),
        "volume_id": volume.loaded.volume_id.hex(),
        "store": store.describe(),
        "generation": volume.commits.generation,
        "last_commit_ns": volume.commits.last_commit_ns,
        "pending_bytes": volume.files.buffered_bytes + _flushed_uncommitted(volume.commits.pending),
        "buffered_bytes": volume.files.buffered_bytes,
        "pending_records": len(volume.commits.pending),
        "files": len(files),
        "inodes": len(meta.inodes),
        "logical_bytes": logical,
        "unique_bytes": chunk_plain,
        "stored_bytes": stored,
        "chunks": len(referenced),
        "memory_cache_bytes": volume.chunks.cache.nbytes,
        "disk_cache_bytes": cache_bytes,
        "store_requests": requests,
        "read_only": volume.read_only,
        "fenced": isinstance(volume.commits.stopped, FencedError),
        "stopped": None if volume.commits.stopped is None else str(volume.commits.stopped),
        "commit_interval": volume.options.commit_interval,
        "key_epoch": volume.loaded.keys.epoch,
        "rekey": None if volume.rekey is None else volume.rekey.progress.as_dict(),
        "retired_epoch": volume.loaded.keys.retired_epoch,  # a rekey from it is unfinished
    }


def _flushed_uncommitted(pending: list[ops.Op]) -> int:
    """Bytes written since the last commit that already left memory: a file past the
    flush threshold is sealed early, its data records waiting for the next commit. They
    are lost with a crash as much as what is still buffered, and a status that counted
    only the buffer showed 2 MiB pending with 100 MB uncommitted."""
    return sum(row[1] for op in pending if op[0] == ops.DATA for row in op[4])
