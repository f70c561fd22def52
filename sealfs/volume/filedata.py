"""File contents: buffered writes, reads through three layers, and flushes to chunks.

A regular file's bytes come from three layers, newest on top: its dirty
buffer (written, not yet flushed), its flushing buffer (detached by a flush
that is sealing it right now), and its extent map (sealed chunks). A flush
re-chunks only the written ranges plus those small neighbouring pieces that
are at most twice as long as what it seals, or short fragments inside the
file (see _regions), so a small write never rewrites a large chunk and
fragments are merged back without re-sealing the same bytes at every commit.

A flush that must seal a file up to its end (a commit) cuts its last chunk
where the data happens to end, not where the content says. The file
remembers that chunk; the next flush that continues the file re-chunks from
its start, so a file streamed across commits ends up cut as in one pass (and
a rewritten file dedups against its old version).

At most one flush of a file runs at a time (its flushing layer is then set),
and truncation waits for it to end, so an extent map is only replaced by the
flush that read it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import trio

from sealfs.chunking.fastcdc import MAX_CHUNK, MIN_CHUNK, Chunker
from sealfs.errors import FormatError, IntegrityError, ObjectNotFoundError, first_leaf
from sealfs.meta import ops
from sealfs.meta.extents import Extent, ExtentMap
from sealfs.meta.model import ChunkInfo, Inode, MetaState
from sealfs.volume.buffers import BlockPool, SparseBuffer
from sealfs.volume.chunks import AnyOf, Chunks, OnUnavailable, chunk_name, small_batch_size

log = logging.getLogger("sealfs.volume")

WINDOW = 16 << 20  # bytes cut per CDC pass while streaming a flush
# Chunks prefetched ahead of a sequential reader. A cold read is bound by fetching
# chunk files that lie scattered on disk, so depth matters: 4 MiB kept about
# three in flight (366 MB/s cold, random data), 8-16 MiB gave 465-483 MB/s,
# 32 MiB (the whole chunk cache) evicted chunks before they were read (330 MB/s).
READAHEAD = 12 << 20
MAX_JOBS = 6  # chunks (or batches of small ones) sealed or uploaded at once per flush
FRAGMENT = MIN_CHUNK // 4  # a piece this short merges with a write inside the file

Spawn = Callable[[Callable[[], Coroutine[Any, Any, None]]], None]


def _set_event() -> trio.Event:
    event = trio.Event()
    event.set()
    return event


@dataclass(eq=False)
class FileBuffers:
    dirty: SparseBuffer
    flushing: SparseBuffer | None = None
    idle: trio.Event = field(default_factory=_set_event)  # set while nothing is flushing


@dataclass(frozen=True)
class Region:
    """A span to re-chunk: [start, end) made of new bytes and small old pieces."""

    start: int
    end: int


def record(state: MetaState, sink: list[ops.Op], op: ops.Op) -> None:
    """Apply a record to the live state and queue it for the next commit."""
    ops.apply(state, op, live=True)
    sink.append(op)


class FileData:
    """Buffers, reads and flushes for every regular file of one volume."""

    def __init__(
        self, meta: MetaState, chunks: Chunks, chunker: Chunker, spawn: Spawn, pool: BlockPool
    ) -> None:
        self._meta = meta
        self._chunks = chunks
        self._chunker = chunker
        self._spawn = spawn
        self.pool = pool
        self._read_pos: dict[int, int] = {}  # where each file's last read ended
        # Only files with buffered bytes or a flush running: an entry per file ever
        # written would cost memory (~0.5 KiB each) and every commit a scan.
        self.files: dict[int, FileBuffers] = {}
        # A file's last extent when a flush cut it only because the data ended there.
        self.forced: dict[int, Extent] = {}
        self._dirty: dict[int, None] = {}  # files with dirty bytes, in first-write order
        self.buffered_bytes = 0  # dirty plus flushing, across files
        self.space = trio.Event()  # set when buffered_bytes drops

    def buffers(self, ino: int) -> FileBuffers:
        fb = self.files.get(ino)
        if fb is None:
            fb = self.files[ino] = FileBuffers(SparseBuffer(self.pool))
        return fb

    def buffered_in(self, ino: int) -> int:
        """Bytes of ino held in memory, dirty or being flushed (the two may overlap)."""
        fb = self.files.get(ino)
        if fb is None:
            return 0
        return fb.dirty.nbytes + (fb.flushing.nbytes if fb.flushing is not None else 0)

    def dirty_inodes(self) -> list[int]:
        return list(self._dirty)

    def has_dirty(self) -> bool:
        return bool(self._dirty)

    @property
    def dirty_files(self) -> int:
        """Files with dirty bytes (not yet taken by a flush)."""
        return len(self._dirty)

    # -- writes and truncation ---------------------------------------------------------

    def write(self, inode: Inode, offset: int, data: bytes) -> None:
        """Buffer a write (no I/O); the caller updates times and applies back-pressure."""
        fb = self.buffers(inode.ino)
        before = fb.dirty.nbytes
        fb.dirty.write(offset, data)
        self.buffered_bytes += fb.dirty.nbytes - before
        if fb.dirty:
            self._dirty[inode.ino] = None
        inode.size = max(inode.size, offset + len(data))

    async def wait_idle(self, ino: int) -> None:
        """Wait until no flush of ino runs; the caller must then not await before truncating.

        The buffers are looked up again after each wait: a flush that ends with nothing
        left drops them, and a write and a commit may start a new flush of new buffers
        before this task runs again (a truncate then raced that flush, and the bytes it
        cut came back)."""
        while (fb := self.files.get(ino)) is not None and fb.flushing is not None:
            await fb.idle.wait()

    def truncate_buffers(self, ino: int, size: int) -> None:
        """Drop buffered bytes beyond size; the caller has just waited for wait_idle."""
        fb = self.files.get(ino)
        if fb is not None:
            before = fb.dirty.nbytes
            fb.dirty.truncate(size)
            self.buffered_bytes -= before - fb.dirty.nbytes
            if not fb.dirty:
                self._dirty.pop(ino, None)
            self._drop_idle_blocks()
            if fb.dirty.nbytes < before:
                self.wake_space_waiters()

    def forget(self, ino: int) -> None:
        """The inode is gone: drop its buffers without flushing them."""
        self.buffered_bytes -= self.buffered_in(ino)
        fb = self.files.pop(ino, None)
        self._dirty.pop(ino, None)
        self.forced.pop(ino, None)
        if fb is not None:
            fb.dirty.release()  # a flushing layer is released when its flush ends
            self._drop_idle_blocks()
            self.wake_space_waiters()

    # -- reads ---------------------------------------------------------------------------

    async def read(self, inode: Inode, offset: int, size: int) -> memoryview:
        """Bytes [offset, offset + size) clipped to the file size, as of the call.

        A view, not a copy: a read inside one chunk with nothing buffered over it
        (nearly every request of a sequential reader) is a slice of the cached,
        immutable plaintext, which pyfuse3 replies from without copying. Such a
        view keeps its chunk (at most MAX_CHUNK bytes) alive while it is held.
        """
        end = min(offset + size, inode.size)
        if offset >= end:
            return memoryview(b"")
        assert inode.extents is not None
        pieces = inode.extents.pieces(offset, end)
        fb = self.files.get(inode.ino)
        layers = []
        if fb is not None:
            layers = [b.copy_range(offset, end) for b in (fb.flushing, fb.dirty) if b]
        datas = await self._fetch(pieces)
        self._readahead(inode.ino, inode.extents, offset, end)
        if not any(layers):
            if len(pieces) == 1 and pieces[0].length == end - offset:
                return _slice(datas[0], pieces[0])
            return memoryview(b"".join(_spans(pieces, datas, offset, end)))  # one copy
        out = bytearray(b"".join(_spans(pieces, datas, offset, end)))
        for layer in layers:
            layer.overlay(out, offset)
        return memoryview(out)

    async def _fetch(self, pieces: list[Extent]) -> list[bytes]:
        ids = list(dict.fromkeys(p.chunk for p in pieces))
        if len(ids) == 1:
            got = {ids[0]: await self._chunks.read(ids[0])}
        else:
            got = {}

            async def one(cid: bytes) -> None:
                got[cid] = await self._chunks.read(cid)

            async with _typed_nursery() as nursery:  # a bad chunk raises IntegrityError itself
                for cid in ids:
                    nursery.start_soon(one, cid)
        return [got[p.chunk] for p in pieces]

    def _readahead(self, ino: int, extents: ExtentMap, offset: int, end: int) -> None:
        """Prefetch the next chunks when a file is read sequentially.

        Read positions are kept apart from write buffers: most files read after
        a mount were never written in it.
        """
        sequential = self._read_pos.pop(ino, None) == offset
        self._read_pos[ino] = end  # re-inserted: the dict's order is the readers' recency
        if len(self._read_pos) > 4096:  # bounded: forget the readers idle longest
            del self._read_pos[next(iter(self._read_pos))]
        if not sequential:
            return
        for piece in extents.pieces(end, end + READAHEAD):
            # Most requests find the next chunks cached or on their way: spawn no task then.
            if self._chunks.wanted(piece.chunk):
                cid = piece.chunk
                self._spawn(lambda cid=cid: self._chunks.prefetch(cid))  # type: ignore[misc]

    # -- flushing ------------------------------------------------------------------------

    def detach(self, inode: Inode) -> Detached | None:
        """Move a file's dirty bytes to its flushing layer, if it has some and is idle."""
        fb = self.files.get(inode.ino)
        if fb is None or not fb.dirty or fb.flushing is not None:
            return None
        fb.flushing, fb.dirty = fb.dirty, SparseBuffer(self.pool)
        self._dirty.pop(inode.ino, None)
        fb.idle = trio.Event()
        return Detached(inode, fb, fb.flushing, inode.size)

    def finish(self, job: Detached, tail: SparseBuffer | None, failed: bool) -> None:
        """End a flush: release the flushing layer, putting back what was not sealed."""
        fb = job.buffers
        fb.flushing = None
        fb.idle.set()
        if self.files.get(job.inode.ino) is fb:  # else deleted: forget() counted its bytes
            self._settle(job, job.data if failed else tail)
        job.data.release()
        self._drop_idle_blocks()

    def _settle(self, job: Detached, keep: SparseBuffer | None) -> None:
        """Account for a live file's ended flush, buffering kept bytes again under newer
        writes (a function of its own, so that its views of keep are gone when it returns
        and keep's blocks can be reused)."""
        fb = job.buffers
        self.buffered_bytes -= job.data.nbytes
        if keep:
            before = fb.dirty.nbytes
            for start, data in keep.ranges():
                fb.dirty.write_under(start, data)
            self.buffered_bytes += fb.dirty.nbytes - before
        if fb.dirty:
            self._dirty[job.inode.ino] = None
        else:
            del self.files[job.inode.ino]  # nothing buffered, nothing flushing
        self.wake_space_waiters()

    def wake_space_waiters(self) -> None:
        """Wake whoever waits for buffered bytes to drop (or, after a fence, to see that
        they never will); later waiters wait for the next drop (an event left set would
        make their wait loops spin)."""
        self.space.set()
        self.space = trio.Event()

    def _drop_idle_blocks(self) -> None:
        if not self.buffered_bytes:
            self.pool.clear()

    def small_piece(self, job: Detached) -> tuple[int, bytes] | None:
        """(offset, bytes) when the job is one range below the minimum chunk size with no
        neighbouring fragment to merge: it becomes one chunk, sealed in a batch."""
        ranges = job.data.ranges()
        if len(ranges) != 1 or len(ranges[0][1]) >= MIN_CHUNK:
            return None
        start, buf = ranges[0]
        assert job.inode.extents is not None
        regions = _regions(job.data, job.inode.extents, self.forced.get(job.inode.ino), job.size)
        if regions != [Region(start, start + len(buf))]:
            return None
        return start, bytes(buf)

    async def flush_small(
        self,
        group: list[tuple[Detached, int, bytes]],
        sink: list[ops.Op],
        on_unavailable: OnUnavailable,
    ) -> None:
        """Seal many small files in one worker-thread call, then record each of them.

        on_unavailable: as for flush.
        Raises StoreError and friends; then nothing was recorded for any of them.
        """
        pieces = [piece for _, _, piece in group]
        stored = await self._chunks.store_many(pieces, self._meta.chunks, on_unavailable)
        for (job, start, piece), chunk in zip(group, stored, strict=True):
            if chunk.uploaded:  # new, or replacing a damaged copy: its row changes too
                record(self._meta, sink, ops.chunk(chunk.chunk_id, chunk.info()))
            extent = Extent(start, len(piece), chunk.chunk_id, 0)
            op = ops.data(job.inode.ino, start, start + len(piece), [extent], job.size)
            if job.inode.ino in self._meta.inodes:
                record(self._meta, sink, op)
            else:
                sink.append(op)  # deleted meanwhile: the log still needs the history
            if extent.end >= job.size:  # cut where the data ends, like flush() at end of file
                self._chunks.cache.put(chunk.chunk_id, piece)
                self._set_forced(job, extent)

    async def flush(
        self,
        job: Detached,
        sink: list[ops.Op],
        *,
        keep_tail: bool,
        on_unavailable: OnUnavailable,
    ) -> SparseBuffer:
        """Seal a detached buffer into chunks and record the new extents into sink.

        Returns the bytes kept back (a partial last chunk at end of file, when
        keep_tail asks for it, so that a streaming writer is cut as in one pass).
        Without keep_tail the last chunk is cut at the end of the data; it is
        remembered as the file's forced cut, for the next flush to re-chunk.
        on_unavailable gets the StoreUnavailableError as soon as an upload gives up
        on the store, before the uploads still running end (the flush itself may
        end with another error, or be cancelled).
        Raises StoreError and friends; then nothing was recorded for this file.
        """
        inode = job.inode
        assert inode.extents is not None
        seal = partial(self._seal_regions, job, keep_tail=keep_tail, on_unavailable=on_unavailable)
        try:
            regions = _regions(job.data, inode.extents, self.forced.get(inode.ino), job.size)
            sealed = await seal(regions)
        except (IntegrityError, FormatError, ObjectNotFoundError) as exc:
            # Only the old bytes read for merging or resuming can be damaged; those are an
            # optimisation. A damaged neighbour must not keep the new bytes (and with them
            # every later commit) from becoming durable: seal the written ranges alone.
            log.warning("sealing written bytes of inode %d unmerged: %s", inode.ino, exc)
            self.forced.pop(inode.ino, None)
            regions = _regions(job.data, inode.extents, None, job.size, merge=False)
            sealed = await seal(regions)
        fresh, data_ops, tail, forced = sealed
        for cid, c in fresh.items():  # stored whatever became of the file: replay adds them too
            record(self._meta, sink, ops.chunk(cid, c))
        if inode.ino in self._meta.inodes:
            for op in data_ops:
                record(self._meta, sink, op)
        else:
            sink.extend(data_ops)  # deleted meanwhile: the log still needs the history
        self._set_forced(job, forced)
        return tail

    async def _seal_regions(
        self,
        job: Detached,
        regions: list[Region],
        *,
        keep_tail: bool,
        on_unavailable: OnUnavailable,
    ) -> tuple[dict[bytes, ChunkInfo], list[ops.Op], SparseBuffer, Extent | None]:
        """Seal each region; return the new chunks, the data records, the kept tail and
        the file's forced cut after them. Records nothing (the caller does)."""
        inode = job.inode
        assert inode.extents is not None
        fresh: dict[bytes, ChunkInfo] = {}
        data_ops: list[ops.Op] = []
        tail = SparseBuffer()
        forced = self.forced.get(inode.ino)
        small = [(k, region) for k, region in enumerate(regions) if _is_small(region)]
        sealed: dict[int, tuple[list[Extent], bytes]] = {}
        slots = trio.Semaphore(MAX_JOBS)  # bounds the memory held by chunks in flight
        async with _typed_nursery() as nursery:
            nursery.start_soon(
                self._seal_small_regions, job, small, fresh, sealed, slots, on_unavailable
            )
            for k, region in enumerate(regions):
                if not _is_small(region):
                    sealed[k] = await self._seal_region(
                        region,
                        job.data,
                        inode.extents,
                        fresh,
                        slots,
                        at_eof=region.end >= job.size,
                        keep_tail=keep_tail,
                        on_unavailable=on_unavailable,
                    )
        for k, region in enumerate(regions):
            at_eof = region.end >= job.size
            extents, kept = sealed[k]
            end = region.end - len(kept)
            data_ops.append(ops.data(inode.ino, region.start, end, extents, job.size))
            if kept:
                tail.write(end, kept)
            if at_eof:  # the file now ends in a kept tail (still buffered) or a cut chunk
                forced = None if kept else extents[-1]
        return fresh, data_ops, tail, forced

    def _set_forced(self, job: Detached, forced: Extent | None) -> None:
        """Remember the file's forced cut, once its flush is recorded. A forced chunk that
        the flush superseded leaves the LRU once no extent of the file reads it any more
        (a write that ended the file inside it leaves a remainder that does): a long
        streaming write would otherwise fill the read cache, one per commit."""
        ino = job.inode.ino
        old = self.forced.pop(ino, None)
        if forced is not None and self.files.get(ino) is job.buffers:  # not deleted meanwhile
            self.forced[ino] = forced
        extents = job.inode.extents
        if old is None or old == forced or extents is None:
            return
        ends = (extents.covering(old.start), extents.covering(old.end - 1))
        if all(e is None or e.chunk != old.chunk for e in ends):
            self._chunks.cache.discard(old.chunk)

    async def _seal_small_regions(
        self,
        job: Detached,
        regions: list[tuple[int, Region]],
        fresh: dict[bytes, ChunkInfo],
        sealed: dict[int, tuple[list[Extent], bytes]],
        slots: trio.Semaphore,
        on_unavailable: OnUnavailable,
    ) -> None:
        """Seal (key, region) pairs of regions shorter than MIN_CHUNK in batches, each
        into sealed[key] as _seal_region would return it.

        CDC cuts nothing inside so short a region (it is one chunk, kept back never), so
        each needs only its upload, and store_many takes a batch of them per worker
        call. One at a time, the CDC pass and the upload of each cost two worker-thread
        round trips: 2,000 random 4 KiB writes to a 256 MiB file took a 2.0 s fsync.
        """
        assert job.inode.extents is not None
        extents = job.inode.extents
        known = AnyOf(self._meta.chunks, fresh)

        async def store(batch: list[tuple[int, Region]], pieces: list[bytes]) -> None:
            try:
                stored = await self._chunks.store_many(pieces, known, on_unavailable)
            finally:
                slots.release()
            for (key, region), piece, chunk in zip(batch, pieces, stored, strict=True):
                if chunk.uploaded:
                    fresh[chunk.chunk_id] = chunk.info()
                if region.end >= job.size:  # cut where the data ends, like _seal_region
                    self._chunks.cache.put(chunk.chunk_id, piece)
                sealed[key] = ([Extent(region.start, len(piece), chunk.chunk_id, 0)], b"")

        async def gather(region: Region, pieces: list[bytes], at: int) -> None:
            async with reads:
                parts = [part async for part in self._region_bytes(region, job.data, extents)]
            pieces[at] = b"".join(parts)

        # Old pieces a batch takes in are read side by side: one after another, behind
        # 20 ms per get, 361 of them held a flush of 1,000 writes 7.4-7.8 s (5.1-5.8 now).
        reads = trio.CapacityLimiter(MAX_JOBS)  # bounds the old chunks held while read
        # Sized for the batches that run at once: a batch per store worker (eight) made
        # more than a flush runs (MAX_JOBS), and the last ones waited for whole batches.
        size = small_batch_size(len(regions), min(self._chunks.store_workers, MAX_JOBS))
        async with _typed_nursery() as nursery:
            for batch in _batches(regions, size):
                await slots.acquire()
                pieces = [b""] * len(batch)
                async with _typed_nursery() as gathering:
                    for at, (_, region) in enumerate(batch):
                        gathering.start_soon(gather, region, pieces, at)
                nursery.start_soon(store, batch, pieces)

    async def _seal_region(
        self,
        region: Region,
        data: SparseBuffer,
        extents: ExtentMap,
        fresh: dict[bytes, ChunkInfo],
        slots: trio.Semaphore,
        *,
        at_eof: bool,
        keep_tail: bool,
        on_unavailable: OnUnavailable,
    ) -> tuple[list[Extent], bytes]:
        """Stream a region through CDC, storing chunks concurrently (a slot of slots
        each). Returns extents and tail."""
        out: list[Extent] = []
        known = AnyOf(self._meta.chunks, fresh)  # committed or registered, or this flush's
        pos = region.start

        async def store(at: int, piece: memoryview) -> None:
            try:
                stored = await self._chunks.store(piece, known, on_unavailable)
            finally:
                slots.release()
            if stored.uploaded:
                fresh[stored.chunk_id] = stored.info()
            out.append(Extent(at, stored.plain_size, stored.chunk_id, 0))

        async def emit(view: memoryview, lengths: list[int]) -> memoryview:
            nonlocal pos
            for n in lengths:
                await slots.acquire()
                nursery.start_soon(store, pos, view[:n])
                view, pos = view[n:], pos + n
            return view

        async def cut_finished(buf: memoryview) -> memoryview:
            """Store the finished chunks of buf; return its unfinished last piece (a view)."""
            lengths = await trio.to_thread.run_sync(self._chunker.cut, buf)
            lengths.pop()
            return await emit(buf, lengths)

        async with _typed_nursery() as nursery:
            windows = _Windows(cut_finished)
            async for segment in self._region_bytes(region, data, extents):
                await windows.feed(memoryview(segment))
            window = windows.rest
            lengths = await trio.to_thread.run_sync(self._chunker.cut, window)
            kept = last = b""
            # The last piece is unfinished (the stream goes on): keep it back, unless it
            # is all this flush would seal. Pieces emitted from earlier windows count too.
            if keep_tail and at_eof and lengths and (len(lengths) > 1 or pos > region.start):
                kept = bytes(window[-lengths.pop() :])
            elif at_eof and lengths:
                last = bytes(window[-lengths[-1] :])  # cut where the data ends: a forced cut
            await emit(memoryview(window), lengths)
        out.sort(key=lambda e: e.start)
        if last:  # the flush that continues the file re-reads it: spare it a store round trip
            self._chunks.cache.put(out[-1].chunk, last)
        return out, kept

    async def _region_bytes(
        self, region: Region, data: SparseBuffer, extents: ExtentMap
    ) -> AsyncIterator[bytes | bytearray | memoryview]:
        """The region's bytes in order, new data and old between, in contiguous segments
        (a whole buffered range is one: it is cut in place, not copied)."""
        pos = region.start
        for start, buf in data.ranges_in(region.start, region.end):
            if start > pos:
                async for old in self._old_bytes(extents, pos, start):
                    yield old
            yield memoryview(buf)
            pos = start + len(buf)
        if pos < region.end:
            async for old in self._old_bytes(extents, pos, region.end):
                yield old

    async def _old_bytes(
        self, extents: ExtentMap, start: int, end: int
    ) -> AsyncIterator[bytes | memoryview]:
        pos = start
        for piece in extents.pieces(start, end):
            if piece.start > pos:
                yield bytes(piece.start - pos)
            yield _slice(await self._chunks.read(piece.chunk), piece)
            pos = piece.end
        if pos < end:
            yield bytes(end - pos)


