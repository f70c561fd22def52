"""Group commit, commit failures, fencing, snapshots and orphan purge."""

from __future__ import annotations

import contextlib
import errno
import gc
import logging
import math
import os
import threading
import time
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing

from sealfs.chunking.fastcdc import MAX_CHUNK
from sealfs.errors import (
    FencedError,
    FsError,
    StoreError,
    StoreUnavailableError,
    SyncFailedError,
    VolumeGoneError,
)
from sealfs.keys.kdf import Argon2Params
from sealfs.keys.slots import Passphrase
from sealfs.meta import codec
from sealfs.meta import compact as compaction
from sealfs.meta.codec import SEGMENT_PREFIX, SNAPSHOT_PREFIX, parse_generation, segment_name
from sealfs.meta.extents import Extent
from sealfs.meta.model import ROOT_INO
from sealfs.store.base import ObjectStore
from sealfs.store.faults import FaultyStore
from sealfs.store.memory import MemoryStore
from sealfs.volume import chunks as chunking
from sealfs.volume import committer, filedata
from sealfs.volume.chunks import chunk_name
from sealfs.volume.loader import check_writer, claim_writer, create_volume, open_volume
from sealfs.volume.options import VolumeOptions
from tests.conftest import PASSPHRASE, RECOVERY_KEY, PowerCutStore, WrappedStore, mounted
from tests.volume.test_engine import (
    GID,
    RW,
    UID,
    assert_replay_equals_live,
    expect,
    ino_of,
    install_cached_unlock,
    load,
    meta_signature,
    mkdir,
    mkfile,
    read_all,
    session,
    write_at,
)
from tests.volume.test_filedata import GatedStore, wait_until
from tests.volume.test_rekey import start_rekey

QUIET = {"commit_interval": 3600.0}  # no background commits unless a test wants them


@pytest.fixture(autouse=True)
def _cached_unlock(monkeypatch: pytest.MonkeyPatch) -> None:
    install_cached_unlock(monkeypatch)


@pytest.fixture
def faulty(memory_store: MemoryStore, kdf_params: Argon2Params) -> FaultyStore:
    create_volume(memory_store, PASSPHRASE, kdf_params, RECOVERY_KEY)
    return FaultyStore(memory_store)


def segments(store: Any) -> list[str]:
    return list(store.list(SEGMENT_PREFIX))


# -- group commit ----------------------------------------------------------------------------


async def test_concurrent_fsyncs_share_commits(volume_store: MemoryStore) -> None:
    async with session(volume_store, **QUIET) as v:
        before = v.commits.segments_written

        async def one(k: int) -> None:
            await mkfile(v, ROOT_INO, b"f%d" % k, os.urandom(50_000))
            await v.fsync()

        async with trio.open_nursery() as nursery:
            for k in range(10):
                nursery.start_soon(one, k)
        assert 1 <= v.commits.segments_written - before <= 3
        state = load(volume_store)
        for k in range(10):
            assert b"f%d" % k in state.inodes[ROOT_INO].entries  # type: ignore[operator]


async def test_fsync_on_a_clean_volume_writes_nothing(volume_store: MemoryStore) -> None:
    async with session(volume_store, **QUIET) as v:
        await mkfile(v, ROOT_INO, b"f", b"x")
        await v.fsync()
        written = v.commits.segments_written
        counts = dict(volume_store.counts)
        for _ in range(5):
            await v.fsync()
        assert v.commits.segments_written == written
        assert volume_store.counts["put_if_absent"] == counts["put_if_absent"]
        assert volume_store.counts["put"] == counts["put"]
        fh = await v.open(await ino_of(v, "f"), os.O_RDONLY)
        await v.read(fh, 0, 10)
        await v.release(fh)
        await v.fsync()  # reads record nothing
        assert v.commits.segments_written == written


async def fsync_in_background(volume: Any, nursery: trio.Nursery) -> trio.Event:
    """Start an fsync; the event is set when it returns. Returns once every task is
    blocked, so an event not set yet means the fsync is waiting."""
    done = trio.Event()

    async def fsync() -> None:
        await volume.fsync()
        done.set()

    nursery.start_soon(fsync)
    await trio.testing.wait_all_tasks_blocked()
    return done


async def test_fsync_waits_for_a_commit_that_covers_later_writes(
    memory_store: MemoryStore, kdf_params: Argon2Params
) -> None:
    """A commit already running when fsync is called may have cut before the caller's
    writes: fsync must wait for the next one."""
    create_volume(memory_store, PASSPHRASE, kdf_params, RECOVERY_KEY)
    store = GatedStore(memory_store)
    async with session(store, **QUIET) as v:  # type: ignore[arg-type]
        await mkfile(v, ROOT_INO, b"first", os.urandom(2 << 20))
        store.close_gate()
        async with trio.open_nursery() as nursery:
            try:  # the gate opens inside: a failure must not leave the commit stuck at it
                nursery.start_soon(v.fsync)
                await wait_until(lambda: store.waiting > 0)
                second = await mkfile(v, ROOT_INO, b"second", b"late bytes")
                done = await fsync_in_background(v, nursery)
                assert not done.is_set()
            finally:
                store.open_gate()
            await done.wait()
            state = load(memory_store)
            assert state.inodes[second].size == len(b"late bytes")


async def test_fsync_during_a_commit_that_took_its_data_waits_for_that_commit(
    memory_store: MemoryStore, kdf_params: Argon2Params
) -> None:
    """The commit in flight has taken the caller's bytes, so nothing is left queued, but
    they are not in the store yet: fsync must wait for that commit, not return at once."""
    create_volume(memory_store, PASSPHRASE, kdf_params, RECOVERY_KEY)
    store = GatedStore(memory_store)
    async with session(store, **QUIET) as v:
        await mkfile(v, ROOT_INO, b"f", b"bytes")
        store.close_gate()
        async with trio.open_nursery() as nursery:
            try:  # the gate opens inside: a failure must not leave the commit stuck at it
                nursery.start_soon(v.commits.commit)
                await wait_until(lambda: store.waiting > 0)
                assert not v.commits.has_work()
                done = await fsync_in_background(v, nursery)
                assert not done.is_set()
            finally:
                store.open_gate()
            await done.wait()
            assert b"f" in load(memory_store).inodes[ROOT_INO].entries  # type: ignore[operator]


