"""Group commit: turning buffered writes and queued records into log segments.

Write ordering (the invariant every crash test checks): the chunks a segment
refers to are uploaded and synced before the segment is created; a commit is
reported only after the segment's create is acknowledged and synced. The
segment is created with put_if_absent, so of two writers exactly one gets
each generation; the loser is fenced and turns read-only. So does a writer
whose store failed to flush (SyncFailedError): no later commit can prove the
objects it wrote are on disk.

A commit takes every record queued so far and every file's dirty bytes at one
instant (no await in between), so each segment is a consistent cut and the
state after a crash is a prefix of the commits.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from dataclasses import dataclass

import trio

from sealfs.chunking.fastcdc import MIN_CHUNK
from sealfs.errors import (
    FencedError,
    FormatError,
    IntegrityError,
    MetadataTooLargeError,
    ObjectExistsError,
    ObjectNotFoundError,
    SealfsError,
    StoreError,
    StoreUnavailableError,
    SyncFailedError,
    VolumeGoneError,
    WriterStoppedError,
)
from sealfs.meta import ops
from sealfs.meta.codec import (
    MAX_SEALED_METADATA,
    SNAPSHOT_PREFIX,
    LoggedSegment,
    Segment,
    decode_segment,
    encode_segment,
    segment_name,
    snapshot_name,
)
from sealfs.meta.compact import compact
from sealfs.store.base import ObjectStore
from sealfs.volume.buffers import SparseBuffer
from sealfs.volume.chunks import RESERVED_WORKERS, small_batch_size
from sealfs.volume.filedata import Detached, FileData, record
from sealfs.volume.loader import Loaded, collector_paused
from sealfs.wording import counted

log = logging.getLogger("sealfs.volume")

SNAPSHOT_AT_CLOSE_OPS = 2_000  # a clean unmount leaves a snapshot when the log grew this much
SNAPSHOT_EVERY_OPS = 50_000
SNAPSHOT_EVERY_BYTES = 32 << 20
# ...and only once that log holds at least this share of the last snapshot's bytes, so
# that what compaction writes stays within a few times what the log holds.
SNAPSHOT_LOG_SHARE = 4
# After a failed snapshot, the loop tries again only this much later: compaction replays
# the whole log since the last snapshot, and a full disk failed it every second.
SNAPSHOT_RETRY_DELAY = 60.0
# Seconds between checks that the store still holds the segment committed last (and at
# the first commit after a failed one): a stat, a HEAD on S3.
VERIFY_INTERVAL = 1.0


@dataclass(frozen=True)
class Failing:
    """Attempts failing in a row (commits, a follower's looks): since when, the last
    one's error, how many; what status shows of an outage the loop rides out."""

    since_ns: int
    error: str
    attempts: int

    @staticmethod
    def after(last: Failing | None, exc: BaseException) -> Failing:
        """The run of failures once exc has joined last's (None: the first of a run)."""
        if last is None:
            return Failing(since_ns=time.time_ns(), error=str(exc), attempts=1)
        return Failing(since_ns=last.since_ns, error=str(exc), attempts=last.attempts + 1)


class RetryLog:
    """Logs the failures of an attempt that a loop retries, without a line per attempt.

    A full store disk fails the commit loop and the early flushes every second for
    as long as it stays full: one line each time buried the first one (3,600 an
    hour). The first failure is logged, then only a failure of another kind or one
    that has lasted another ten minutes, and one line when an attempt succeeds again.
    """

    REPEAT_AFTER = 600.0

    def __init__(self, what: str, level: int) -> None:
        self.what = what
        self._level = level
        self._kind: type[BaseException] | None = None
        self._logged_at = 0.0
        self.failing: Failing | None = None

    def failed(self, exc: BaseException) -> None:
        now = time.monotonic()
        if type(exc) is not self._kind or now - self._logged_at >= self.REPEAT_AFTER:
            more = (
                f" ({counted(self.failing.attempts, 'failed attempt')} so far)"
                if self.failing
                else ""
            )
            log.log(self._level, "%s failed, will retry%s: %s", self.what, more, exc)
            self._kind, self._logged_at = type(exc), now
        self.failing = Failing.after(self.failing, exc)

    def succeeded(self) -> None:
        if self.failing:
            log.info(
                "%s succeeded after %s", self.what, counted(self.failing.attempts, "failed attempt")
            )
        self._kind, self.failing = None, None


async def pause_after_failure(seconds: float) -> None:
    """Wait before retrying a failed commit or early flush, then free what the failure left.

    A failed flush leaves reference cycles (trio's nurseries and the tracebacks of
    the chunk uploads it cancelled refer to one another) whose frames hold views of
    the write buffers being sealed. Only a full collection frees them, and the
    collector seldom runs one: retried every second against a full store disk, a
    daemon with 64 MiB buffered grew to 1.8 GiB within minutes.
    """
    await trio.sleep(seconds)
    gc.collect()


class Committer:
    """Owns the queue of records and the commit sequence of one writable volume."""

    def __init__(
        self, loaded: Loaded, files: FileData, limiter: trio.CapacityLimiter, interval: float
    ) -> None:
        self._store = loaded.store
        self._volume_id = loaded.volume_id
        self._keys = loaded.keys
        self._loaded = loaded
        self._live = loaded.live
        # The generation committed last and its payload's SHA-256, set as one: a thread
        # records the pair for the host (sealfs.cli.seen) while commits go on.
        self.head: tuple[int, bytes] = (0, b"")
        self._base = loaded.base
        self._tail = loaded.tail
        self.start()
        # One snapshot at a time. A second waits for the first, then writes what it left:
        # an unmount that found the loop's snapshot under way wrote none, and the loop's,
        # cancelled with the mount, never landed either.
        self._snapshot_lock = trio.Lock()
        self._files = files
        self._limiter = limiter
        self.interval = interval
        self.pending: list[ops.Op] = []
        # About what the records in pending take encoded (ops.wire_size), which changes wait
        # on past a bound (Volume._may_change). Early flushes' records count too.
        self.pending_record_bytes = 0
        # The batch of the commit in flight: taken from pending at the cut, not durable
        # until its segment is published (status counts it as pending).
        self.committing: list[ops.Op] = []
        self._lock = trio.Lock()  # one commit at a time
        self.gate = trio.Lock()  # held by partial flushes; a commit's cut waits for them
        # The last early flush that gave up on the store: a commit that waited for it fails
        # with it.
        self._early_gave_up: StoreUnavailableError | None = None
        # The last commit flush that gave up on the store: an early flush that waited for
        # it (writers blocked at the buffer limit wait for that) fails with it.
        self._commit_gave_up: StoreUnavailableError | None = None
        self._wake = trio.Event()
        self._started = 0
        self._cut = 0  # commits that have taken their cut or ended (_started, or one less)
        self._finished = 0
        self._wanted = 0  # sync() callers wait for the commit with this number
        self._done = trio.Event()
        self._failure: BaseException | None = None
        # Since when commits fail, why the last one did, how many did: for status, which
        # otherwise showed a store outage as an idle mount (the log alone said why).
        self.failing: Failing | None = None
        # When the commit in flight began (wall clock), None between commits: an outage
        # showed nothing in status until the first commit gave up, a store timeout later.
        self.running_since_ns: int | None = None
        self.stopped: WriterStoppedError | None = None  # fenced, or its store lost writes
        # When the store was last seen to hold the segment committed last (monotonic; the
        # load just read the log), and whether a failed commit makes the next check due.
        self._verified_at = time.monotonic()
        self._verify_due = False
        # A segment create that may have landed: (segment, sealed, digest).
        self._unsure: tuple[Segment, bytes, bytes] | None = None
        self.last_commit_ns = loaded.live.committed_ns
        self.segments_written = 0
        self._too_large = False  # the state outgrew a snapshot: mounts replay the log
        self._retry_log = RetryLog("commit", logging.ERROR)
        self._snapshot_log = RetryLog("snapshot", logging.WARNING)
        self._snapshot_not_before = 0.0  # monotonic time; set by a failed snapshot

    @property
    def generation(self) -> int:
        """The generation committed last."""
        return self.head[0]

    def start(self) -> None:
        """Take the head of the log as loaded (and claimed) now: the next commit follows it."""
        self.head = (self._live.generation, self._live.head_hash)
        # The writer's claim (made after this was built, by the process that writes) is
        # a commit too: status showed the one before it as the last.
        self.last_commit_ns = self._live.committed_ns
        # The newest snapshot and the segments after it: what compaction starts from.
        self._base = self._loaded.base
        self._tail = self._loaded.tail
        # Kept as running sums: summing the tail at every commit grew with the log.
        self._tail_ops = sum(len(logged.segment.ops) for logged in self._tail)
        self._tail_bytes = sum(logged.size for logged in self._tail)

    def followed(self) -> None:
        """A read-only mount replayed the writer's next commit: status shows where it is.

        Not start(), which sums the whole tail loaded at mount: once per replayed
        segment, that grew with the log a follower never compacts.
        """
        self.head = (self._live.generation, self._live.head_hash)
        self.last_commit_ns = self._live.committed_ns

    def record(self, op: ops.Op) -> None:
        """Apply a record to the live state and queue it for the next commit."""
        record(self._live, self.pending, op)
        self.pending_record_bytes += ops.wire_size(op)

    def has_work(self, besides: ops.Op | None = None) -> bool:
        """Whether records or dirty bytes wait for a commit (besides that one record)."""
        return self._files.has_dirty() or any(op is not besides for op in self.pending)

    def kick(self) -> None:
        self._wake.set()

    async def sync(self) -> None:
        """Return once everything recorded or written before the call is committed.

        Concurrent callers share commits (group commit). Raises the commit's
        error (StoreError, WriterStoppedError) if the commit that would cover them fails.
        """
        if self.stopped is not None:
            raise self.stopped
        if not self.has_work() and not self._lock.locked():
            return  # everything recorded so far is committed
        # A commit that has not taken its cut yet (it waits for an early flush to let go
        # of the gate) will carry everything recorded so far: wait for that one alone.
        # Waiting for the one after it too made a checkpoint's fsync carry whatever a
        # streaming writer wrote meanwhile, a second commit's worth.
        taking = self._lock.locked() and self._cut < self._started
        target = self._started if taking else self._started + 1
        self._wanted = max(self._wanted, target)
        while self._finished < target:
            if self.stopped is not None:
                # The commit in flight when this caller came was fenced (or its store
                # failed to flush): the loop has stopped, so no later commit will come.
                raise self.stopped
            self.kick()
            done = self._done
            await done.wait()
            failure = self._failure
            if failure is not None and (
                self._finished >= target or isinstance(failure, StoreUnavailableError)
            ):
                # A commit already running when this caller came failed because the
                # store stayed unreachable for the whole store timeout: waiting for one
                # more commit would make the caller wait that timeout again (twice the
                # documented bound). The data stays queued; a later commit carries it.
                raise failure

    async def loop(self) -> None:
        """Commit every interval while there is work, and at once when asked."""
        while self.stopped is None:
            with trio.move_on_after(self.interval):
                await self._wake.wait()
            self._wake = trio.Event()
            if self.has_work() or self._finished < self._wanted:
                try:
                    await self.commit()
                    self._retry_log.succeeded()
                except WriterStoppedError:
                    return
                except SealfsError as exc:
                    self._retry_log.failed(exc)
                    await pause_after_failure(min(self.interval, 1.0))
            if self.snapshot_due() and time.monotonic() >= self._snapshot_not_before:
                try:
                    await self.snapshot()
                    self._snapshot_log.succeeded()
                except SealfsError as exc:
                    self._snapshot_log.failed(exc)
                    self._snapshot_not_before = time.monotonic() + SNAPSHOT_RETRY_DELAY

    async def commit(self, extra: list[ops.Op] | None = None) -> None:
        """Run one commit now (waiting for one in progress).

        Raises StoreError, WriterStoppedError."""
        async with self._lock:
            if self.stopped is not None:
                raise self.stopped
            self._started += 1
            self.running_since_ns = time.time_ns()
            try:
                await self._commit(extra or [])
                self._failure = None
                self.failing = None
            except BaseException as exc:
                self._failure = exc
                self._verify_due = True  # the store may have been emptied meanwhile
                if isinstance(exc, SealfsError) and not isinstance(exc, WriterStoppedError):
                    self.failing = Failing.after(self.failing, exc)
                raise
            finally:
                self.running_since_ns = None
                # One that failed before its cut has none left to take: counted as taken,
                # else the next commit, between taking the lock and counting itself, looked
                # like one yet to take its cut, this one (see sync).
                self._cut = self._started
                self._finished = self._started
                self._done.set()
                self._done = trio.Event()

    async def _commit(self, extra: list[ops.Op]) -> None:
        gave_up = self._early_gave_up
        async with self.gate:
            if self._early_gave_up is not gave_up and self._early_gave_up is not None:
                # An early flush that this commit waited for gave up on the store: the
                # commit's uploads would each wait the whole store timeout again (as
                # those of its other files would, see _flush_all). Nothing is taken yet.
                raise StoreUnavailableError(str(self._early_gave_up))
            batch, self.pending, self.pending_record_bytes = self.pending, [], 0
            self._cut = self._started
            self.committing = batch
            jobs = [job for ino in self._files.dirty_inodes() if (job := self._detach(ino, batch))]
            if jobs:
                self._files.wake_space_waiters()  # writers waiting for dirty files to be taken
        for op in extra:
            record(self._live, batch, op)
        try:
            await self._flush_all(jobs, batch)
            if batch:
                await self._write_segment(batch)
        except BaseException:
            self.pending[:0] = batch  # nothing recorded is ever dropped; retried next time
            self.pending_record_bytes += sum(map(ops.wire_size, batch))
            raise
        finally:
            self.committing = []

    def _detach(self, ino: int, batch: list[ops.Op]) -> Detached | None:
        """Take a file's dirty bytes for this commit, recording its attributes as of now.

        Writes change size and times only in memory; the record made here, at
        the commit's cut, is what makes them durable together with the data.
        """
        inode = self._live.inodes.get(ino)
        if inode is None:
            return None
        job = self._files.detach(inode)
        if job is not None:
            record(self._live, batch, ops.put_inode(inode))
        return job

    async def relieve_pressure(self) -> bool:
        """Free buffered memory early: seal the largest dirty file alone, or commit, or wait.

        Returns whether it sealed or committed something; False when it only waited
        for a flush already running (a commit retrying against a full disk fails
        that flush, so the wait proves nothing about the store).

        A file holding a chunk's worth or more is sealed alone (see _flush_early).
        Dirty bytes spread over many small files are committed instead: sealing
        them one per call cost a worker-thread call and a scan of every dirty
        file each, quadratic in their number (a tree copy with a long commit
        interval ran twice as slow); a commit seals them in batches. When what
        is buffered is mostly being flushed already, there is nothing to seal:
        wait for that flush to free it (a commit would only cut a streaming
        writer's data short).
        """
        async with self.gate:
            files = self._files
            sizes = {ino: files.files[ino].dirty.nbytes for ino in files.dirty_inodes()}
            largest = max(sizes, key=sizes.__getitem__, default=None)
            if largest is not None and sizes[largest] >= MIN_CHUNK:
                return await self._flush_early(largest)
            dirty = sum(sizes.values())
            space = files.space
        if dirty < MIN_CHUNK and files.buffered_bytes > dirty:
            gave_up = self._commit_gave_up
            await space.wait()
            self._raise_if_gave_up_since(gave_up)
            return False
        await self.commit()
        return True

    async def _flush_early(self, ino: int) -> bool:
        """Seal one file's dirty bytes now, the gate held, keeping back its unfinished
        last chunk so that a streaming writer is cut as in one pass.

        Its records join the queue for the next commit; the chunks go to the
        store now (unreferenced until that commit, like any upload in flight).
        Returns False if a commit was flushing the file, and this only waited for it.
        """
        job = self._detach(ino, self.pending)
        if job is None:
            gave_up = self._commit_gave_up
            await self._files.wait_idle(ino)  # a commit is flushing it: wait, don't spin
            self._raise_if_gave_up_since(gave_up)
            return False
        produced: list[ops.Op] = []
        try:
            tail = await self._flush_until_given_up(job, produced)
        except BaseException as exc:
            self._files.finish(job, None, failed=True)
            if isinstance(exc, StoreUnavailableError):
                self._early_gave_up = exc
            raise
        self._files.finish(job, tail, failed=False)
        if ino not in self._live.inodes:
            # Deleted meanwhile, and its deletion is queued already (no cut can pass the
            # gate): a data record after it would name a missing inode at replay.
            produced = [op for op in produced if op[0] != ops.DATA]
        self.pending.extend(produced)
        self.pending_record_bytes += sum(map(ops.wire_size, produced))
        return True

    def _raise_if_gave_up_since(self, before: StoreUnavailableError | None) -> None:
        """After waiting for a commit's flush: raise its give-up on the store, if it gave up.

        An early flush that only waited would try again with uploads of its own, each
        waiting the whole store timeout once more: a writer blocked at the buffer limit
        while a commit stored its file's earlier bytes got its EIO after twice
        --store-timeout (ten minutes by default), in a write that SIGKILL cannot end.
        """
        if self._commit_gave_up is not before and self._commit_gave_up is not None:
            raise StoreUnavailableError(str(self._commit_gave_up))

    async def _flush_until_given_up(self, job: Detached, sink: list[ops.Op]) -> SparseBuffer:
        """An early flush that stops at the first upload giving up on the store, as a
        commit's flushes do: one whose merge read met a damaged old chunk meanwhile
        retried unmerged and sent every upload again, each waiting the whole store
        timeout a second time before the writers blocked on it got their error.

        The give-up is what it raises, whatever the flush ended with (as _flush_all
        does): a merge read's StoreError came first, raised alone, and the commit
        waiting at the gate was not told (_early_gave_up) and uploaded everything again.
        """
        gave_up: list[StoreUnavailableError] = []

        def stop(exc: StoreUnavailableError) -> None:
            gave_up.append(exc)
            scope.cancel()

        with trio.CancelScope() as scope:
            try:
                tail = await self._files.flush(job, sink, keep_tail=True, on_unavailable=stop)
            except Exception:
                if not gave_up:
                    raise
        if gave_up:
            raise gave_up[0]
        return tail

    async def _flush_all(self, jobs: list[Detached], batch: list[ops.Op]) -> None:
        """Flush every detached file; raise the first failure once all have ended.

        After one failure the other files go on (what they store is stored for the
        next commit), except when the store was given up on: then each of their
        uploads would wait the whole store timeout again before the fsync fails.
        """
        failure: list[BaseException] = []

        def gave_up(exc: StoreUnavailableError) -> None:
            # Kept here, not only where its flush ends: that flush may end with another
            # error that came first (a damaged neighbour read for merging), retry, and
            # be cancelled; the commit would then publish without the flushes it stopped.
            failure.append(exc)
            self._commit_gave_up = exc  # before the flush ends and wakes who waits for it
            nursery.cancel_scope.cancel()

        def failed(exc: BaseException) -> None:
            if not isinstance(exc, Exception):
                raise exc
            failure.append(exc)
            if isinstance(exc, StoreUnavailableError):
                self._commit_gave_up = exc
                nursery.cancel_scope.cancel()

        async def one(job: Detached) -> None:
            try:
                tail = await self._files.flush(job, batch, keep_tail=False, on_unavailable=gave_up)
            except BaseException as exc:
                self._files.finish(job, None, failed=True)
                failed(exc)
                return
            self._files.finish(job, tail, failed=False)

        async def small(group: list[tuple[Detached, int, bytes]]) -> None:
            try:
                await self._files.flush_small(group, batch, gave_up)
            except BaseException as exc:
                for job, _, _ in group:
                    self._files.finish(job, None, failed=True)
                failed(exc)
                return
            for job, _, _ in group:
                self._files.finish(job, None, failed=False)

        smalls: list[tuple[Detached, int, bytes]] = []
        async with trio.open_nursery() as nursery:
            for job in jobs:
                piece = self._files.small_piece(job)
                if piece is None:
                    nursery.start_soon(one, job)
                else:
                    smalls.append((job, *piece))
            # Not over the workers kept for demand reads: each batch holds its worker for
            # a store round trip per file, and a read of another file waited for a batch.
            workers = int(self._limiter.total_tokens) - RESERVED_WORKERS
            size = small_batch_size(len(smalls), workers)
            for k in range(0, len(smalls), size):
                nursery.start_soon(small, smalls[k : k + size])
        if failure:
            raise failure[0]

    async def _write_segment(self, batch: list[ops.Op]) -> None:
        if self._unsure is not None:
            # The last segment create failed, but it may have taken effect (a lost reply):
            # publish those very bytes again first, so that finding them is not a fence.
            segment, sealed, digest = self._unsure
            assert batch[: len(segment.ops)] == segment.ops  # its records were requeued first
            await self._publish(segment, (sealed, digest))
            del batch[: len(segment.ops)]  # committed now: never requeued
            if not batch:
                return
        generation, head_hash = self.head
        await self._publish(Segment(generation + 1, head_hash, time.time_ns(), batch))

    async def _publish(self, segment: Segment, sealed: tuple[bytes, bytes] | None = None) -> None:
        """Seal the segment (unless given its sealed bytes and digest) and publish it.

        Both in one worker call: each hand-off to a thread and back cost about 0.5 ms
        here, a tenth of a small fsync's commit (docs/design.md, "Performance").
        """
        made = [] if sealed is None else [sealed]

        def seal_and_publish() -> None:
            if made:
                self._publish_sync(segment.generation, *made[0])
                return
            with self._keys.sealing() as keys:  # in use until published: see KeyRing
                made.append(encode_segment(keys, self._volume_id, segment))
                self._publish_sync(segment.generation, *made[0])

        try:
            await trio.to_thread.run_sync(seal_and_publish, limiter=self._limiter)
        except WriterStoppedError as exc:  # taken over, or the store lost writes: stop
            self.stopped = exc
            log.error("%s", exc)
            self._files.wake_space_waiters()  # writers waiting for buffer space: EROFS now
            raise
        except BaseException:
            if made:  # sealed, so its create may have landed
                self._unsure = (segment, *made[0])
            raise
        data, digest = made[0]
        self._unsure = None
        self.head = (segment.generation, digest)
        self.last_commit_ns = segment.time_ns
        self.segments_written += 1
        self._tail.append(LoggedSegment(segment, digest, len(data)))
        self._tail_ops += len(segment.ops)
        self._tail_bytes += len(data)

    def _publish_sync(self, generation: int, sealed: bytes, digest: bytes) -> None:
        """Worker thread: chunks durable, then the segment created, then it durable."""
        name = segment_name(generation)
        self._check_log_still_there(generation - 1)
        try:
            self._store.sync()
        except SyncFailedError:
            # A writer that took the volume over deletes old snapshots, this writer's
            # newest among them: its takeover, not the disk, is why they are gone.
            if self._taken_over(generation, name, sealed, digest):
                raise _fenced(generation) from None
            raise
        try:
            self._store.put_if_absent(name, sealed)
        except ObjectExistsError:
            if not self._is_ours(generation, name, sealed, digest):
                raise _fenced(generation) from None
        self._store.sync()

    def _check_log_still_there(self, generation: int) -> None:
        """Worker thread: VolumeGoneError unless l/<generation>, committed last (by this
        writer, or its claim at mount), is in the store. Checked at the first commit
        after a failed one and at most every VERIFY_INTERVAL otherwise.

        A store emptied under the mount (an S3 service back without its objects, a
        bucket made again after "does not exist", a local store's files removed) took
        the next segment as any new object: fsync, sync and umount succeeded into a
        store that held no header, and the volume never mounted again.
        """
        now = time.monotonic()
        if not self._verify_due and now - self._verified_at < VERIFY_INTERVAL:
            return
        try:
            self._store.stat(segment_name(generation))
        except ObjectNotFoundError:
            raise VolumeGoneError(
                f"the store no longer holds this volume's log: {segment_name(generation)},"
                " committed last, is gone (the store was emptied or replaced under the mount);"
                " nothing more is committed: copy out what must be kept, then unmount, and"
                " restore the store from a backup"
            ) from None
        self._verified_at = now
        self._verify_due = False

    def _taken_over(self, generation: int, name: str, sealed: bytes, digest: bytes) -> bool:
        """Whether another writer has committed generation (False when unsure)."""
        try:
            return not self._is_ours(generation, name, sealed, digest)
        except StoreError:  # not found, or the store cannot say: the flush's error stands
            return False

    def _is_ours(self, generation: int, name: str, sealed: bytes, digest: bytes) -> bool:
        """Whether l/<generation> as found is the segment this writer sealed: the very
        bytes, or its records sealed again. A rekey re-seals every segment it lists, and
        one whose create landed with its reply lost (published again here) is among them:
        comparing the sealed bytes alone took that for a takeover and fenced the mount.

        Bytes that do not open are read once more before they count as another
        writer's: one damaged read (a flipped bit in transit) fenced the mount for good,
        losing everything since its last commit."""
        for _ in range(2):
            found = self._store.get(name, MAX_SEALED_METADATA)
            if found == sealed:
                return True
            try:
                logged = decode_segment(self._keys, self._volume_id, generation, found)
            except (IntegrityError, FormatError):
                continue
            return logged.digest == digest
        return False

    def snapshot_due(self, *, closing: bool = False) -> bool:
        """Whether the log since the last snapshot is long enough to compact.

        At a clean unmount the bar is lower: the next mount should not replay.
        Either way the log must hold a share of the last snapshot's size: a volume
        whose metadata (xattrs, the chunk table) ran to 570 MB was compacted whole
        after every 32 MiB of log, writing 18 times what its agent changed.
        """
        if self._too_large:
            return False  # compacting again would only fail again, at great cost
        if self._base is not None and self._tail_bytes * SNAPSHOT_LOG_SHARE < len(self._base[1]):
            return False
        if closing:
            return self._tail_ops >= SNAPSHOT_AT_CLOSE_OPS
        return self._tail_ops >= SNAPSHOT_EVERY_OPS or self._tail_bytes >= SNAPSHOT_EVERY_BYTES

    async def snapshot(self) -> None:
        """Write s/<gen> for the newest committed generation, in a worker thread.

        Built from the previous snapshot and the sealed segments since, never
        from the live state (which runs ahead of what is committed).
        """
        async with self._snapshot_lock:
            if not self._tail:
                return
            tail = list(self._tail)
            with self._keys.sealing() as keys:
                try:
                    gen, sealed = await trio.to_thread.run_sync(
                        _compact_unscanned, self._keys, keys, self._volume_id, self._base, tail,
                        limiter=self._limiter,
                    )  # fmt: skip
                except MetadataTooLargeError as exc:
                    self._too_large = True
                    log.error("%s; the log since the last snapshot is kept and replayed", exc)
                    return
                name = snapshot_name(gen)
                with contextlib.suppress(ObjectExistsError):  # a remount already wrote it
                    await trio.to_thread.run_sync(
                        self._store.put_if_absent, name, sealed, limiter=self._limiter
                    )
            self._base = (gen, sealed)
            del self._tail[: len(tail)]
            self._tail_ops -= sum(len(logged.segment.ops) for logged in tail)
            self._tail_bytes -= sum(logged.size for logged in tail)
            log.info("wrote snapshot %s (%d bytes)", name, len(sealed))
            try:
                await trio.to_thread.run_sync(
                    _drop_old_snapshots, self._store, limiter=self._limiter
                )
            except SealfsError as exc:  # tried again after the next snapshot
                log.warning("could not remove old snapshots: %s", exc)

    def resealed(self, generation: int, sealed: bytes) -> None:
        """A rekey re-sealed s/<generation>: compaction must start from the new bytes."""
        if self._base is not None and self._base[0] == generation:
            self._base = (generation, sealed)


def _fenced(generation: int) -> FencedError:
    return FencedError(
        f"another writer committed generation {generation} first: this mount"
        " was taken over (fenced) and is now read-only; unmount it"
    )


def _drop_old_snapshots(store: ObjectStore) -> None:
    """Worker thread: delete every snapshot but the newest two, once the newest is durable.

    Each snapshot is a whole copy of the metadata, and a mount reads only the
    newest: kept at a fixed cadence, the copies grew with the square of a
    volume's age (a 40-minute agent soak left 16 of them, 24.5 MB, more than the
    whole log). Nothing is lost with them: segments are never deleted, so any
    generation can still be rebuilt from l/. The one before the newest stays
    for a reader that listed s/ just before the newest landed.
    """
    store.sync()  # a power cut must not leave the old snapshots gone and the new one not
    names = store.list(SNAPSHOT_PREFIX)
    for name in names[:-2]:
        store.delete(name)


# compact() with the cyclic collector paused, as a mount pauses it to load. Decoding a
# snapshot makes a few long-lived objects per inode, and every collection that their
# allocation triggered also scanned the live state: with 100,000 files a compaction
# took 4.4 s in the daemon, 1.5 s paused.
_compact_unscanned = collector_paused()(compact)