@dataclass(frozen=True, eq=False)
class Detached:
    """One file's buffered bytes taken for a flush, with its size at that moment."""

    inode: Inode
    buffers: FileBuffers
    data: SparseBuffer
    size: int


class _Windows:
    """Feeds a stream of segments to CDC a window at a time, cutting in place.

    Cut points do not depend on where a window ends (but for its last piece,
    which is cut again with what follows), so a window is a view into its
    segment; only bytes carried from one segment into the next are copied.
    Copying each window of a streaming writer's buffer cost a copy (and a
    fault-in of fresh memory) of every byte written.
    """

    def __init__(self, cut: Callable[[memoryview], Awaitable[memoryview]]) -> None:
        self._cut = cut  # stores a window's finished chunks, returns its unfinished piece
        self.rest: bytearray | memoryview = memoryview(b"")  # bytes not cut yet

    async def feed(self, view: memoryview) -> None:
        at = 0
        while at < len(view):
            if self.rest:
                at = await self._join(view, at)
                continue
            window = view[at : at + WINDOW]
            if len(window) < WINDOW:
                self.rest = window  # the segment's end: carried into the next one
                return
            at += WINDOW - len(await self._cut(window))

    async def _join(self, view: memoryview, at: int) -> int:
        """Append the segment's next bytes to the carried ones (the only copy) and cut them;
        return where the segment's uncut bytes start.

        MAX_CHUNK bytes are enough: the unfinished piece of a cut is at most that
        long, so it then lies in the segment, and cutting goes on there in place.
        A segment that ends first is carried on whole, up to a window.
        """
        carried = self.rest if isinstance(self.rest, bytearray) else bytearray(self.rest)
        joined = min(len(view) - at, MAX_CHUNK)
        carried += view[at : at + joined]
        self.rest = carried
        if at + joined == len(view) and len(carried) < WINDOW:
            return at + joined
        unfinished = await self._cut(memoryview(carried))
        if len(unfinished) <= joined:
            self.rest = memoryview(b"")
            return at + joined - len(unfinished)
        self.rest = bytearray(unfinished)
        return at + joined


