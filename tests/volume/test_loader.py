"""Loading a volume: what it costs the garbage collector, and whether its writer lives."""

from __future__ import annotations

import gc
import hashlib
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import trio

from sealfs.errors import (
    FormatError,
    IntegrityError,
    ObjectNotFoundError,
    SealfsError,
    StoreError,
    StoreUnavailableError,
    UnsupportedVersionError,
    VolumeExistsError,
    WriterConflictError,
)
from sealfs.keys.header import HEADER_NAME, MAX_HEADER_SIZE
from sealfs.keys.kdf import Argon2Params
from sealfs.keys.slots import Passphrase, unlock
from sealfs.meta.codec import (
    MAX_SEALED_METADATA,
    SEGMENT_PREFIX,
    SNAPSHOT_PREFIX,
    Segment,
    encode_segment,
    parse_generation,
    segment_name,
    snapshot_name,
)
from sealfs.meta.model import ROOT_INO, WriterInfo
from sealfs.store.base import ObjectStore
from sealfs.store.faults import Fault, FaultyStore
from sealfs.store.local import LocalStore
from sealfs.store.memory import MemoryStore
from sealfs.volume.engine import Volume
from sealfs.volume.loader import (
    CLAIM_ATTEMPTS,
    Loaded,
    check_writer,
    claim_writer,
    create_volume,
    fetch_new_segments,
    load_unlocked,
    open_volume,
    process_start_ns,
    read_header,
    segment_digest,
    writer_alive,
)
from tests.conftest import PASSPHRASE, RECOVERY_KEY, WrappedStore, mounted
from tests.volume.test_engine import W, mkfile
from tests.volume.test_rekey import start_rekey