class ValvedStore(WrappedStore):
    """Wraps a store: chunk puts wait while `chunks` is shut; once `segments_shut()` is
    called, each segment create waits for one `let_segment()`."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.chunks = threading.Event()
        self.chunks.set()
        self._segments: threading.Semaphore | None = None
        self.chunks_waiting = 0
        self.segments_waiting = 0

    def segments_shut(self) -> None:
        self._segments = threading.Semaphore(0)

    def let_segment(self, count: int = 1) -> None:
        assert self._segments is not None
        self._segments.release(count)

    def put(self, name: str, data: bytes, *, replace: bool = True) -> None:
        if name.startswith("c/") and not self.chunks.is_set():
            self.chunks_waiting += 1
            assert self.chunks.wait(30), "chunk puts never let through"
        self.inner.put(name, data, replace=replace)

    def put_if_absent(self, name: str, data: bytes) -> None:
        gate = self._segments
        if name.startswith(SEGMENT_PREFIX) and gate is not None:
            self.segments_waiting += 1
            assert gate.acquire(timeout=30), "segment create never let through"
        self.inner.put_if_absent(name, data)


async def test_an_fsync_while_a_commit_waits_for_an_early_flush_joins_that_commit(
    memory_store: MemoryStore, kdf_params: Argon2Params
) -> None:
    """Regression: a commit waiting for an early flush (a streaming writer's) has not
    taken its cut yet, so it will carry what a caller wrote before an fsync made then.
    That fsync waited for the commit after it too, which carried whatever the streaming
    writer had written meanwhile: a checkpoint's fsync paid for two commits."""
    create_volume(memory_store, PASSPHRASE, kdf_params, RECOVERY_KEY)
    store = ValvedStore(memory_store)
    async with session(store, **QUIET) as v:  # type: ignore[arg-type]
        big = await mkfile(v, ROOT_INO, b"big", os.urandom(2 << 20))
        store.chunks.clear()
        async with trio.open_nursery() as nursery:
            try:  # the valves open inside: a failure must not leave a commit stuck
                nursery.start_soon(v.commits.relieve_pressure)  # holds the gate, stalled
                await wait_until(lambda: store.chunks_waiting > 0)
                first = await fsync_in_background(v, nursery)  # its commit waits at the gate
                await mkfile(v, ROOT_INO, b"checkpoint", b"state")
                done = await fsync_in_background(v, nursery)
                store.segments_shut()
                store.chunks.set()
                await wait_until(lambda: store.segments_waiting > 0)  # that commit has cut
                await write_at(v, big, 2 << 20, os.urandom(1 << 20))  # for the next commit
                store.let_segment()
                await first.wait()
                await trio.testing.wait_all_tasks_blocked()
                assert done.is_set()  # not waiting for the next commit, stalled now
            finally:
                store.chunks.set()
                store.let_segment(100)
    assert b"checkpoint" in load(memory_store).inodes[ROOT_INO].entries  # type: ignore[operator]


async def test_a_commit_syncs_chunks_before_its_segment_and_the_segment_before_fsync_returns(
    kdf_params: Argon2Params,
) -> None:
    store = PowerCutStore()
    create_volume(store, PASSPHRASE, kdf_params, RECOVERY_KEY)
    async with session(store, **QUIET) as v:
        big = await mkfile(v, ROOT_INO, b"big", os.urandom(300_000))
        await v.fsync()
        assert store.unsynced == set()  # a power cut now keeps all that fsync acknowledged
        await write_at(v, big, 1000, os.urandom(5000))
        await mkfile(v, ROOT_INO, b"small", b"tiny")  # sealed in a batch (flush_small)
        await v.fsync()
        assert store.unsynced == set()
    assert store.unsynced == set()  # the unmount's commit too
    assert store.early_segments == []  # no segment may outlive a chunk it refers to


class OverlapStore(WrappedStore):
    """Wraps a store; the first chunk put waits (up to 5 s) for a second one to start,
    and records whether one did: whether a commit sends its chunks side by side."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self._lock = threading.Lock()
        self._puts = 0
        self._second = threading.Event()
        self.overlapped: bool | None = None

    def put(self, name: str, data: bytes, *, replace: bool = True) -> None:
        if name.startswith("c/"):
            with self._lock:
                self._puts += 1
                n = self._puts
            if n == 1:
                self.overlapped = self._second.wait(5)
            elif n == 2:
                self._second.set()
        self.inner.put(name, data, replace=replace)


async def test_a_commit_of_a_few_small_files_uploads_them_in_parallel(
    memory_store: MemoryStore, kdf_params: Argon2Params
) -> None:
    """Regression: small files are sealed and uploaded in batches, one file after
    another per worker thread; with 256 per batch, a commit of 300 files sent 256 PUTs
    in a row from one thread while the others stood idle (an fsync took 15.6 s behind
    25 ms of latency each way, 3.0 s once spread over the workers)."""
    create_volume(memory_store, PASSPHRASE, kdf_params, RECOVERY_KEY)
    store = OverlapStore(memory_store)
    async with session(store, **QUIET) as v:  # type: ignore[arg-type]
        for k in range(64):
            await mkfile(v, ROOT_INO, b"f%d" % k, b"small file %d " % k * 40)
        await v.fsync()
        assert store.overlapped is True


@pytest.mark.parametrize("batch", [chunking.SMALL_BATCH, 4])
async def test_a_read_does_not_wait_behind_a_commit_of_many_small_files(
    memory_store: MemoryStore, kdf_params: Argon2Params, monkeypatch: pytest.MonkeyPatch, batch: int
) -> None:
    """Regression: a commit of many small files (a tree copy) spread its batches over
    every worker, and past SMALL_BATCH files per worker started more batches than there
    are workers, each batch a PUT after another: a read of another file queued behind
    them all. On S3 behind 30 ms per request, during `cp -a` of 24,000 small files, a
    4 KiB read of a file not in the cache waited 16-31 s for a worker."""
    monkeypatch.setattr(chunking, "SMALL_BATCH", batch)  # 4: 16 batches for 64 files
    create_volume(memory_store, PASSPHRASE, kdf_params, RECOVERY_KEY)
    old = os.urandom(300_000)
    async with session(memory_store, **QUIET) as v:
        await mkfile(v, ROOT_INO, b"old", old)
    store = GatedStore(memory_store)
    async with session(store, **QUIET) as v:  # type: ignore[arg-type]
        for k in range(64):
            await mkfile(v, ROOT_INO, b"f%d" % k, b"small file %d " % k * 40)
        fh = await v.open(await ino_of(v, "old"), os.O_RDONLY)
        store.close_gate()
        async with trio.open_nursery() as nursery:
            try:  # the gate opens inside: a failure must not leave the commit stuck at it
                nursery.start_soon(v.commits.commit)
                await wait_until(lambda: store.waiting >= 8)
                await trio.testing.wait_all_tasks_blocked()
                with trio.fail_after(20):  # forever without a free worker
                    assert await v.read(fh, 0, 4096) == old[:4096]
                assert not store.open.is_set()  # the commit's uploads are still stalled
            finally:
                store.open_gate()
        await v.release(fh)


def test_small_batches_spread_over_the_workers_within_the_cap() -> None:
    """Each worker gets a share, no batch is empty, none exceeds SMALL_BATCH."""
    assert chunking.small_batch_size(300, 8) == 38
    assert chunking.small_batch_size(3, 8) == 1
    assert chunking.small_batch_size(100_000, 8) == chunking.SMALL_BATCH
    assert chunking.small_batch_size(5, 0) == 5


async def test_background_loop_commits_within_the_interval(volume_store: MemoryStore) -> None:
    async with session(volume_store, commit_interval=0.02) as v:
        f = await mkfile(v, ROOT_INO, b"f", b"soon durable")
        await wait_until(lambda: f in load(volume_store).inodes, timeout=5)
        await wait_until(lambda: not v.commits.has_work(), timeout=5)
        assert load(volume_store).inodes[f].size == len(b"soon durable")


async def test_snapshot_accounting_restarts_after_each_snapshot(
    volume_store: MemoryStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop keeps running totals of the log since the last snapshot: they must drop
    to what is left after a snapshot, or snapshots would follow every commit."""
    monkeypatch.setattr(committer, "SNAPSHOT_EVERY_OPS", 20)
    async with session(volume_store, **QUIET) as v:
        # Only this test snapshots: the loop, woken by each fsync's commit, took a due
        # snapshot itself now and then, before the test could see it was due.
        v.commits._snapshot_not_before = math.inf
        for k in range(12):
            await mkfile(v, ROOT_INO, b"a%d" % k)
        await v.fsync()
        assert v.commits.snapshot_due()
        await snapshot_now(v, volume_store)
        assert not v.commits.snapshot_due()
        await mkfile(v, ROOT_INO, b"one more")
        await v.fsync()
        assert not v.commits.snapshot_due()
        for k in range(12):
            await mkfile(v, ROOT_INO, b"b%d" % k)
        await v.fsync()
        assert v.commits.snapshot_due()


async def test_a_large_snapshot_waits_for_a_log_of_a_share_of_its_size(
    volume_store: MemoryStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: a snapshot followed every SNAPSHOT_EVERY_BYTES of log whatever the
    metadata's size, so a volume holding 570 MB of xattrs was compacted whole after
    every commit of its agent's 32 MiB. The log must now also hold a quarter of the
    last snapshot's bytes, at an unmount too."""
    monkeypatch.setattr(committer, "SNAPSHOT_EVERY_BYTES", 16 * 1024)
    monkeypatch.setattr(committer, "SNAPSHOT_AT_CLOSE_OPS", 1)
    async with session(volume_store, **QUIET) as v:
        v.commits._snapshot_not_before = math.inf  # only this test snapshots
        f = await mkfile(v, ROOT_INO, b"notes")
        for k in range(16):
            await v.setxattr(f, b"user.k%d" % k, os.urandom(16 * 1024))
        await v.fsync()
        name = await snapshot_now(v, volume_store)
        base = len(volume_store.get(name))
        assert base > 256 * 1024
        written = 0
        while (written + 6 * 1024) * committer.SNAPSHOT_LOG_SHARE < base:
            await v.setxattr(f, b"user.k0", os.urandom(2 * 1024))
            await v.fsync()
            written = v.commits._tail_bytes
            assert written < base // committer.SNAPSHOT_LOG_SHARE
            assert not v.commits.snapshot_due()
            assert not v.commits.snapshot_due(closing=True)
        assert written > 3 * committer.SNAPSHOT_EVERY_BYTES
        for _ in range(4):
            await v.setxattr(f, b"user.k1", os.urandom(2 * 1024))
        await v.fsync()
        assert v.commits.snapshot_due()
        assert v.commits.snapshot_due(closing=True)


# -- commit failures -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "prefix", "fault"),
    [
        ("put", "c/", "transient"),
        ("put", "c/", "unavailable"),
        ("put", "c/", "nospace"),
        ("put_if_absent", "l/", "transient"),
        ("put_if_absent", "l/", "unavailable"),
        ("sync", "", "transient"),
    ],
)
async def test_failed_commit_raises_and_keeps_the_data(
    faulty: FaultyStore, method: str, prefix: str, fault: Any
) -> None:
    data = os.urandom(3 << 20)
    async with session(faulty, **QUIET) as v:  # type: ignore[arg-type]
        d = await mkdir(v, ROOT_INO, b"d")
        f = await mkfile(v, d, b"f", data)
        await v.setxattr(f, b"user.k", b"v")
        faulty.fail_next(method, prefix, fault)
        with pytest.raises(StoreError):
            await v.fsync()
        assert faulty.injected
        assert f not in load(faulty.inner).inodes
        assert await read_all(v, f) == data  # still served from memory
        await v.fsync()
        state = load(faulty.inner)
        assert state.inodes[f].size == len(data)
        assert state.inodes[f].xattrs == {b"user.k": b"v"}
    async with session(faulty.inner) as v:
        assert await read_all(v, await ino_of(v, "d/f")) == data


def empty(store: MemoryStore) -> None:
    """What an S3 service back without its objects, or a local store's files removed,
    leave: nothing, under a live mount."""
    for name in store.list(""):
        store.delete(name)


@asynccontextmanager
async def writer_stopped_at_the_end(
    faulty: FaultyStore, monkeypatch: pytest.MonkeyPatch, verify_every: float
) -> AsyncIterator[tuple[Any, MemoryStore]]:
    """A session on faulty checking the store every verify_every seconds, whose unmount
    must fail with VolumeGoneError (its final commit finds the log gone too); and the
    memory store under it, to empty."""
    monkeypatch.setattr(committer, "VERIFY_INTERVAL", verify_every)
    store = faulty.inner
    assert isinstance(store, MemoryStore)
    with pytest.RaisesGroup(VolumeGoneError, flatten_subgroups=True):
        async with session(faulty, **QUIET) as v:  # type: ignore[arg-type]
            yield v, store


async def test_a_store_emptied_under_the_mount_stops_the_writer(
    faulty: FaultyStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: the next segment went into the emptied store as any new object, fsync
    and unmount succeeded, and the volume (its header gone) never mounted again, with
    everything acknowledged since."""
    async with writer_stopped_at_the_end(faulty, monkeypatch, 0.0) as (v, store):
        await mkfile(v, ROOT_INO, b"before", b"committed")
        await v.fsync()
        empty(store)
        await mkfile(v, ROOT_INO, b"after", b"acknowledged, and lost")
        with pytest.raises(VolumeGoneError, match="no longer holds this volume's log"):
            await v.fsync()
        assert isinstance(v.commits.stopped, VolumeGoneError)
        with pytest.raises(VolumeGoneError):
            await v.fsync()  # and every later one
    assert store.list("l/") == []  # no segment written into the emptied store


async def test_the_first_commit_after_a_failed_one_checks_the_store_at_once(
    faulty: FaultyStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bucket gone ("does not exist: create it first") and made again empty: the
    commit that succeeds once it is back checks, however soon after the last check."""
    async with writer_stopped_at_the_end(faulty, monkeypatch, 3600.0) as (v, store):
        await mkfile(v, ROOT_INO, b"a", b"one")
        await v.fsync()  # within the interval: no check
        faulty.fail_next("put_if_absent", "l/", "unavailable")
        await mkfile(v, ROOT_INO, b"b", b"two")
        with pytest.raises(StoreUnavailableError):
            await v.fsync()
        empty(store)
        with pytest.raises(VolumeGoneError):
            await v.fsync()


class CountingStats(WrappedStore):
    """Wraps a store; records the name of every stat."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.stats: list[str] = []

    def stat(self, name: str) -> Any:
        self.stats.append(name)
        return self.inner.stat(name)


async def test_a_store_that_keeps_the_log_is_checked_without_stopping_anything(
    faulty: FaultyStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(committer, "VERIFY_INTERVAL", 0.0)
    store = CountingStats(faulty.inner)
    async with session(store, **QUIET) as v:  # type: ignore[arg-type]
        for k in range(5):
            await mkfile(v, ROOT_INO, b"f%d" % k, b"x" * k)
            await v.fsync()
            assert store.stats[-1] == segment_name(v.commits.generation - 1)
        assert v.commits.stopped is None


class GivingUpStore(WrappedStore):
    """Wraps a store that stopped answering: while `down`, every chunk put gives up as
    RetryingStore does once the store has not answered for the whole store timeout.
    The first gives up at once; the others count themselves and take a while first,
    as requests already on their way to such a store do."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self._lock = threading.Lock()
        self.down = True
        self.puts = 0

    def put(self, name: str, data: bytes, *, replace: bool = True) -> None:
        if name.startswith("c/") and self.down:
            with self._lock:
                self.puts += 1
                first = self.puts == 1
            if not first:
                time.sleep(0.2)
            raise StoreUnavailableError("unreachable for the whole store timeout")
        self.inner.put(name, data, replace=replace)


async def test_a_commit_starts_no_more_uploads_once_one_gave_up_on_the_store(
    memory_store: MemoryStore, kdf_params: Argon2Params
) -> None:
    """Regression: after one file's upload gave up on an unreachable store, the other
    files of the commit went on, each of their uploads waiting the whole store timeout
    again: an fsync against a stalled S3 failed after twice --store-timeout. And the
    uploads under way that gave up too must not turn the fsync's error into a group."""
    create_volume(memory_store, PASSPHRASE, kdf_params, RECOVERY_KEY)
    store = GivingUpStore(memory_store)
    files = {b"f%d" % k: os.urandom(2 << 20) for k in range(16)}
    async with session(store, io_threads=2, **QUIET) as v:  # type: ignore[arg-type]
        inos = {name: await mkfile(v, ROOT_INO, name, data) for name, data in files.items()}
        with pytest.raises(StoreUnavailableError):
            await v.fsync()
        # The first, and those a worker had begun: they hold every worker until the
        # commit stops.
        assert store.puts <= 1 + 2  # of about 32 chunks (uploads take io_threads workers)
        store.down = False
        await v.fsync()  # the store answers again: nothing was dropped
        for name, data in files.items():
            assert await read_all(v, inos[name]) == data
    state = load(memory_store)
    assert {state.inodes[ino].size for ino in inos.values()} == {2 << 20}


class StalledStore(WrappedStore):
    """Wraps a store that stopped answering: a wave of chunk puts, one per worker,
    gives up on it at the same moment (as requests sent together to a stalled
    service time out together); counts the puts begun after that."""

    def __init__(self, inner: ObjectStore, wave: int) -> None:
        super().__init__(inner)
        self._lock = threading.Lock()
        self._wave = wave
        self._arrived = 0
        self._all_in = threading.Event()
        self.late = 0

    def put(self, name: str, data: bytes, *, replace: bool = True) -> None:
        if name.startswith("c/"):
            with self._lock:
                self._arrived += 1
                late = self._arrived > self._wave
                self.late += late
                if self._arrived == self._wave:
                    self._all_in.set()
            if not late:
                assert self._all_in.wait(10), "the workers never all had a put"
            raise StoreUnavailableError("unreachable for the whole store timeout")
        self.inner.put(name, data, replace=replace)


@pytest.mark.parametrize(
    ("count", "size"), [(16, 2 << 20), (1200, 1000)], ids=["large files", "small files"]
)
async def test_no_upload_begins_once_a_wave_of_them_gave_up_on_the_store(
    memory_store: MemoryStore, kdf_params: Argon2Params, count: int, size: int
) -> None:
    """Regression: when the uploads in flight gave up together, each worker that ended
    was handed the next upload before the commit could stop (the token went back as
    the thread ended), and that upload waited the whole store timeout again."""
    create_volume(memory_store, PASSPHRASE, kdf_params, RECOVERY_KEY)
    store = StalledStore(memory_store, wave=2)  # io_threads: the workers uploads take
    async with session(store, io_threads=2, **QUIET) as v:  # type: ignore[arg-type]
        for k in range(count):
            await mkfile(v, ROOT_INO, b"f%d" % k, os.urandom(size))
        with pytest.raises(StoreUnavailableError):
            await v.fsync()
        assert store.late == 0
        store.put = memory_store.put  # type: ignore[method-assign]
        await v.fsync()
    assert len(load(memory_store).inodes) == count + 1


async def file_and_its_last_chunk(
    store: MemoryStore, kdf_params: Argon2Params, size: int
) -> tuple[int, Extent]:
    """A new volume holding file "f" of size random bytes, committed; its inode and the
    extent of its last byte (the neighbour a flush of a write before it reads to merge)."""
    create_volume(store, PASSPHRASE, kdf_params, RECOVERY_KEY)
    async with session(store, **QUIET) as v:
        ino = await mkfile(v, ROOT_INO, b"f", os.urandom(size))
        await v.fsync()
        extents = v.inode(ino).extents
        assert extents is not None
        last = extents.covering(size - 1)
        assert last is not None
    return ino, last


class DamagedNeighbourStore(WrappedStore):
    """Wraps a store that stopped answering, where one old chunk reads back damaged:
    chunk puts give up on the store (as RetryingStore does after the store timeout)
    once a flush has read that chunk, so that its IntegrityError comes first."""

    def __init__(self, inner: MemoryStore, damaged: str) -> None:
        super().__init__(inner)
        self.damaged = damaged
        self.read = threading.Event()
        self.down = True

    def get(self, name: str, max_size: int | None = None) -> bytes:
        data = self.inner.get(name, max_size)
        if name == self.damaged and self.down:
            self.read.set()
            return data[:-1] + bytes([data[-1] ^ 1])
        return data

    def put(self, name: str, data: bytes, *, replace: bool = True) -> None:
        if name.startswith("c/") and self.down:
            assert self.read.wait(10), "the flush never read its damaged neighbour"
            time.sleep(0.2)  # the neighbour's IntegrityError reaches the flush first
            raise StoreUnavailableError("unreachable for the whole store timeout")
        self.inner.put(name, data, replace=replace)


async def test_an_upload_giving_up_fails_the_commit_when_a_merge_read_failed_first(
    memory_store: MemoryStore, kdf_params: Argon2Params, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: an upload that gave up on the store cancelled the commit's flushes.
    A flush whose merge read had just met a damaged old chunk raised that error instead
    (the first of its nursery's), retried unmerged, was cancelled at once, and nothing
    was left to say that the commit failed: its segment was published without the
    file's new bytes and fsync succeeded; a crash then lost them."""
    size = filedata.WINDOW + (1 << 20)
    ino, last = await file_and_its_last_chunk(memory_store, kdf_params, size)
    # The flush below uploads its first window's chunks all at once, then reads the old
    # bytes after its write to merge them: the last 10 KiB, in the last chunk, damaged.
    monkeypatch.setattr(filedata, "MAX_JOBS", 64)
    store = DamagedNeighbourStore(memory_store, chunk_name(last.chunk))
    new = os.urandom(size - (10 << 10))
    async with mounted(store, io_threads=32, **QUIET) as v:  # type: ignore[arg-type]
        await write_at(v, ino, 0, new)
        with pytest.raises(StoreUnavailableError):
            await v.fsync()
        assert store.read.is_set()
        store.down = False
        await v.fsync()
        assert (await read_all(v, ino))[: len(new)] == new
    async with session(memory_store, **QUIET) as v:
        assert (await read_all(v, ino))[: len(new)] == new


class DamagedNeighbourCountingStore(DamagedNeighbourStore):
    """DamagedNeighbourStore that keeps the chunks sent again after they gave up.

    Not the puts begun after the first gave up: a worker still sealing its chunk then
    (descheduled on a loaded machine) begins its put later, rightly, and counted so it
    failed the test by timing alone. An upload sent again is the retry's own."""

    def __init__(self, inner: MemoryStore, damaged: str) -> None:
        super().__init__(inner, damaged)
        self.gave_up = threading.Event()
        self.tried: set[str] = set()
        self.again: list[str] = []
        self._lock = threading.Lock()

    def put(self, name: str, data: bytes, *, replace: bool = True) -> None:
        if name.startswith("c/") and self.down:
            with self._lock:
                if name in self.tried:
                    self.again.append(name)
                self.tried.add(name)
            try:
                super().put(name, data, replace=replace)
            finally:
                self.gave_up.set()
        self.inner.put(name, data, replace=replace)


async def test_an_early_flush_stops_once_an_upload_gave_up_even_after_a_merge_read_failed(
    memory_store: MemoryStore, kdf_params: Argon2Params, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: an early flush (a writer past flush_threshold) whose merge read met a
    damaged old chunk while its uploads gave up on a stalled store retried unmerged, and
    sent every upload again: each waited the whole store timeout a second time before
    the blocked writers got their error. The commit's flushes stop at the first give-up;
    now the early flush does too."""
    size = filedata.WINDOW + (1 << 20)
    ino, last = await file_and_its_last_chunk(memory_store, kdf_params, size)
    monkeypatch.setattr(filedata, "MAX_JOBS", 64)  # the first window's uploads all at once
    store = DamagedNeighbourCountingStore(memory_store, chunk_name(last.chunk))
    new = os.urandom(size - (10 << 10))
    async with mounted(store, io_threads=32, **QUIET) as v:  # type: ignore[arg-type]
        await write_at(v, ino, 0, new)
        with pytest.raises(StoreUnavailableError):
            await v.commits.relieve_pressure()  # seals the file alone: an early flush
        assert store.read.is_set() and store.gave_up.is_set()
        assert store.again == []  # the unmerged retry sent the same first chunks again
        store.down = False
        await v.fsync()
        assert (await read_all(v, ino))[: len(new)] == new


class RefusedNeighbourStore(DamagedNeighbourStore):
    """DamagedNeighbourStore whose old chunk is refused, not damaged: its read fails with
    a StoreError that no retry clears (access denied), and a flush does not retry
    unmerged after it, as after a damaged chunk."""

    def get(self, name: str, max_size: int | None = None) -> bytes:
        if name == self.damaged and self.down:
            self.read.set()
            raise StoreError(f"{name}: access denied")
        return self.inner.get(name, max_size)


async def test_an_early_flush_whose_upload_gave_up_says_so_when_another_error_came_first(
    memory_store: MemoryStore, kdf_params: Argon2Params, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: an early flush whose merge read failed (a StoreError, first of its
    nursery's) while its uploads gave up on the store raised the read's error alone:
    the give-up was dropped, so the commit waiting at the gate for that flush was not
    told the store was given up on, and sent every upload again, each waiting the whole
    store timeout. The commit's own flushes report the give-up whatever came first."""
    size = filedata.WINDOW + (1 << 20)
    ino, last = await file_and_its_last_chunk(memory_store, kdf_params, size)
    monkeypatch.setattr(filedata, "MAX_JOBS", 64)  # the first window's uploads all at once
    store = RefusedNeighbourStore(memory_store, chunk_name(last.chunk))
    new = os.urandom(size - (10 << 10))
    async with mounted(store, io_threads=32, **QUIET) as v:  # type: ignore[arg-type]
        await write_at(v, ino, 0, new)
        with pytest.raises(StoreUnavailableError):
            await v.commits.relieve_pressure()  # seals the file alone: an early flush
        assert store.read.is_set()
        store.down = False
        await v.fsync()
        assert (await read_all(v, ino))[: len(new)] == new


class HeldStore(WrappedStore):
    """Wraps a store that stopped answering: chunk puts wait until released, then give
    up on it (as RetryingStore does after the store timeout); counts those begun after
    the first gave up."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.release = threading.Event()
        self.gave_up = threading.Event()
        self.held = 0
        self.late = 0
        self._lock = threading.Lock()

    def put(self, name: str, data: bytes, *, replace: bool = True) -> None:
        if name.startswith("c/"):
            with self._lock:
                late = self.gave_up.is_set()
                self.late += late
                self.held += not late
            if not late:
                assert self.release.wait(10), "never released"
                self.gave_up.set()
            raise StoreUnavailableError("unreachable for the whole store timeout")
        self.inner.put(name, data, replace=replace)


async def test_a_commit_that_waited_for_an_early_flush_giving_up_starts_no_upload(
    memory_store: MemoryStore, kdf_params: Argon2Params
) -> None:
    """Regression: an fsync that came while an early flush (past flush_threshold) was
    uploading to a stalled store waited for that flush to give up, then sent the
    commit's own uploads, which waited the whole store timeout again: a 40 MiB
    checkpoint written and fsynced got EIO after twice --store-timeout (24 s of 12)."""
    create_volume(memory_store, PASSPHRASE, kdf_params, RECOVERY_KEY)
    store = HeldStore(memory_store)
    async with mounted(store, **QUIET) as v:  # type: ignore[arg-type]
        # Over MAX_CHUNK, so that it is cut at least once whatever its bytes: 3 MiB of
        # random bytes sometimes held no cut point, and the test failed at random.
        data = os.urandom(MAX_CHUNK + (1 << 20))
        ino = await mkfile(v, ROOT_INO, b"f", data)
        failed: list[BaseException] = []

        async def run(call: Callable[[], Awaitable[object]]) -> None:
            try:
                await call()
            except StoreUnavailableError as exc:
                failed.append(exc)

        async with trio.open_nursery() as nursery:
            # The early flush a writer past flush_threshold starts, here without the
            # writer's retry loop, whose next attempt would upload again.
            nursery.start_soon(run, v.commits.relieve_pressure)
            # Every chunk of that flush (all but the last, kept back) on its way: none of
            # its own puts begins once the first gave up, only the commit's could.
            chunks = len(v._chunker.cut(memoryview(data))) - 1
            assert chunks >= 1
            await wait_until(lambda: store.held == chunks)
            nursery.start_soon(run, v.fsync)
            await wait_until(lambda: v.commits.gate.statistics().tasks_waiting > 0)
            store.release.set()
        assert len(failed) == 2  # the early flush and the fsync
        assert store.late == 0
        store.put = memory_store.put  # type: ignore[method-assign]
        await v.fsync()
        assert await read_all(v, ino) == data
    assert load(memory_store).inodes[ino].size == len(data)


async def test_an_fsync_after_a_commit_failed_before_its_cut_waits_for_a_commit(
    memory_store: MemoryStore, kdf_params: Argon2Params
) -> None:
    """Regression: a commit that failed before its cut (it had waited for an early flush
    that gave up on the store) left the count of cuts behind. The next commit, between
    taking the commit lock and counting itself (the checkpoint in trio's Lock.acquire),
    then looked like a commit yet to take its cut: one already finished. An fsync made
    then returned at once, and said durable what no commit had carried."""
    create_volume(memory_store, PASSPHRASE, kdf_params, RECOVERY_KEY)
    store = HeldStore(memory_store)
    options = {"flush_threshold": 1 << 20, "max_buffered": 64 << 20, **QUIET}
    async with mounted(store, **options) as v:  # type: ignore[arg-type]
        await mkfile(v, ROOT_INO, b"f", os.urandom(3 << 20))  # starts an early flush
        await wait_until(lambda: store.held > 0)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(expect_unavailable, v)  # its commit waits at the gate
            await wait_until(lambda: v.commits.gate.statistics().tasks_waiting > 0)
            store.release.set()
        store.put = memory_store.put  # type: ignore[method-assign]
        await mkfile(v, ROOT_INO, b"checkpoint", b"state")
        synced = trio.Event()

        async def fsync() -> None:
            await v.fsync()
            synced.set()

        # The next commit, not counted yet: it holds the lock.
        async with trio.open_nursery() as nursery, v.commits._lock:
            nursery.start_soon(fsync)
            await trio.testing.wait_all_tasks_blocked()
            assert not synced.is_set()  # no commit has carried the checkpoint yet
        assert b"checkpoint" in load(memory_store).inodes[ROOT_INO].entries  # type: ignore[operator]


async def expect_unavailable(v: Any) -> None:
    with pytest.raises(StoreUnavailableError):
        await v.fsync()


async def test_commit_failing_in_a_chunk_upload_raises_the_store_error_itself(
    faulty: FaultyStore,
) -> None:
    """Regression: a chunk upload failing inside a flush surfaced as an ExceptionGroup,
    which fsync callers did not expect and which killed the background commit loop."""
    async with session(faulty, commit_interval=0.01) as v:  # type: ignore[arg-type]
        faulty.fail_next("put", "c/", "unavailable")
        f = await mkfile(v, ROOT_INO, b"f", os.urandom(3 << 20))
        await wait_until(lambda: faulty.injected)
        await wait_until(lambda: f in load(faulty.inner).inodes, timeout=10)
        faulty.fail_next("put", "c/", "transient")
        await mkfile(v, ROOT_INO, b"g", os.urandom(1 << 20))
        with contextlib.suppress(StoreError):  # itself, unless the loop met the fault first
            await v.fsync()
        await v.fsync()
        assert len(faulty.injected) == 2


async def test_flush_failing_to_read_an_old_chunk_commits_the_new_bytes_unmerged(
    faulty: FaultyStore, caplog: pytest.LogCaptureFixture
) -> None:
    async with session(faulty, **QUIET) as v:  # type: ignore[arg-type]
        f = await mkfile(v, ROOT_INO, b"f", b"x" * 100)
    async with session(faulty, **QUIET) as v:  # type: ignore[arg-type]
        old = v.inode(f).extents
        assert old is not None
        # As many bytes as the small old extent holds: they merge with it, which reads it.
        await write_at(v, f, 100, b"y" * 100)
        faulty.fail_next("get", "c/", "corrupt")
        await v.fsync()
        assert faulty.injected
        assert "unmerged" in caplog.text
        extents = v.inode(f).extents
        assert extents is not None and extents.covering(0) == old.covering(0)  # kept as it was
        assert f in load(faulty.inner).inodes
        assert await read_all(v, f) == b"x" * 100 + b"y" * 100


@pytest.mark.parametrize("pending", [False, True], ids=["only-the-release", "with-data"])
async def test_a_failed_final_commit_is_an_error_only_when_it_carried_data(
    faulty: FaultyStore, pending: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Unmounting commits the writer's release last. If that commit fails with nothing
    else in it, no data is lost: a warning, not the error that says data is lost."""
    volume = None
    failure: BaseExceptionGroup[BaseException] | None = None
    try:
        async with mounted(faulty, **QUIET) as volume:  # type: ignore[arg-type]
            await mkfile(volume, ROOT_INO, b"f", b"x")
            await volume.fsync()
            if pending:
                await mkfile(volume, ROOT_INO, b"g", b"y")
            faulty.fail_next("put_if_absent", "l/", "unavailable")
    except BaseExceptionGroup as group:  # trio's nurseries wrap it
        failure = group
    assert (failure is not None and failure.split(StoreError)[0] is not None) is pending
    assert volume is not None and volume.read_only is not pending  # released, or still to do
    assert faulty.injected
    assert ("Nothing is lost" in caplog.text) is not pending
    committed = load(faulty.inner)
    assert len(committed.inodes) == 2  # the root and f; g, if written, went with the commit
    assert committed.writer is not None  # not released: the next writer must take over


async def test_a_final_commit_failing_after_a_failed_commit_in_flight_is_an_error(
    faulty: FaultyStore, caplog: pytest.LogCaptureFixture
) -> None:
    """Unmounting while a commit is in flight (the loop retrying against a failing or
    slow store) found nothing pending, as that commit had taken it all. When that
    commit failed, its data came back into the final commit: failing too, that commit
    lost data, and must not be reported as the release alone."""
    gated = GatedStore(faulty)
    volume = None
    failure: BaseExceptionGroup[BaseException] | None = None

    async def open_gate_later() -> None:
        await trio.sleep(0.2)  # close() has begun: it waits for the commit in flight
        gated.open_gate()

    try:
        async with trio.open_nursery() as outer, mounted(gated, **QUIET) as volume:  # type: ignore[arg-type]
            await mkfile(volume, ROOT_INO, b"g", b"y")
            faulty.add_rule("put_if_absent", "l/", "unavailable")  # every create fails
            gated.close_gate()
            volume.commits.kick()  # the loop's commit takes g, then waits at the gate
            await wait_until(lambda: gated.waiting == 1)
            assert not volume.commits.has_work()
            outer.start_soon(open_gate_later)
    except BaseExceptionGroup as group:
        failure = group
    assert failure is not None and failure.split(StoreError)[0] is not None
    assert "Nothing is lost" not in caplog.text
    assert volume is not None and volume.read_only is False  # still holds g's bytes to commit


async def test_a_final_commit_failing_with_early_flushed_records_left_is_an_error(
    faulty: FaultyStore, caplog: pytest.LogCaptureFixture
) -> None:
    """Records an early flush queued (its chunks uploaded, no segment yet) are data the
    failed final commit carried: not the release alone."""
    volume = None
    failure: BaseExceptionGroup[BaseException] | None = None
    try:
        async with mounted(faulty, **PRESSURE) as volume:  # type: ignore[arg-type]
            faulty.add_rule("put_if_absent", "l/", "unavailable")  # every segment fails
            fh, _ = await volume.create(ROOT_INO, b"big", 0o644, RW, UID, GID)
            for k in range(12):
                await volume.write(fh, k << 16, os.urandom(64 << 10))
            await wait_until(lambda: len(volume.commits.pending) > 2)  # type: ignore[union-attr]
            await volume.release(fh)
    except BaseExceptionGroup as group:
        failure = group
    assert failure is not None and failure.split(StoreError)[0] is not None
    assert "Nothing is lost" not in caplog.text
    assert volume is not None and volume.read_only is False


async def test_a_lost_reply_republished_then_a_failed_release_loses_nothing(
    faulty: FaultyStore, caplog: pytest.LogCaptureFixture
) -> None:
    """A segment create whose reply was lost is published again first by the final
    commit; once it is, only the release is left when the release's own segment fails."""
    async with mounted(faulty, **QUIET) as v:  # type: ignore[arg-type]
        f = await mkfile(v, ROOT_INO, b"a", b"A")
        gen = v.commits.generation
        faulty.fail_next("put_if_absent", "l/", "transient_after")  # landed, reply lost
        with contextlib.suppress(StoreError):
            await v.fsync()
        faulty.add_rule("put_if_absent", segment_name(gen + 2), "unavailable")
    assert v.read_only
    assert "Nothing is lost" in caplog.text
    state = load(faulty.inner)
    assert state.generation == gen + 1 and f in state.inodes
    assert state.writer is not None and not state.writer.released


async def test_every_waiter_of_a_failed_commit_sees_the_error(faulty: FaultyStore) -> None:
    async with session(faulty, **QUIET) as v:  # type: ignore[arg-type]
        await mkfile(v, ROOT_INO, b"f", b"x")
        faulty.fail_next("put_if_absent", "l/", "unavailable")
        errors: list[BaseException] = []

        async def one() -> None:
            try:
                await v.fsync()
            except StoreError as exc:
                errors.append(exc)

        async with trio.open_nursery() as nursery:
            for _ in range(5):
                nursery.start_soon(one)
        assert len(errors) == 5
        await v.fsync()


@pytest.mark.parametrize("rekey", [False, True], ids=["alone", "then-rekeyed"])
async def test_segment_create_that_landed_despite_an_error_is_not_fencing(
    faulty: FaultyStore, rekey: bool
) -> None:
    """Regression: a segment create whose reply was lost (it took effect, then failed)
    made the next commit find its own generation taken and fence the writer. Then again
    once a rekey had re-sealed that segment: publishing the writer's own bytes again
    found other bytes there, and the mount fenced itself with no other writer."""
    async with session(faulty, **QUIET) as v:  # type: ignore[arg-type]
        f = await mkfile(v, ROOT_INO, b"f", b"first")
        faulty.fail_next("put_if_absent", "l/", "transient_after")
        with pytest.raises(StoreError):
            await v.fsync()
        if rekey:
            landed = segments(faulty.inner)[-1]
            before = faulty.inner.get(landed)
            await v.adopt_rekey(start_rekey(faulty.inner))
            assert v.rekey is not None
            with trio.fail_after(20):
                await v.rekey.done.wait()
            assert faulty.inner.get(landed) != before  # re-sealed while unsure
        g = await mkfile(v, ROOT_INO, b"g", b"second")
        await v.fsync()
        assert v.commits.stopped is None
        state = load(faulty.inner)
        assert f in state.inodes and g in state.inodes
    assert_replay_equals_live(faulty.inner, v)


async def test_a_garbled_read_of_its_own_landed_segment_does_not_fence_the_writer(
    faulty: FaultyStore,
) -> None:
    """Regression (found by fuzzing with store faults): after a segment create whose reply
    was lost, the next commit reads the segment back to tell its own from another
    writer's. One damaged read of it (a flipped bit in transit) failed to authenticate,
    was taken for another writer's segment, and fenced the mount for good: read-only,
    everything since the last commit lost. Another writer's segment opens under the
    volume's keys; one that does not open is read once more before fencing."""
    async with session(faulty, **QUIET) as v:  # type: ignore[arg-type]
        f = await mkfile(v, ROOT_INO, b"f", b"first")
        faulty.fail_next("put_if_absent", "l/", "transient_after")  # landed, reply lost
        with pytest.raises(StoreError):
            await v.fsync()
        g = await mkfile(v, ROOT_INO, b"g", b"second")
        faulty.fail_next("get", "l/", "corrupt")
        await v.fsync()
        assert v.commits.stopped is None
        assert [fault for _, _, fault in faulty.injected] == ["transient_after", "corrupt"]
        state = load(faulty.inner)
        assert f in state.inodes and g in state.inodes
    assert_replay_equals_live(faulty.inner, v)


async def test_a_store_that_failed_to_flush_stops_the_writer(faulty: FaultyStore) -> None:
    """A failed flush may have lost what it flushed, and a later one cannot tell: the
    writer stops as a fenced one does, but fsync reports the store's error."""
    with pytest.RaisesGroup(SyncFailedError, flatten_subgroups=True):
        async with session(faulty, **QUIET) as v:  # type: ignore[arg-type]
            f = await mkfile(v, ROOT_INO, b"f", b"before")
            await v.fsync()
            fh = await v.open(f, RW)
            await v.write(fh, 0, b"AFTER!")
            faulty.fail_next("sync", "", "flush_failed")
            for _ in range(2):  # and again: no later commit may succeed
                with pytest.raises(SyncFailedError, match="flush failed"):
                    await v.fsync()
            assert isinstance(v.commits.stopped, SyncFailedError)
            assert len(faulty.injected) == 1
            await expect(errno.EROFS, v.write(fh, 0, b"x"))
            await expect(errno.EROFS, v.create(ROOT_INO, b"g", 0o644, RW, UID, GID))
            assert await v.read(fh, 0, 10) == b"AFTER!"
            await v.release(fh)
    async with mounted(faulty.inner, read_only=True) as ro:
        assert await read_all(ro, f) == b"before"


async def test_lost_reply_then_a_failed_next_segment_commits_each_record_once(
    faulty: FaultyStore,
) -> None:
    async with session(faulty, **QUIET) as v:  # type: ignore[arg-type]
        await mkfile(v, ROOT_INO, b"f", b"first")
        gen = v.commits.generation
        faulty.fail_next("put_if_absent", "l/", "transient_after")
        with pytest.raises(StoreError):
            await v.fsync()
        await v.rename(ROOT_INO, b"f", ROOT_INO, b"g")
        faulty.fail_next("put_if_absent", segment_name(gen + 2), "unavailable")
        with pytest.raises(StoreError):
            await v.fsync()  # the lost segment is confirmed; the next one fails
        assert v.commits.generation == gen + 1
        await v.fsync()
        assert v.commits.generation == gen + 2
    assert_replay_equals_live(faulty.inner, v)
    assert sorted(load(faulty.inner).inodes[ROOT_INO].entries or {}) == [b"g"]


async def test_background_loop_retries_a_failed_commit(faulty: FaultyStore) -> None:
    async with session(faulty, commit_interval=0.02) as v:  # type: ignore[arg-type]
        faulty.fail_next("put", "c/", "transient", times=3)
        f = await mkfile(v, ROOT_INO, b"f", os.urandom(100_000))
        with trio.fail_after(20):
            while f not in load(faulty.inner).inodes:
                await trio.sleep(0.05)
        assert len(faulty.injected) == 3


# -- fencing ---------------------------------------------------------------------------------


async def test_second_claim_fences_the_first_writer(volume_store: MemoryStore) -> None:
    with pytest.RaisesGroup(FencedError, flatten_subgroups=True):
        async with mounted(volume_store, **QUIET) as v:
            f = await mkfile(v, ROOT_INO, b"f", b"before")
            await v.fsync()
            other = open_volume(volume_store, Passphrase(PASSPHRASE))
            check_writer(other, takeover=True)
            claim_writer(other)
            fh = await v.open(f, RW)
            await v.write(fh, 0, b"AFTER!")  # buffered: the fence shows at the commit
            with pytest.raises(FencedError):
                await v.commits.commit()
            assert v.commits.stopped is not None
            await expect(errno.EROFS, v.fsync())
            await expect(errno.EROFS, v.write(fh, 0, b"x"))
            await expect(errno.EROFS, v.create(ROOT_INO, b"g", 0o644, RW, UID, GID))
            await expect(errno.EROFS, v.mkdir(ROOT_INO, b"d", 0o755, UID, GID))
            await expect(errno.EROFS, v.setattr(f, size=0))
            assert await v.read(fh, 0, 10) == b"AFTER!"
            await v.release(fh)
    state = load(volume_store)
    assert state.writer is not None and state.writer.mount_id == other.writer.mount_id  # type: ignore[union-attr]
    async with mounted(volume_store, read_only=True) as ro:
        assert await read_all(ro, f) == b"before"


async def test_a_flush_failing_after_a_takeover_reports_the_takeover(
    faulty: FaultyStore,
) -> None:
    """Regression: a writer that takes the volume over deletes old snapshots, the
    fenced writer's newest among them, which its store then found lost at the next
    flush: the mount reported a disk that lost writes, sending the operator after
    the hardware, where the cause was the takeover."""
    with pytest.RaisesGroup(FencedError, flatten_subgroups=True):
        async with mounted(faulty, **QUIET) as v:  # type: ignore[arg-type]
            f = await mkfile(v, ROOT_INO, b"f", b"before")
            await v.fsync()
            other = open_volume(faulty.inner, Passphrase(PASSPHRASE))
            check_writer(other, takeover=True)
            claim_writer(other)
            await write_at(v, f, 0, b"AFTER!")
            faulty.fail_next("sync", "", "flush_failed")
            with pytest.raises(FencedError, match="taken over"):
                await v.commits.commit()
            assert isinstance(v.commits.stopped, FencedError)
            assert faulty.injected


async def test_a_fenced_mount_with_nothing_left_unmounts_quietly(
    volume_store: MemoryStore, caplog: pytest.LogCaptureFixture
) -> None:
    """Taken over with everything committed: the release is the new writer's business,
    and neither an error (nothing is lost) nor advice to take over is due."""
    async with mounted(volume_store, **QUIET) as v:
        await mkfile(v, ROOT_INO, b"f", b"x")
        await v.fsync()
        other = open_volume(volume_store, Passphrase(PASSPHRASE))
        check_writer(other, takeover=True)
        claim_writer(other)
    assert v.read_only
    assert "--takeover" not in caplog.text
    state = load(volume_store)
    assert state.writer is not None and state.writer.mount_id == other.writer.mount_id  # type: ignore[union-attr]


async def test_a_store_failing_to_flush_the_release_still_says_takeover_is_needed(
    faulty: FaultyStore, caplog: pytest.LogCaptureFixture
) -> None:
    """A store that failed to flush stops the writer as a fenced one is stopped, but no
    other writer holds the volume: the release it could not commit is still its own, and
    a mount on another host needs --takeover. Unmounting said nothing about it, as if
    taken over."""
    async with mounted(faulty, **QUIET) as v:  # type: ignore[arg-type]
        await mkfile(v, ROOT_INO, b"f", b"x")
        await v.fsync()
        faulty.fail_next("sync", "", "flush_failed")
    assert v.read_only and isinstance(v.commits.stopped, SyncFailedError)
    assert "--takeover" in caplog.text
    state = load(faulty.inner)
    assert state.writer is not None and not state.writer.released


async def test_fenced_background_loop_stops(volume_store: MemoryStore) -> None:
    with pytest.RaisesGroup(FencedError, flatten_subgroups=True):
        async with mounted(volume_store, commit_interval=0.01) as v:
            other = open_volume(volume_store, Passphrase(PASSPHRASE))
            claim_writer(other)
            await mkfile(v, ROOT_INO, b"f", b"x")
            await wait_until(lambda: v.commits.stopped is not None)
            await expect(errno.EROFS, v.fsync())


async def test_fsync_waiting_behind_a_fenced_commit_fails_instead_of_hanging(
    volume_store: MemoryStore,
) -> None:
    """Regression: an fsync that came while a commit was in flight waits for the commit
    after it; when the one in flight was fenced the loop stopped, no later commit came,
    and that fsync (and the program calling it) waited forever."""
    gated = GatedStore(volume_store)  # gates segment creates (no chunk is put here)
    with pytest.RaisesGroup(FencedError, flatten_subgroups=True):
        async with mounted(gated, **QUIET) as v:  # type: ignore[arg-type]
            await mkfile(v, ROOT_INO, b"f", b"x")
            gated.close_gate()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(expect, errno.EROFS, v.fsync())  # its commit blocks
                await wait_until(lambda: gated.waiting == 1)
                await mkfile(v, ROOT_INO, b"g", b"y")
                other = open_volume(volume_store, Passphrase(PASSPHRASE))
                check_writer(other, takeover=True)
                claim_writer(other)  # takes the generation the blocked commit wants
                nursery.start_soon(expect, errno.EROFS, v.fsync())  # waits for the next one
                await trio.sleep(0.05)
                gated.open_gate()
                with trio.fail_after(5):
                    await wait_until(lambda: not nursery.child_tasks)
            assert v.commits.stopped is not None


PRESSURE = {"flush_threshold": 512 * 1024, "max_buffered": 1 << 20, **QUIET}


async def test_writers_wait_while_a_commit_stores_its_quota_of_small_files(
    memory_store: MemoryStore, kdf_params: Argon2Params
) -> None:
    """Regression: only bytes held writers back, so a tree copy buffered 64 MiB of small
    files (about 8,000) while a commit stored the previous 8,000, a PUT each: behind
    30 ms per request each commit took 36-58 s, and a checkpoint's fsync, which waits
    for the commit in flight and the next, up to 156 s. Past max_dirty_files, writers
    now wait for a commit to take the files, so a commit carries about that many."""
    create_volume(memory_store, PASSPHRASE, kdf_params, RECOVERY_KEY)
    store = GatedStore(memory_store)
    quota = 8
    async with session(store, max_dirty_files=quota, **QUIET) as v:  # type: ignore[arg-type]
        written: list[int] = []
        carried: list[int] = []
        flush_all = v.commits._flush_all

        async def counted(jobs: list[Any], batch: Any) -> None:
            carried.append(len(jobs))  # the files a commit stores
            await flush_all(jobs, batch)

        v.commits._flush_all = counted  # type: ignore[method-assign]

        async def copy_tree() -> None:
            for k in range(6 * quota):
                await mkfile(v, ROOT_INO, b"f%d" % k, b"small file %d " % k * 40)
                written.append(k)

        await mkfile(v, ROOT_INO, b"first", b"first file")
        store.close_gate()
        async with trio.open_nursery() as nursery:
            try:  # the gate opens inside: a failure must not leave the commit stuck at it
                nursery.start_soon(v.commits.commit)
                await wait_until(lambda: store.waiting > 0)  # a commit is storing a file
                nursery.start_soon(copy_tree)
                await trio.testing.wait_all_tasks_blocked()
                assert len(written) <= quota + 1  # the copy waits for that commit
            finally:
                store.open_gate()
        await v.fsync()
        assert len(written) == 6 * quota
        assert max(carried) <= quota + 1
    state = load(memory_store)
    assert len(state.inodes[ROOT_INO].entries or {}) == 6 * quota + 1


async def test_changes_wait_for_a_commit_once_the_records_it_would_carry_pass_the_bound(
    faulty: FaultyStore,
) -> None:
    """Regression: nothing bounded the records awaiting a commit. An agent setting 64 KiB
    xattrs through a mount outran the commits, whose segments grew to 147 MB, 506 MB,
    then 1.9 GB within 40 s (the daemon at 8.8 GB of RSS): the next one would have
    passed the 2 GiB a mount reads (codec.MAX_METADATA_SIZE), its fsync succeeding and
    every later mount failing. Past max_pending_records a change waits for a commit,
    and fails as an fsync does, having changed nothing, if that commit fails."""
    bound = 256 << 10
    size = 64 << 10
    value = os.urandom(size)  # incompressible: a segment is as large as its records
    async with session(faulty, max_pending_records=bound, **QUIET) as v:  # type: ignore[arg-type]
        files = [await mkfile(v, ROOT_INO, b"f%d" % k) for k in range(4)]
        for ino in files:
            for n in range(15):
                await v.setxattr(ino, b"user.k%d" % n, value)
        last = await mkfile(v, ROOT_INO, b"last")
        faulty.fail_next("put_if_absent", SEGMENT_PREFIX, "unavailable")
        with pytest.raises(StoreError):
            for n in range(15):
                await v.setxattr(last, b"user.k%d" % n, value)
        assert len(v.inode(last).xattrs) == n  # the request that failed set nothing
    sizes = [len(faulty.inner.get(name)) for name in segments(faulty.inner)]
    assert max(sizes) < bound + 2 * size, sizes  # the bound, and a request past it
    state = load(faulty.inner)
    assert all(len(state.inodes[ino].xattrs) == 15 for ino in files)
    assert VolumeOptions().max_pending_records * 16 <= codec.MAX_METADATA_SIZE


async def test_writers_waiting_for_buffer_space_fail_once_the_volume_is_fenced(
    volume_store: MemoryStore,
) -> None:
    """Regression: small files under pressure are committed early; when that commit met
    the fence, the early flush ended and writers blocked at max_buffered waited forever
    (nothing would ever be committed, so nothing freed the bytes)."""
    with pytest.RaisesGroup(FencedError, flatten_subgroups=True):
        async with mounted(volume_store, **PRESSURE) as v:
            other = open_volume(volume_store, Passphrase(PASSPHRASE))
            claim_writer(other)
            with trio.fail_after(20), pytest.raises(FsError) as info:
                for k in range(1000):
                    await mkfile(v, ROOT_INO, b"f%04d" % k, os.urandom(8192))
            assert info.value.errno == errno.EROFS
            assert v.commits.stopped is not None


async def test_failed_early_flush_is_retried_while_writers_wait(faulty: FaultyStore) -> None:
    """Regression: a failed early flush ended, and writers blocked at max_buffered waited
    for the commit loop, a whole commit interval away. A transient failure keeps them
    waiting for the retry (only a store given up on, or a full disk, fails them)."""
    files = {b"f%04d" % k: os.urandom(8192) for k in range(400)}
    async with session(faulty, **PRESSURE) as v:  # type: ignore[arg-type]
        faulty.fail_next("put_if_absent", "l/", "transient")
        with trio.fail_after(30):
            inos = {name: await mkfile(v, ROOT_INO, name, data) for name, data in files.items()}
        assert faulty.injected
        for name in (b"f0000", b"f0399"):
            assert await read_all(v, inos[name]) == files[name]


async def test_a_commit_failing_again_and_again_logs_once_and_once_more_when_it_recovers(
    faulty: FaultyStore, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: the commit loop logged one error per attempt, every second for as long
    as the store's disk stayed full (3,600 lines an hour, and as many from early flushes)."""
    caplog.set_level(logging.INFO, logger="sealfs")
    async with mounted(faulty, commit_interval=0.01) as v:  # type: ignore[arg-type]
        faulty.add_rule("put_if_absent", "l/", "nospace")
        await mkfile(v, ROOT_INO, b"a", b"data")
        v.commits.kick()
        await wait_until(lambda: len(faulty.injected) >= 20)
        faulty.clear()
        await v.fsync()
    retries = [r for r in caplog.records if "will retry" in r.getMessage()]
    assert len(retries) == 1, [r.getMessage() for r in retries]
    assert "store disk full" in retries[0].getMessage()
    assert any("succeeded after" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("fault", "expected"),
    [("nospace", errno.ENOSPC), ("unavailable", errno.EIO), ("failed", errno.EIO)],
)
async def test_writers_past_max_buffered_fail_once_early_flushes_are_given_up(
    faulty: FaultyStore, fault: str, expected: int
) -> None:
    """Regression: writers blocked at max_buffered waited for an early flush that a full
    disk, or a store unreachable past --store-timeout, failed every second, forever: the
    writing process hung in the kernel, unkillable even by SIGKILL. Now the write past the
    limit fails with ENOSPC (EIO, as an fsync then does), and what was accepted is
    committed once the store takes it.

    Regression too: a store error that is not retried at all (a local store refusing
    writes: EACCES, EPERM, EROFS, EIO) fails an fsync with EIO at once, yet left writers
    past max_buffered blocked, unkillable, for as long as the store kept refusing."""
    faulty.add_rule("put", "c/", fault)
    blob = os.urandom(64 << 10)
    async with session(faulty, **PRESSURE) as v:  # type: ignore[arg-type]
        fh, attr = await v.create(ROOT_INO, b"big", 0o644, RW, UID, GID)
        written = 0
        with trio.fail_after(20), pytest.raises(FsError) as info:
            while True:
                await v.write(fh, written, blob)
                written += len(blob)
        assert info.value.errno == expected
        assert written >= PRESSURE["max_buffered"]
        faulty.clear()
        await v.fsync()
        assert await read_all(v, attr.ino) == blob * (written // len(blob))
        await v.write(fh, written, blob)  # space again: writes are accepted
        await v.release(fh)


async def test_every_time_writers_get_errors_the_log_says_why(
    faulty: FaultyStore, caplog: pytest.LogCaptureFixture
) -> None:
    """The early flush's retry log repeats a failure of the same kind only every ten
    minutes: a second outage gave writers EIO with nothing in the daemon's log."""
    blob = os.urandom(64 << 10)
    async with session(faulty, **PRESSURE) as v:  # type: ignore[arg-type]
        fh, _ = await v.create(ROOT_INO, b"big", 0o644, RW, UID, GID)
        written = 0
        for outage in (1, 2):
            faulty.add_rule("put", "c/", "failed")
            with trio.fail_after(20), pytest.raises(FsError):
                while True:
                    await v.write(fh, written, blob)
                    written += len(blob)
            said = [r for r in caplog.records if "writes past the buffer limit" in r.message]
            assert len(said) == outage and "EIO" in said[-1].message
            faulty.clear()
            await v.fsync()
            with trio.fail_after(20):
                while v._flush_errno is not None:  # the early flush succeeds once retried
                    await trio.sleep(0.05)
        await v.release(fh)


async def test_an_early_flush_that_only_waited_for_a_failing_commit_is_no_success(
    faulty: FaultyStore, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: an early flush that found the commit loop flushing the file waited for
    it and counted as a success, though that commit failed on the full disk as well: the
    store counted as having space again (writers past max_buffered waited once more) and
    "early flush succeeded" / "early flush failed" were logged in turn every second."""
    caplog.set_level(logging.INFO, logger="sealfs")
    faulty.add_rule("put", "c/", "nospace")
    blob = os.urandom(64 << 10)
    async with session(faulty, **(PRESSURE | {"commit_interval": 0.05})) as v:  # type: ignore[arg-type]
        fh, _ = await v.create(ROOT_INO, b"big", 0o644, RW, UID, GID)
        written = 0
        with trio.fail_after(20), pytest.raises(FsError):
            while True:
                await v.write(fh, written, blob)
                written += len(blob)
        await trio.sleep(4)  # early flushes and the commit loop contend for the file
        assert v._flush_errno == errno.ENOSPC
        flushes = [r.getMessage() for r in caplog.records if "early flush" in r.getMessage()]
        assert len(flushes) == 1 and "will retry" in flushes[0], flushes
        faulty.clear()
        await v.fsync()
        await v.release(fh)


async def test_retrying_against_a_full_store_keeps_memory_bounded(
    faulty: FaultyStore, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: each failed early flush or commit left reference cycles whose frames
    viewed the write buffers, freed only by a full collection: retried every second
    against a full disk, a daemon with 64 MiB buffered grew to 1.8 GiB in minutes."""
    caplog.set_level(logging.CRITICAL, logger="sealfs")  # kept records would hold the errors
    faulty.add_rule("put", "c/", "nospace")
    options = {"flush_threshold": 2 << 20, "max_buffered": 4 << 20, "commit_interval": 0.01}
    blob = os.urandom(64 << 10)
    tracemalloc.start()
    try:
        async with mounted(faulty, **options) as v:  # type: ignore[arg-type]
            fh, _ = await v.create(ROOT_INO, b"big", 0o644, RW, UID, GID)

            async def writer() -> None:
                with contextlib.suppress(FsError):  # ENOSPC past max_buffered
                    for k in range(128):
                        await v.write(fh, k * len(blob), blob)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(writer)
                await wait_until(lambda: len(faulty.injected) >= 40, timeout=60)
                held, _ = tracemalloc.get_traced_memory()
                nursery.cancel_scope.cancel()
            faulty.clear()
    finally:
        tracemalloc.stop()
    assert held < 10 * (4 << 20), f"{held >> 20} MiB held for 4 MiB buffered"


# -- snapshots -------------------------------------------------------------------------------


async def test_compaction_runs_with_the_cyclic_collector_paused(
    volume_store: MemoryStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decoding the previous snapshot allocates a few objects per inode; with the
    collector on, each collection also scanned the live state (100,000 files: 4.4 s
    against 1.6 s). The collector is paused for it and on again afterwards."""
    seen: list[bool] = []
    real = compaction.encode_snapshot

    def watching(*args: Any) -> Any:
        seen.append(gc.isenabled())
        return real(*args)

    monkeypatch.setattr(compaction, "encode_snapshot", watching)
    assert gc.isenabled()
    async with session(volume_store, **QUIET) as v:
        await mkfile(v, ROOT_INO, b"f", b"x")
        await v.fsync()
        await v.commits.snapshot()
        assert seen == [False]
        assert gc.isenabled()
        assert volume_store.list(SNAPSHOT_PREFIX)


async def test_a_failed_snapshot_is_not_retried_at_every_loop(
    faulty: FaultyStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: with a snapshot due and the store's disk full, the loop compacted the
    whole log and failed again at every interval: an idle daemon used half a core and
    logged a warning every second."""
    monkeypatch.setattr(committer, "SNAPSHOT_EVERY_OPS", 20)
    async with mounted(faulty, commit_interval=0.01) as v:  # type: ignore[arg-type]
        faulty.add_rule("put_if_absent", "s/", "nospace")
        for k in range(12):
            await mkfile(v, ROOT_INO, b"a%d" % k)
        await v.fsync()
        await wait_until(lambda: faulty.injected)
        await trio.sleep(0.5)  # fifty loop intervals
        assert len(faulty.injected) == 1
        faulty.clear()


async def test_snapshot_after_enough_ops_and_reopen_from_it(
    volume_store: MemoryStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(committer, "SNAPSHOT_EVERY_OPS", 40)
    async with session(volume_store, commit_interval=0.01) as v:
        d = await mkdir(v, ROOT_INO, b"d")
        for k in range(30):
            await mkfile(v, d, b"f%d" % k, b"content %d" % k)
            await v.setxattr(d, b"user.k%d" % k, b"%d" % k)
            if k % 7 == 0:
                await v.fsync()
        await v.fsync()
        await wait_until(lambda: volume_store.list(SNAPSHOT_PREFIX))
        snaps = volume_store.list(SNAPSHOT_PREFIX)
        await v.rename(d, b"f0", ROOT_INO, b"moved")
        await v.fsync()
    gen = parse_generation(snaps[-1])
    # Segments up to the snapshot are no longer needed to mount.
    for name in segments(volume_store):
        if parse_generation(name) <= gen:
            volume_store.delete(name)
    loaded = open_volume(volume_store, Passphrase(PASSPHRASE))
    assert loaded.base is not None and loaded.base[0] >= gen
    assert meta_signature(loaded.live) == meta_signature(v.meta)
    async with session(volume_store) as v2:
        assert await read_all(v2, await ino_of(v2, "moved")) == b"content 0"
        assert await read_all(v2, await ino_of(v2, "d/f29")) == b"content 29"


async def snapshot_now(volume: Any, store: MemoryStore) -> str:
    """Write a snapshot of the newest generation (the loop may be writing one already)."""
    target = volume.commits.generation

    async def done() -> bool:
        names = store.list(SNAPSHOT_PREFIX)
        return bool(names) and parse_generation(names[-1]) == target

    with trio.fail_after(10):
        while not await done():
            await volume.commits.snapshot()
            await trio.sleep(0.005)
    return str(store.list(SNAPSHOT_PREFIX)[-1])


class SnapshotHeldStore(WrappedStore):
    """Snapshot creates wait while `snapshots` is shut; a log segment of generation
    `open_at` opens them (from the thread that writes it)."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.snapshots = threading.Event()
        self.snapshots.set()
        self.waiting = 0
        self.open_at = -1

    def put_if_absent(self, name: str, data: bytes) -> None:
        if name.startswith(SNAPSHOT_PREFIX) and not self.snapshots.is_set():
            self.waiting += 1
            assert self.snapshots.wait(30), "snapshot create never let through"
        self.inner.put_if_absent(name, data)
        if name.startswith(SEGMENT_PREFIX) and parse_generation(name) == self.open_at:
            self.snapshots.set()


async def test_an_unmount_during_the_loop_s_snapshot_still_leaves_its_own(
    memory_store: MemoryStore, kdf_params: Argon2Params, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: an unmount while the loop wrote a snapshot found one "in progress"
    and wrote none, and the loop's was cancelled with the mount: the next mount
    replayed the whole log that the unmount's snapshot is there to spare it."""
    monkeypatch.setattr(committer, "SNAPSHOT_AT_CLOSE_OPS", 1)
    create_volume(memory_store, PASSPHRASE, kdf_params, RECOVERY_KEY)
    store = SnapshotHeldStore(memory_store)
    async with trio.open_nursery() as outside:
        async with mounted(store, **QUIET) as v:  # type: ignore[arg-type]
            for k in range(5):
                await mkfile(v, ROOT_INO, b"f%d" % k, b"%d" % k)
                await v.fsync()
            store.snapshots.clear()
            store.open_at = v.commits.generation + 1  # the unmount's release record
            outside.start_soon(v.commits.snapshot)  # stands for the loop's
            await wait_until(lambda: store.waiting > 0)
        final = v.commits.generation
    assert parse_generation(memory_store.list(SNAPSHOT_PREFIX)[-1]) == final


async def test_snapshot_never_includes_uncommitted_records(
    volume_store: MemoryStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(committer, "SNAPSHOT_EVERY_OPS", 10)
    async with session(volume_store, **QUIET) as v:
        for k in range(10):
            await mkfile(v, ROOT_INO, b"c%d" % k)
        await v.fsync()
        await mkfile(v, ROOT_INO, b"uncommitted")
        name = await snapshot_now(v, volume_store)
        assert parse_generation(name) == v.commits.generation
        snap = open_volume(volume_store, Passphrase(PASSPHRASE))
        assert snap.base is not None and snap.base[0] == v.commits.generation
        assert b"uncommitted" not in snap.live.inodes[ROOT_INO].entries  # type: ignore[operator]
        assert b"c9" in snap.live.inodes[ROOT_INO].entries  # type: ignore[operator]


async def test_second_snapshot_builds_on_the_first(
    volume_store: MemoryStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(committer, "SNAPSHOT_EVERY_OPS", 10)
    async with session(volume_store, **QUIET) as v:
        written = []
        for round_ in range(4):
            for k in range(6):
                await mkfile(v, ROOT_INO, b"r%d-%d" % (round_, k), b"%d" % k)
            await v.fsync()
            written.append(await snapshot_now(v, volume_store))
        # Only the newest two are kept: each is a whole copy of the metadata.
        assert volume_store.list(SNAPSHOT_PREFIX) == written[-2:]
    for name in segments(volume_store):
        if parse_generation(name) <= parse_generation(volume_store.list(SNAPSHOT_PREFIX)[-1]):
            volume_store.delete(name)
    assert_replay_equals_live(volume_store, v)


async def test_old_snapshots_that_cannot_be_removed_leave_the_snapshot_written(
    faulty: FaultyStore, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Removing superseded snapshots is housekeeping: a store refusing the deletes must
    neither fail the snapshot nor stop the next one from removing them."""
    monkeypatch.setattr(committer, "SNAPSHOT_EVERY_OPS", 10)
    async with session(faulty, **QUIET) as v:  # type: ignore[arg-type]
        written = []
        for round_ in range(3):
            await mkfile(v, ROOT_INO, b"r%d" % round_, b"x")
            await v.fsync()
            if round_ == 2:
                faulty.fail_next("delete", SNAPSHOT_PREFIX, "unavailable")
            written.append(await snapshot_now(v, faulty.inner))  # type: ignore[arg-type]
        assert faulty.inner.list(SNAPSHOT_PREFIX) == written
        assert "could not remove old snapshots" in caplog.text
        await mkfile(v, ROOT_INO, b"r3", b"x")
        await v.fsync()
        newest = await snapshot_now(v, faulty.inner)  # type: ignore[arg-type]
        assert faulty.inner.list(SNAPSHOT_PREFIX) == [written[-1], newest]


# -- orphans at mount ------------------------------------------------------------------------


class Crash(Exception):
    pass


async def test_orphans_are_purged_at_mount(volume_store: MemoryStore) -> None:
    with pytest.RaisesGroup(Crash, flatten_subgroups=True):
        async with mounted(volume_store, **QUIET) as v:
            fh, attr = await v.create(ROOT_INO, b"tmp", 0o644, RW, UID, GID)
            await v.write(fh, 0, b"scratch")
            await v.unlink(ROOT_INO, b"tmp")
            keep = await mkfile(v, ROOT_INO, b"keep", b"k")
            await v.fsync()
            raise Crash  # the process dies holding the unlinked file open
    state = load(volume_store)
    assert state.inodes[attr.ino].nlink == 0
    async with session(volume_store) as v:
        assert attr.ino not in v.meta.inodes
        assert keep in v.meta.inodes
    assert attr.ino not in load(volume_store).inodes


async def test_a_crashed_writer_does_not_block_the_next_mount(volume_store: MemoryStore) -> None:
    with pytest.RaisesGroup(Crash, flatten_subgroups=True):
        async with mounted(volume_store, **QUIET) as v:
            f = await mkfile(v, ROOT_INO, b"f", b"durable")
            await v.fsync()
            await mkfile(v, ROOT_INO, b"lost", b"never committed")
            raise Crash
    state = load(volume_store)
    assert state.writer is not None and not state.writer.released
    async with session(volume_store) as v:
        assert await read_all(v, f) == b"durable"
        with pytest.raises(FsError):
            await ino_of(v, "lost")


async def test_a_snapshot_over_the_readers_bound_is_never_written(
    volume_store: MemoryStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: the writer sealed snapshots of any size, but a reader refuses one
    over MAX_METADATA_SIZE (2 GiB; lowered here), and a newest snapshot that does not
    open fails every mount. The chunk table keeps every chunk ever uploaded, so a
    long-lived volume with small frequent commits gets there."""
    monkeypatch.setattr(codec, "MAX_METADATA_SIZE", 16 * 1024)
    async with session(volume_store, **QUIET) as v:
        fh, _ = await v.create(ROOT_INO, b"db", 0o644, RW, UID, GID)
        for _ in range(600):  # one changed page per commit: a new chunk each time
            await v.write(fh, 0, os.urandom(64))
            await v.fsync()
        await v.release(fh)
        await v.commits.snapshot()
        assert not v.commits.snapshot_due()
        assert not v.commits.snapshot_due(closing=True)
    assert volume_store.list(SNAPSHOT_PREFIX) == []
    load(volume_store)  # the volume still mounts, from its log