@asynccontextmanager
async def _typed_nursery() -> AsyncIterator[trio.Nursery]:
    """A nursery whose first error is raised as itself, not inside an ExceptionGroup,
    so that callers (the commit loop, fsync) see the StoreError they handle.

    Errors beside Cancelled count too: a commit stops its other flushes when one
    gives up on the store, and their uploads under way then give up as well.
    """
    try:
        async with trio.open_nursery() as nursery:
            yield nursery
    except BaseExceptionGroup as group:
        errors, others = group.split(Exception)
        if errors is None or (others is not None and others.split(trio.Cancelled)[1]):
            raise  # only Cancelled, or something graver (KeyboardInterrupt)
        raise first_leaf(errors) from None


def _slice(chunk: bytes, piece: Extent) -> memoryview:
    """The bytes of chunk that piece maps, without copying them.

    Raises FormatError if the chunk does not hold them (docs/format.md, extent rows):
    sliced as they came, such a read came back short and every byte after it landed
    early. Records are authenticated, so only a writer's bug could make one.
    """
    end = piece.chunk_offset + piece.length
    if end > len(chunk):
        raise FormatError(
            f"an extent names bytes {piece.chunk_offset}..{end} of chunk"
            f" {chunk_name(piece.chunk)}, which holds {len(chunk)}"
        )
    return memoryview(chunk)[piece.chunk_offset : end]