@contextmanager
def collections() -> Iterator[list[int]]:
    """The generations of the garbage collections that run inside."""
    seen: list[int] = []

    def note(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            seen.append(info["generation"])

    gc.callbacks.append(note)
    try:
        yield seen
    finally:
        gc.callbacks.remove(note)


async def test_loading_collects_no_garbage_and_leaves_the_collector_as_it_was(
    volume_store: ObjectStore,
) -> None:
    # Mount time regression: collections triggered while loading scanned every
    # object loaded so far, about half of the load of 100,000 files.
    async with mounted(volume_store) as volume:
        for i in range(2000):
            fh, _ = await volume.create(ROOT_INO, b"f%d" % i, 0o644, os.O_WRONLY, 0, 0)
            await volume.release(fh)
    unlocked = unlock(read_header(volume_store), Passphrase(PASSPHRASE))
    for enabled in (True, False):
        (gc.enable if enabled else gc.disable)()
        try:
            with collections() as seen:
                loaded = load_unlocked(volume_store, unlocked)
            assert len(loaded.live.inodes) == 2001
            # Re-enabled, the collector may catch up once (the generation depends on
            # what ran before); while loading, thousands of allocations trigger none.
            assert len(seen) <= (1 if enabled else 0), seen
            assert gc.isenabled() is enabled
        finally:
            gc.enable()


async def _four_commits(store: ObjectStore) -> list[str]:
    """Commit four new files, one per segment; the names of l/ then."""
    async with mounted(store, commit_interval=3600.0) as volume:
        for i in range(4):
            fh, _ = await volume.create(ROOT_INO, b"f%d" % i, 0o644, os.O_WRONLY, 0, 0)
            await volume.release(fh)
            await volume.fsync()
    return store.list(SEGMENT_PREFIX)


async def test_a_gap_in_the_log_names_the_way_out_and_the_way_works(
    volume_store: ObjectStore,
) -> None:
    # A store restored from a copy under a live mount: the mount's next commits land
    # after the restored log's end, and nothing mounts until they are moved away.
    names = await _four_commits(volume_store)
    lost = names[-3]
    volume_store.delete(lost)
    after = names[names.index(lost) + 1 :]
    kept = parse_generation(lost) - 1
    unlocked = unlock(read_header(volume_store), Passphrase(PASSPHRASE))
    with pytest.raises(IntegrityError) as info:
        load_unlocked(volume_store, unlocked)
    assert f"is missing (found {parse_generation(after[0])} next)" in str(info.value)
    assert (
        f"move {after[0]} and the segments after it out of the store to mount generation {kept}"
        in str(info.value)
    )
    for name in after:
        volume_store.delete(name)
    assert load_unlocked(volume_store, unlocked).live.generation == kept


class ListingLeavesOut(WrappedStore):
    """A store whose listings of l/ leave out some segments it holds, and not the later
    ones: what a directory read may do while the writer creates segments."""

    def __init__(self, inner: ObjectStore, left_out: set[str]) -> None:
        super().__init__(inner)
        self.left_out = left_out

    def list(self, prefix: str, start_after: str = "") -> list[str]:
        return [n for n in self.inner.list(prefix, start_after) if n not in self.left_out]


async def test_a_listing_that_raced_the_writer_loads_the_log_up_to_what_it_left_out(
    volume_store: ObjectStore,
) -> None:
    """On ext4 a follower beside a writer fsyncing as fast as it could listed 1312 but
    not 1310 and 1311, and stopped for good, calling the log damaged ("log generation
    1310 is missing"); a mount or a claim listing then would have failed alike."""
    names = await _four_commits(volume_store)
    racing = ListingLeavesOut(volume_store, {names[-3]})
    unlocked = unlock(read_header(volume_store), Passphrase(PASSPHRASE))
    loaded = load_unlocked(racing, unlocked)  # type: ignore[arg-type]
    assert loaded.live.generation == parse_generation(names[-4])  # a prefix, not an error
    racing.left_out.clear()
    got = fetch_new_segments(loaded, 256)  # the next look takes the rest
    assert [name for name, _ in got] == names[-3:]


def test_a_damaged_first_segment_names_a_restore_not_generation_0(
    volume_store: ObjectStore,
) -> None:
    # Moving l/1 and the rest out left generation 0, which has no root directory and
    # which the loader refuses: the one way out is a copy of the store.
    (first,) = volume_store.list(SEGMENT_PREFIX)
    sealed = bytearray(volume_store.get(first))
    sealed[len(sealed) // 2] ^= 1
    volume_store.put(first, bytes(sealed))
    unlocked = unlock(read_header(volume_store), Passphrase(PASSPHRASE))
    with pytest.raises(IntegrityError) as info:
        load_unlocked(volume_store, unlocked)
    assert f"log segment {first} is damaged" in str(info.value)
    assert "restore the store from a complete copy" in str(info.value)
    assert "generation 0" not in str(info.value)


def test_a_log_chained_by_sealed_bytes_is_refused_as_an_older_format(
    volume_store: ObjectStore,
) -> None:
    # Builds before key epochs chained each segment to the SHA-256 of the previous
    # segment's sealed bytes, not of its payload. Their volumes carry the same format
    # version, so the chain is the only tell: such a log is no tampering, and moving its
    # segments out of the store (the fix for a broken chain) would throw its files away.
    unlocked = unlock(read_header(volume_store), Passphrase(PASSPHRASE))
    loaded = load_unlocked(volume_store, unlocked)
    for gen in (2, 3):
        prev = hashlib.sha256(volume_store.get(segment_name(gen - 1))).digest()
        with loaded.keys.sealing() as keys:
            sealed, _ = encode_segment(keys, loaded.volume_id, Segment(gen, prev, 1, []))
        volume_store.put_if_absent(segment_name(gen), sealed)
    with pytest.raises(UnsupportedVersionError) as info:
        load_unlocked(volume_store, unlocked)
    message = str(info.value)
    assert "l/0000000000000002" in message and "older sealfs build" in message
    assert "tampered" not in message and "out of the store" not in message


class VanishingSnapshotStore(MemoryStore):
    """Lists a newer snapshot that is gone when read, as a writer may delete one between a
    reader's list and its get; for `times` listings (None: always)."""

    GONE = snapshot_name(10**9)

    def __init__(self, inner: MemoryStore, times: int | None) -> None:
        super().__init__()
        self._objects = inner._objects
        self.times = times

    def list(self, prefix: str, start_after: str = "") -> list[str]:
        names = super().list(prefix, start_after)
        if prefix == SNAPSHOT_PREFIX and self.times != 0:
            self.times = None if self.times is None else self.times - 1
            names.append(self.GONE)
        return names


@pytest.mark.parametrize("times", [1, 2])
async def test_a_snapshot_deleted_after_it_was_listed_is_listed_again(
    memory_store: MemoryStore, kdf_params: Argon2Params, times: int
) -> None:
    create_volume(memory_store, PASSPHRASE, kdf_params, RECOVERY_KEY)
    async with mounted(memory_store) as volume:
        fh, _ = await volume.create(ROOT_INO, b"f", 0o644, os.O_WRONLY, 0, 0)
        await volume.release(fh)
        await volume.fsync()
        await volume.commits.snapshot()
    unlocked = unlock(read_header(memory_store), Passphrase(PASSPHRASE))
    loaded = load_unlocked(VanishingSnapshotStore(memory_store, times), unlocked)
    assert b"f" in loaded.live.inodes[ROOT_INO].entries  # type: ignore[operator]


def test_a_snapshot_listed_but_never_readable_is_an_error(
    memory_store: MemoryStore, kdf_params: Argon2Params
) -> None:
    """Listing again is for a snapshot a writer deleted; one that stays unreadable fails."""
    create_volume(memory_store, PASSPHRASE, kdf_params, RECOVERY_KEY)
    unlocked = unlock(read_header(memory_store), Passphrase(PASSPHRASE))
    with pytest.raises(ObjectNotFoundError):
        load_unlocked(VanishingSnapshotStore(memory_store, None), unlocked)


def test_a_volume_whose_creation_was_cut_short_has_no_header(kdf_params: Argon2Params) -> None:
    """init writes the header last: a store without the root's segment must not pass for
    a volume (a header alone unlocks to a volume with no root directory, and init then
    refuses the store as a volume already)."""
    store = FaultyStore(MemoryStore())
    store.fail_next("put_if_absent", SEGMENT_PREFIX, "unavailable")
    with pytest.raises(StoreUnavailableError):
        create_volume(store, PASSPHRASE, kdf_params, RECOVERY_KEY)
    assert store.inner.list("") == []


def test_an_init_killed_before_its_header_is_named_with_the_way_out(
    kdf_params: Argon2Params,
) -> None:
    """A kill between the root's segment and the header leaves the segment alone: the
    next init is refused (it cannot tell a dead init from a running one), saying which
    object to delete, not just "not empty"."""
    store = MemoryStore()
    store.put(segment_name(1), b"sealed root segment")
    with pytest.raises(VolumeExistsError, match=rf"holds only {segment_name(1)}, left by"):
        create_volume(store, PASSPHRASE, kdf_params, RECOVERY_KEY)
    store.delete(segment_name(1))
    create_volume(store, PASSPHRASE, kdf_params, RECOVERY_KEY)


def test_a_store_holding_something_else_is_refused_naming_an_object_and_the_s3_fix(
    kdf_params: Argon2Params,
) -> None:
    """For an S3 store the way out is another prefix, yet the message said only "use an
    empty directory", and named nothing it held: an object left behind (init's probe,
    when DeleteObject was denied) had to be found by listing the bucket."""
    store = MemoryStore()
    store.put("probe/0123456789abcdef", b"left behind")
    store.put("zz/other", b"x")
    with pytest.raises(VolumeExistsError, match=r"2 objects.*probe/0123456789abcdef.*S3 prefix"):
        create_volume(store, PASSPHRASE, kdf_params, RECOVERY_KEY)


def test_an_init_cut_short_while_it_probed_the_store_is_named_with_the_way_out(
    kdf_params: Argon2Params,
) -> None:
    """Regression: Ctrl-C (or a kill, or a lost connection) between the probe object's
    create and its delete left the S3 prefix "not empty" for good, naming no way out."""
    store = MemoryStore()
    store.put("probe/a437203e8bd59052", b"left behind")
    with pytest.raises(VolumeExistsError) as refused:
        create_volume(store, PASSPHRASE, kdf_params, RECOVERY_KEY)
    said = str(refused.value)
    assert "holds only probe/a437203e8bd59052 under probe/, left by an init cut short" in said
    assert "delete probe/ there and run init again" in said
    store.put("probe/0123456789abcdef", b"another")
    with pytest.raises(VolumeExistsError, match=r"probe/0123456789abcdef and 1 more under"):
        create_volume(store, PASSPHRASE, kdf_params, RECOVERY_KEY)
    for name in store.list("probe/"):
        store.delete(name)
    create_volume(store, PASSPHRASE, kdf_params, RECOVERY_KEY)


@pytest.mark.parametrize(
    ("method", "fault"), [("put_if_absent", "nospace"), ("sync", "flush_failed")]
)
def test_an_init_that_failed_before_the_header_can_be_run_again(
    kdf_params: Argon2Params, method: str, fault: Fault
) -> None:
    """Regression: a disk that filled up between the root's segment and the header
    failed init with "store disk full ...: free space and retry", and the retry was
    refused: the segment left behind made the store "not empty and holds no sealfs
    volume"."""
    store = FaultyStore(MemoryStore())
    prefix = HEADER_NAME if method == "put_if_absent" else ""
    store.fail_next(method, prefix, fault)
    with pytest.raises(StoreError):
        create_volume(store, PASSPHRASE, kdf_params, RECOVERY_KEY)
    assert store.inner.list("") == []
    store.clear()
    if fault == "flush_failed":  # a local store refuses every later sync: a new process
        store = FaultyStore(store.inner)
    create_volume(store, PASSPHRASE, kdf_params, RECOVERY_KEY)
    assert ROOT_INO in open_volume(store, Passphrase(PASSPHRASE)).live.inodes


def test_an_init_whose_header_landed_unacknowledged_keeps_the_root_s_segment(
    kdf_params: Argon2Params,
) -> None:
    """The header's put took effect but its reply was lost: the volume exists, and
    taking its root's segment back would leave a header without a root directory."""
    store = FaultyStore(MemoryStore())
    store.fail_next("put_if_absent", HEADER_NAME, "transient_after")
    with pytest.raises(StoreError):
        create_volume(store, PASSPHRASE, kdf_params, RECOVERY_KEY)
    store.clear()
    assert ROOT_INO in open_volume(store, Passphrase(PASSPHRASE)).live.inodes


def test_a_writer_pid_reused_by_a_later_process_is_not_that_writer() -> None:
    """A writer that died lets its pid be reused: the process now holding it started after
    the writer claimed the volume, so it is not the writer (and cannot hold the mount)."""
    before = time.time_ns()
    proc = subprocess.Popen(["sleep", "60"])
    try:
        started = process_start_ns(proc.pid)
        assert started is not None and abs(started - before) < 5_000_000_000

        def writer(since_ns: int) -> WriterInfo:
            return WriterInfo(socket.gethostname(), proc.pid, bytes(16), since_ns, False)

        assert writer_alive(writer(before))  # claimed as that process started: it is it
        assert not writer_alive(writer(before - 3600 * 1_000_000_000))  # claimed long before
    finally:
        proc.kill()
        proc.wait()
    assert not writer_alive(writer(before))  # gone


def test_a_live_writer_is_alive_after_the_wall_clock_stepped_forward() -> None:
    """/proc's start time is read on today's wall clock, since_ns was taken on the clock
    of the claim: after NTP steps the clock forward (a mount at boot), the live daemon
    seems to have started after its claim. Taken for dead, a plain mount fenced it."""
    proc = subprocess.Popen(["sealfs-mount-daemon", "60"], executable="sleep")
    try:
        # Until it has exec'd, the child has the test runner's command line, which
        # need not name sealfs (it failed so, now and then, under load).
        deadline = time.monotonic() + 10
        while not Path(f"/proc/{proc.pid}/cmdline").read_bytes().startswith(b"sealfs-"):
            assert time.monotonic() < deadline
            time.sleep(0.005)
        stepped = time.time_ns() - 3600 * 1_000_000_000  # claimed on a clock 1 h behind
        info = WriterInfo(socket.gethostname(), proc.pid, bytes(16), stepped, False)
        assert writer_alive(info)
    finally:
        proc.kill()
        proc.wait()


def test_a_header_larger_than_any_header_is_refused_unread() -> None:
    """Junk appended to sealfs.vol was read into memory whole before the length check."""
    store = MemoryStore()
    store.put(HEADER_NAME, b"SEALFS\x00\x00" + bytes(MAX_HEADER_SIZE))
    with pytest.raises(FormatError, match=rf"{HEADER_NAME} .* more than the {MAX_HEADER_SIZE}"):
        read_header(store)


@pytest.mark.parametrize("body", [b"<html><body>It works!</body></html>", b"x" * 4096])
def test_a_header_that_is_no_sealfs_header_names_the_store_and_the_endpoint(body: bytes) -> None:
    """A web server given as the S3 endpoint answers every GET with a page: mount and
    status said "volume header is 34 bytes, too short" (exit 4), naming neither the
    store nor the URL or endpoint that is the likely mistake."""
    store = MemoryStore()
    store.put(HEADER_NAME, body)
    with pytest.raises(FormatError, match=r"memory store.*not a sealfs volume header.*endpoint"):
        open_volume(store, Passphrase(PASSPHRASE))


@pytest.mark.parametrize("prefix", [SEGMENT_PREFIX, SNAPSHOT_PREFIX])
async def test_a_log_object_larger_than_any_that_opens_is_refused_unread(
    tmp_path: Path, kdf_params: Argon2Params, prefix: str
) -> None:
    """Junk appended to a segment or a snapshot (a sparse file costs nothing) was read
    into the mount command's memory whole before authentication failed."""
    store = LocalStore(tmp_path / "store")
    create_volume(store, PASSPHRASE, kdf_params, RECOVERY_KEY)
    async with mounted(store) as volume:
        await volume.fsync()
        await volume.commits.snapshot()
    name = store.list(prefix)[-1]
    with open(tmp_path / "store" / name, "r+b") as f:
        f.truncate(MAX_SEALED_METADATA + 1)  # holes: nothing is written to disk
    unlocked = unlock(read_header(store), Passphrase(PASSPHRASE))
    with pytest.raises(FormatError, match=rf"{name} .* more than the {MAX_SEALED_METADATA}"):
        load_unlocked(store, unlocked)


class CommitsFirst(WrappedStore):
    """A store through which a mount claims the volume while its busy writer, live in
    this process, commits just before each of the claim's segment creates: the race
    that a takeover of a writer fsyncing every 0.6 s lost every time."""

    def __init__(self, inner: ObjectStore, writer: Volume, times: int) -> None:
        super().__init__(inner)
        self.writer = writer
        self.times = times
        self.claims = 0
        self.made: list[int] = []

    def put_if_absent(self, name: str, data: bytes) -> None:
        if name.startswith(SEGMENT_PREFIX):
            self.claims += 1
            if self.times:
                self.times -= 1
                trio.from_thread.run(self._commit)
        self.inner.put_if_absent(name, data)

    async def _commit(self) -> None:
        fh, attr = await self.writer.create(ROOT_INO, b"f%d" % len(self.made), 0o644, W, 0, 0)
        await self.writer.write(fh, 0, b"committed by the old writer")
        await self.writer.release(fh)
        await self.writer.fsync()
        self.made.append(attr.ino)


@pytest.fixture
def local_volume(tmp_path: Path, kdf_params: Argon2Params) -> LocalStore:
    """A local store holding a new volume."""
    store = LocalStore(tmp_path / "store")
    create_volume(store, PASSPHRASE, kdf_params, RECOVERY_KEY)
    return store


def taking_over(store: LocalStore, busy: Volume, times: int) -> tuple[CommitsFirst, Loaded]:
    """A mount about to take the volume over from busy, which commits first times times."""
    racing = CommitsFirst(store, busy, times=times)
    other = open_volume(racing, Passphrase(PASSPHRASE))  # type: ignore[arg-type]
    check_writer(other, takeover=True)
    return racing, other


async def test_a_takeover_catches_up_with_a_writer_that_commits_meanwhile(
    local_volume: LocalStore,
) -> None:
    store = local_volume
    async with mounted(store, commit_interval=3600.0) as busy:
        racing, other = taking_over(store, busy, times=3)
        mine = await trio.to_thread.run_sync(claim_writer, other)
        assert racing.claims == 4
        assert len(racing.made) == 3 and all(ino in other.live.inodes for ino in racing.made)
        assert other.live.writer == mine
    state = open_volume(store, Passphrase(PASSPHRASE)).live
    assert state.writer == mine
    assert state.generation == other.live.generation
    assert sorted(state.inodes) == sorted(other.live.inodes)


async def test_a_takeover_of_a_writer_that_always_commits_first_gives_up_naming_it(
    local_volume: LocalStore,
) -> None:
    store = local_volume
    async with mounted(store, commit_interval=3600.0) as busy:
        racing, other = taking_over(store, busy, times=1000)
        with pytest.raises(WriterConflictError) as info:
            await trio.to_thread.run_sync(claim_writer, other)
        assert racing.claims == CLAIM_ATTEMPTS
        message = str(info.value)
        assert "\n" not in message
        assert f"pid {os.getpid()}" in message and "committed" in message, message
        assert "unmount it" in message, message
        await busy.fsync()  # still the writer: not fenced
        assert busy.commits.stopped is None
    assert open_volume(store, Passphrase(PASSPHRASE)).live.writer.released  # type: ignore[union-attr]


async def test_a_claim_that_finds_another_new_writer_refuses_to_fence_it(
    volume_store: ObjectStore,
) -> None:
    """Two mounts claiming at once: the loser used to say only "try again"; caught up,
    it must not take the volume from the mount that won, live and just claimed."""
    first = open_volume(volume_store, Passphrase(PASSPHRASE))
    second = open_volume(volume_store, Passphrase(PASSPHRASE))
    won = claim_writer(first)
    with pytest.raises(WriterConflictError, match=f"pid {won.pid}"):
        claim_writer(second)
    assert open_volume(volume_store, Passphrase(PASSPHRASE)).live.writer == won


@pytest.mark.parametrize("snapshot", [False, True], ids=["segment", "snapshot"])
async def test_a_log_rekeyed_after_the_header_was_read_says_to_run_again(
    volume_store: ObjectStore, snapshot: bool
) -> None:
    """Another process rekeyed the volume between this one's read of the header and its
    load of the log: the log opened under a key epoch the header read did not name, and
    the error called it damaged and said to move it out of the store or restore it."""
    unlocked = unlock(read_header(volume_store), Passphrase(PASSPHRASE))  # epoch 0
    async with mounted(volume_store) as volume:
        await mkfile(volume, ROOT_INO, b"f", b"data")
        await volume.adopt_rekey(start_rekey(volume_store))
        await mkfile(volume, ROOT_INO, b"g", b"more")
        await volume.fsync()  # a segment of epoch 1
        if snapshot:
            await volume.commits.snapshot()
        assert volume.rekey is not None
        with trio.fail_after(60):
            await volume.rekey.ended.wait()
    with pytest.raises(SealfsError) as info:
        load_unlocked(volume_store, unlocked)
    message = str(info.value)
    assert "rekeyed" in message and "run the command again" in message, message
    for advice in ("move", "restore"):
        assert advice not in message.partition("run the command again")[0], message
    assert not isinstance(info.value, (IntegrityError, FormatError)), message  # not damage
    load_unlocked(volume_store, unlock(read_header(volume_store), Passphrase(PASSPHRASE)))


def test_a_segment_naming_an_epoch_the_header_does_not_is_still_damage(
    volume_store: ObjectStore,
) -> None:
    """An epoch no rekey made (the header, read again, does not name it): the store
    forged or damaged the object, and the way out is still named, after the retry."""
    sealed = bytearray(volume_store.get(segment_name(1)))
    sealed[6:8] = (7).to_bytes(2, "big")  # the envelope's key epoch
    volume_store.put_if_absent(segment_name(2), bytes(sealed))
    with pytest.raises(IntegrityError) as info:
        open_volume(volume_store, Passphrase(PASSPHRASE))
    message = str(info.value)
    assert "run the command again" in message and f"move {segment_name(2)}" in message, message


async def test_the_digest_of_a_generation_is_the_one_its_successor_chains_onto(
    memory_store: MemoryStore, kdf_params: Argon2Params
) -> None:
    """Whether the loaded log passes through the generation a host recorded: read off the
    state or its tail, or from the segment itself when a snapshot covers it."""
    create_volume(memory_store, PASSPHRASE, kdf_params, RECOVERY_KEY)
    async with mounted(memory_store) as volume:
        for name in (b"a", b"b"):
            fh, _ = await volume.create(ROOT_INO, name, 0o644, os.O_WRONLY, 0, 0)
            await volume.release(fh)
            await volume.fsync()
        covered = volume.commits.head
        await volume.commits.snapshot()
        fh, _ = await volume.create(ROOT_INO, b"c", 0o644, os.O_WRONLY, 0, 0)
        await volume.release(fh)
        await volume.fsync()
        tailed = volume.commits.head
    loaded = open_volume(memory_store, Passphrase(PASSPHRASE))
    newest = (loaded.live.generation, loaded.live.head_hash)
    assert loaded.base is not None and loaded.base[0] == covered[0] < tailed[0] < newest[0]
    for generation, digest in (covered, tailed, newest):
        assert segment_digest(loaded, generation) == digest
    memory_store.delete(segment_name(covered[0]))
    assert segment_digest(loaded, covered[0]) is None  # gone: not the one recorded
