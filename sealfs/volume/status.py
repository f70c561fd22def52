"""What `sealfs status` shows about a running volume, as a JSON-ready dict."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import trio.lowlevel

from sealfs.errors import FencedError
from sealfs.meta import ops
from sealfs.store.base import request_counts, store_location

if TYPE_CHECKING:
    from sealfs.meta.model import MetaState
    from sealfs.volume.engine import Volume


SIZES_STEP = 2_000  # inodes summed between two yields to the mount's event loop


async def mounted_volume_status(volume: Volume) -> dict[str, Any]:
    """volume_status for a mount's event loop: the pass over the inodes lets other
    requests in every SIZES_STEP files, where on a volume of 100,000 files it held
    every one of them for one to two seconds."""
    steps = _size_pass(volume.meta)
    while (sizes := next(steps)) is None:
        await trio.lowlevel.checkpoint()
    return volume_status(volume, sizes)


def volume_status(volume: Volume, sizes: dict[str, int] | None = None) -> dict[str, Any]:
    """Generation, commit state, sizes and cache use; no names, no contents.

    sizes: the volume's file and byte counts, summed here when not given.
    """
    if sizes is None:
        sizes = next(step for step in _size_pass(volume.meta) if step is not None)
    store = volume.store
    cache_bytes = store.cache_bytes() if hasattr(store, "cache_bytes") else None
    requests = request_counts(store)  # S3 stores count their requests; others give None
    buffered = volume.files.buffered_bytes
    commits = volume.commits
    return {
        "pid": os.getpid(),
        "volume_id": volume.loaded.volume_id.hex(),
        "store": store.describe(),
        "store_location": store_location(store),  # to tell this store from a copy of it
        "generation": commits.generation,
        "last_commit_ns": commits.last_commit_ns,
        "pending_bytes": buffered
        + _flushed_uncommitted(commits.pending)
        + _flushed_uncommitted(commits.committing),
        "buffered_bytes": buffered,
        # A commit in flight took its records from pending: they count until published.
        "pending_records": len(commits.pending) + len(commits.committing),
        **sizes,
        "memory_cache_bytes": volume.chunks.cache.nbytes,
        "disk_cache_bytes": cache_bytes,
        "store_requests": requests,
        "read_only": volume.read_only,
        "fenced": isinstance(commits.stopped, FencedError),
        "stopped": None if commits.stopped is None else str(commits.stopped),
        # A read-only mount that can no longer follow the writer's commits says why.
        "follow_stopped": None if volume.follower is None else volume.follower.stopped,
        # What it retries meanwhile: looks at an unreachable store, a key out of reach.
        "follow_failing": []
        if volume.follower is None
        else [{"what": what, **asdict(f)} for what, f in volume.follower.failing()],
        # The commits failing since the last that succeeded (a store unreachable or full).
        "commit_failure": None if commits.failing is None else asdict(commits.failing),
        "commit_running_since_ns": commits.running_since_ns,
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


def _size_pass(meta: MetaState) -> Iterator[dict[str, int] | None]:
    """Files and bytes, in one pass over the inodes: yields None at each pause (every
    SIZES_STEP inodes), then the sizes.

    Each file is read as it is when the pass reaches it: files written meanwhile may
    count as before or after, as they would for a du running beside the writes.

    logical_bytes is the files' sizes, holes included (du --apparent-size);
    data_bytes leaves the holes out, so that the dedup ratio (data over unique) does not
    count a sparse file's holes as bytes saved. A hard-linked file counts once, as du
    counts it. stored_bytes is what the chunks of today's files take in the store;
    store_chunk_bytes is every chunk the volume has stored, the ones no file references
    any more included (nothing is collected yet), which is what the store's c/ holds.
    """
    files = logical = data = 0
    referenced: set[bytes] = set()
    for count, inode in enumerate(list(meta.inodes.values()), 1):
        if count % SIZES_STEP == 0:
            yield None
        extents = inode.extents
        if extents is None:  # set for regular files only
            continue
        files += 1
        logical += inode.size
        data += extents.mapped_bytes()
        referenced.update(extents.chunk_ids())
    unique = stored = 0
    table = meta.chunks
    for chunk_id in referenced:
        info = table.get(chunk_id)
        if info is not None:
            unique += info.plain_size
            stored += info.stored_size
    yield {
        "files": files,
        "inodes": len(meta.inodes),
        "logical_bytes": logical,
        "data_bytes": data,
        "unique_bytes": unique,
        "stored_bytes": stored,
        "chunks": len(referenced),
        "store_chunk_bytes": meta.chunks_stored_bytes,  # kept as rows are put (as for statfs)
        "store_chunks": len(table),
    }