def _spans(
    pieces: list[Extent], datas: list[bytes], offset: int, end: int
) -> list[bytes | memoryview]:
    """The bytes of [offset, end) in order: slices of the chunks, zeros in holes (joined
    once, not copied into a zeroed buffer first)."""
    out: list[bytes | memoryview] = []
    pos = offset
    for piece, data in zip(pieces, datas, strict=True):
        if piece.start > pos:
            out.append(bytes(piece.start - pos))
        out.append(_slice(data, piece))
        pos = piece.end
    if pos < end:
        out.append(bytes(end - pos))
    return out


def _regions(
    data: SparseBuffer,
    extents: ExtentMap,
    forced: Extent | None,
    size: int,
    *,
    merge: bool = True,
) -> list[Region]:
    """Written ranges widened over a forced cut they continue and over small neighbouring
    pieces (unless merge is off), then merged where they touch.

    A small piece (below MIN_CHUNK) is taken in only if it is at most twice as long as the
    region so far or, for a range that ends before the end of the file, at most FRAGMENT.
    Taking in every small piece re-sealed up to 256 KiB on each side of a 4 KiB write (a
    SQLite database grew the store by 9x what it wrote), and made a log fsynced line by
    line re-seal its whole small tail at every commit (1.5 MB of lines, 124 MB of chunks).
    Now each small piece at the end of a file is more than twice as long as the next, so
    there are at most about log2(MIN_CHUNK / bytes per commit) of them whatever the commits,
    and a byte is re-sealed at most about that many times. Writes inside a file take in
    every neighbour of at most FRAGMENT, so such fragments do not pile up; the gap
    between two writes of one flush counts as the piece it would leave.
    """
    written = [(start, start + len(buf)) for start, buf in data.ranges()]
    spans: list[list[int]] = []
    for i, (start, end) in enumerate(written):
        lo, hi = start, end
        if merge:
            lo = _resume_point(lo, hi, extents, forced)
            floor = 0 if hi >= size else FRAGMENT
            # A neighbour ends where the previous or the next written range begins: what
            # would be left between two writes is measured, not the old extent it is cut from.
            before = spans[-1][1] if spans else 0
            after = written[i + 1][0] if i + 1 < len(written) else size
            # Absorb such pieces in a row, not just the nearest: else fragments pile up.
            while (
                lo > before
                and (left := extents.covering(lo - 1))
                and _absorbs(lo - max(left.start, before), hi - lo, floor)
            ):
                lo = max(left.start, before)
            while (
                hi < after
                and (right := extents.covering(hi))
                and _absorbs(min(right.end, after) - hi, hi - lo, floor)
            ):
                hi = min(right.end, after)
        if spans and (lo <= spans[-1][1] or (merge and _small_hole(extents, spans[-1][1], lo))):
            spans[-1][1] = max(spans[-1][1], hi)
        else:
            spans.append([lo, hi])
    return [Region(lo, hi) for lo, hi in spans]


def _batches(regions: list[tuple[int, Region]], size: int) -> list[list[tuple[int, Region]]]:
    """(key, region) pairs in order, split into batches of at most size regions and, but
    for a single region, at most MAX_CHUNK bytes (the most one chunk job holds)."""
    out: list[list[tuple[int, Region]]] = []
    held = 0
    for key, region in regions:
        length = region.end - region.start
        if not out or len(out[-1]) >= size or held + length > MAX_CHUNK:
            out.append([])
            held = 0
        out[-1].append((key, region))
        held += length
    return out


def _is_small(region: Region) -> bool:
    """Whether CDC would find no cut inside region (it is a single chunk)."""
    return region.end - region.start < MIN_CHUNK


def _small_hole(extents: ExtentMap, start: int, end: int) -> bool:
    """Whether [start, end), between two regions of one flush, is a hole of at most
    FRAGMENT that joins them (sealed as the zeros it reads as).

    glibc emulates posix_fallocate, which the mount refuses, with a zero byte at the
    end of each 4 KiB block: as regions of their own, the bytes of 256 MiB took 65,536
    pairs of worker-thread hops (26 s of fsync) and left as many 1-byte extents. Large
    holes stay holes (a sparse file's)."""
    return end - start <= FRAGMENT and not extents.pieces(start, end)


def _absorbs(piece: int, region: int, floor: int) -> bool:
    """_regions' merge rule, the same on both sides: whether a region of that length
    takes in a neighbouring piece of that length."""
    return piece < MIN_CHUNK and piece <= max(2 * region, floor)


def _resume_point(lo: int, hi: int, extents: ExtentMap, forced: Extent | None) -> int:
    """Where CDC should start for the written range [lo, hi): at the start of the forced
    cut it continues (cut points then come out as in one pass), else at lo.

    Only when the range brings at least as many new bytes as the forced chunk holds: a
    slow appender would otherwise re-seal up to MAX_CHUNK at every commit; this way
    resuming itself at most doubles what a flush seals (small pieces before the forced
    cut may then join too, under _regions' rule). The extent must still be in the map as
    it was sealed (a truncation or an overwrite since then changes it)."""
    if (
        forced is not None
        and forced.start < lo <= forced.end
        and hi - lo >= forced.length
        and extents.covering(forced.start) == forced
    ):
        return forced.start
    return lo
