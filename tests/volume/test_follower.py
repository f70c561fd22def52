"""A read-only mount following what a writer mounted beside it commits (memory store)."""

from __future__ import annotations

import errno
import logging
import math
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import trio
import trio.lowlevel

from sealfs.cli.status_cmd import _rows
from sealfs.crypto.envelope import ObjectKind, chunk_binding, seal_object
from sealfs.errors import IntegrityError, KeyUnavailableError
from sealfs.keys.header import HEADER_NAME
from sealfs.keys.kdf import Argon2Params
from sealfs.keys.slots import Passphrase, Unlocked, unlock
from sealfs.meta.codec import SEGMENT_PREFIX, segment_name
from sealfs.meta.model import ROOT_INO
from sealfs.store.base import ObjectInfo, ObjectStore
from sealfs.store.faults import FaultyStore
from sealfs.store.memory import MemoryStore
from sealfs.volume import follower
from sealfs.volume.chunks import chunk_name
from sealfs.volume.engine import Volume
from sealfs.volume.loader import create_volume
from sealfs.volume.status import volume_status
from tests.conftest import PASSPHRASE, RECOVERY_KEY, WrappedStore, mounted
from tests.volume.test_engine import (
    R,
    expect,
    forget_all,
    ino_of,
    load,
    meta_signature,
    mkdir,
    mkfile,
    names,
    read_all,
    write_at,
)
from tests.volume.test_rekey import start_rekey

# The loop is driven by catch_up() where a test needs to know when it ran.
IDLE = {"read_only": True, "commit_interval": 3600.0}


async def test_a_reader_sees_each_commit_of_the_writer(volume_store: ObjectStore) -> None:
    async with mounted(volume_store) as writer, mounted(volume_store, **IDLE) as reader:
        d = await mkdir(writer, ROOT_INO, b"d")
        await mkfile(writer, d, b"a", b"first version")
        await writer.fsync()
        assert await names(reader, ROOT_INO) == []  # listed before the reader caught up
        await reader.follower.catch_up()  # type: ignore[union-attr]
        assert await names(reader, ROOT_INO) == [b"d"]
        a = await ino_of(reader, "d/a")
        assert await read_all(reader, a) == b"first version"

        await write_at(writer, a, 0, b"second")
        await writer.rename(d, b"a", ROOT_INO, b"moved")
        await mkfile(writer, d, b"b", b"bee")
        await writer.setxattr(a, b"user.tag", b"v2")
        await writer.fsync()
        await reader.follower.catch_up()  # type: ignore[union-attr]
        assert await names(reader, ROOT_INO) == [b"d", b"moved"]
        assert await names(reader, d) == [b"b"]
        assert await read_all(reader, await ino_of(reader, "moved")) == b"secondversion"
        assert await reader.getxattr(a, b"user.tag") == b"v2"
        assert reader.meta.generation == writer.commits.generation
        assert reader.commits.generation == writer.commits.generation  # what status shows
        assert meta_signature(reader.meta) == meta_signature(load(volume_store))


async def test_a_reader_keeps_none_of_the_log_a_writer_would_snapshot(
    volume_store: ObjectStore,
) -> None:
    """The segments since the last snapshot are the writer's to compact: a read-only mount
    held them unused (11.5 MiB for 50,000 records, more than the state of 10,000 files)."""
    async with mounted(volume_store) as writer:
        for k in range(3):
            await mkfile(writer, ROOT_INO, b"f%d" % k, b"x")
            await writer.fsync()
        async with mounted(volume_store, **IDLE) as reader:
            assert len(reader.loaded.tail) == 0
            await mkfile(writer, ROOT_INO, b"later", b"y")
            await writer.fsync()
            await reader.follower.catch_up()  # type: ignore[union-attr]
            assert await names(reader, ROOT_INO) == [b"f0", b"f1", b"f2", b"later"]
            assert len(reader.loaded.tail) == 0
            assert reader.commits.generation == writer.commits.generation
        assert len(writer.loaded.tail) >= 4  # the writer's own, untouched


async def test_the_loop_follows_without_being_asked(volume_store: ObjectStore) -> None:
    async with (
        mounted(volume_store) as writer,
        mounted(volume_store, read_only=True, commit_interval=0.02) as reader,
    ):
        await mkfile(writer, ROOT_INO, b"f", b"hello")
        await writer.fsync()
        with trio.fail_after(10):
            while b"f" not in await names(reader, ROOT_INO):
                await trio.sleep(0.01)
        assert await read_all(reader, await ino_of(reader, "f")) == b"hello"


async def test_a_file_open_here_stays_readable_after_the_writer_deletes_it(
    volume_store: ObjectStore,
) -> None:
    async with mounted(volume_store) as writer, mounted(volume_store, **IDLE) as reader:
        f = await mkfile(writer, ROOT_INO, b"f", b"kept while open")
        await writer.fsync()
        await reader.follower.catch_up()  # type: ignore[union-attr]
        fh = await reader.open(await ino_of(reader, "f"), R)
        await writer.unlink(ROOT_INO, b"f")
        await forget_all(writer)  # its kernel let go: the writer deletes the inode
        await writer.fsync()
        await reader.follower.catch_up()  # type: ignore[union-attr]
        assert f not in reader.meta.inodes  # the writer's deletion was replayed
        await expect(errno.ENOENT, reader.lookup(ROOT_INO, b"f"))
        assert await reader.read(fh, 0, 100) == b"kept while open"
        assert (await reader.getattr(f)).size == len(b"kept while open")
        await reader.release(fh)
        # Still valid while the kernel holds its name (FUSE: until it forgets the inode).
        assert (await reader.getattr(f)).size == len(b"kept while open")
        await forget_all(reader)
        # Not ENOENT: a request for a forgotten inode is stale (the kernel looks again).
        await expect(errno.ESTALE, reader.getattr(f))


async def test_a_backlog_is_replayed_a_commit_at_a_time_with_requests_in_between(
    volume_store: ObjectStore,
) -> None:
    """A batch (up to 256 commits) was replayed in one go on the FUSE loop: 8 commits
    of 5,000 new files each held every request for 0.9 s."""
    async with mounted(volume_store) as writer, mounted(volume_store, **IDLE) as reader:
        assert reader.follower is not None
        before = reader.meta.generation
        for k in range(4):
            await mkfile(writer, ROOT_INO, b"f%d" % k, b"x")
            await writer.fsync()
        seen: set[int] = set()

        async def requests() -> None:
            while True:
                seen.add(reader.meta.generation)  # what a request served now would show
                await trio.lowlevel.checkpoint()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(requests)
            await reader.follower.catch_up()
            nursery.cancel_scope.cancel()
        assert reader.meta.generation == writer.commits.generation
        assert seen - {before, writer.commits.generation}, seen


async def test_a_directory_a_shell_is_in_lists_empty_after_the_writer_removes_it(
    volume_store: ObjectStore,
) -> None:
    """A shell's working directory: the kernel holds the inode (a lookup) but no handle.
    Once the writer removed it, `ls` there failed with ESTALE; on the writer's mount, and
    ext4, it lists empty."""
    async with mounted(volume_store) as writer, mounted(volume_store, **IDLE) as reader:
        await mkdir(writer, ROOT_INO, b"work")
        await writer.fsync()
        await reader.follower.catch_up()  # type: ignore[union-attr]
        cwd = await ino_of(reader, "work")  # the kernel's lookup, as a `cd` makes
        await writer.rmdir(ROOT_INO, b"work")
        await forget_all(writer)
        await writer.fsync()
        await reader.follower.catch_up()  # type: ignore[union-attr]
        fh = await reader.opendir(cwd)  # `ls` in it
        assert await reader.readdir(fh, 0) == []
        await reader.releasedir(fh)
        assert (await reader.getattr(cwd)).nlink == 0
        await forget_all(reader)  # the shell left: the kernel forgets it
        await expect(errno.ESTALE, reader.getattr(cwd))


async def test_a_file_open_here_that_the_writer_rewrote_then_deleted_reads_its_last_version(
    volume_store: ObjectStore,
) -> None:
    """Found by the follower's stateful test: a file open on the reader, that the writer
    overwrote past its flush threshold and deleted within one commit. The commit holds
    the new size but not the data the writer dropped with the file, and the reader,
    which kept the inode as the commit left it, read 300,000 zeros: bytes no version
    held. It reads as the last generation left it (here empty), with no links."""
    async with (
        mounted(volume_store) as writer,
        mounted(volume_store, **IDLE) as reader,
    ):
        a = await mkfile(writer, ROOT_INO, b"a", b"last version")
        await writer.fsync()
        await reader.follower.catch_up()  # type: ignore[union-attr]
        fh = await reader.open(await ino_of(reader, "a"), R)
        await write_at(writer, a, 0, bytes(range(256)) * 1200)  # past the flush threshold
        await writer.unlink(ROOT_INO, b"a")
        await forget_all(writer)
        await writer.fsync()
        await reader.follower.catch_up()  # type: ignore[union-attr]
        got = bytes(await reader.read(fh, 0, 4096))
        assert got == b"last version", f"{len(got)} bytes, {got.count(0)} of them zeros"
        assert (await reader.getattr(a)).nlink == 0
        await reader.release(fh)


async def test_a_directory_open_here_stays_open_after_the_writer_removes_it(
    volume_store: ObjectStore,
) -> None:
    """As on the writer's own mount (and ext4): fstat of the descriptor shows it with no
    links, and a listing is empty. The inode was dropped at once, so both said ENOENT."""
    async with mounted(volume_store) as writer, mounted(volume_store, **IDLE) as reader:
        a = await mkdir(writer, ROOT_INO, b"a")
        b = await mkdir(writer, a, b"b")
        await writer.fsync()
        await reader.follower.catch_up()  # type: ignore[union-attr]
        fh = await reader.opendir(b)
        await writer.rmdir(a, b"b")
        await writer.rmdir(ROOT_INO, b"a")
        await forget_all(writer)  # its kernel let go: the writer deletes both inodes
        await writer.fsync()
        await reader.follower.catch_up()  # type: ignore[union-attr]
        assert a not in reader.meta.inodes and b not in reader.meta.inodes
        assert (await reader.getattr(b)).nlink == 0
        assert await reader.readdir(fh, 0) == []
        await reader.releasedir(fh)
        await expect(errno.ESTALE, reader.getattr(b))  # the kernel looks it up again


async def test_a_backlog_longer_than_a_batch_is_taken_in_one_catch_up(
    volume_store: ObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(follower, "FOLLOW_BATCH", 2)
    async with mounted(volume_store) as writer, mounted(volume_store, **IDLE) as reader:
        for k in range(7):
            await mkfile(writer, ROOT_INO, b"f%d" % k, b"x")
            await writer.fsync()
        await reader.follower.catch_up()  # type: ignore[union-attr]
        assert reader.meta.generation == writer.commits.generation
        assert len(await names(reader, ROOT_INO)) == 7


async def test_an_unreachable_store_is_retried_at_the_next_look(
    volume_store: ObjectStore, caplog: pytest.LogCaptureFixture
) -> None:
    faulty = FaultyStore(volume_store)
    async with mounted(volume_store) as writer, mounted(faulty, **IDLE) as reader:  # type: ignore[arg-type]
        await mkfile(writer, ROOT_INO, b"f", b"x")
        await writer.fsync()
        faulty.fail_next("get", SEGMENT_PREFIX, "unavailable")
        await reader.follower.catch_up()  # type: ignore[union-attr]
        assert await names(reader, ROOT_INO) == []
        assert reader.follower.stopped is None  # type: ignore[union-attr]
        assert "reading the writer's new commits failed, will retry" in caplog.text
        await reader.follower.catch_up()  # type: ignore[union-attr]
        assert await names(reader, ROOT_INO) == [b"f"]


class WatchedLog(WrappedStore):
    """Wraps a store and counts its listings of the log; once stall is set, every look
    at the log hangs until released (an S3 endpoint that stopped answering: each
    request waits for --store-timeout)."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.lists = 0
        self.stats = 0
        self.stall = False
        self.looking = threading.Event()
        self.released = threading.Event()

    def _look(self) -> None:
        if self.stall:
            self.looking.set()
            self.released.wait(10)

    def stat(self, name: str) -> ObjectInfo:
        if name.startswith(SEGMENT_PREFIX):
            self.stats += 1
            self._look()
        return self.inner.stat(name)  # type: ignore[no-any-return]

    def list(self, prefix: str, start_after: str = "") -> list[str]:
        if prefix == SEGMENT_PREFIX:
            self.lists += 1
            self._look()
        return self.inner.list(prefix, start_after)  # type: ignore[no-any-return]


async def test_a_look_that_finds_nothing_new_does_not_list_the_log(
    volume_store: ObjectStore,
) -> None:
    """Segments are never deleted, and a local store's listing walks all of l/: with
    400,000 segments each look took 0.65 s of a core, every interval, with nothing new."""
    store = WatchedLog(volume_store)
    async with mounted(volume_store) as writer, mounted(store, **IDLE) as reader:  # type: ignore[arg-type]
        assert reader.follower is not None
        store.lists = 0
        for _ in range(3):
            await reader.follower.catch_up()
        assert store.lists == 0
        await mkfile(writer, ROOT_INO, b"f", b"x")
        await writer.fsync()
        await reader.follower.catch_up()
        assert await names(reader, ROOT_INO) == [b"f"]


async def test_a_look_that_finds_a_few_new_commits_does_not_list_the_log(
    volume_store: ObjectStore,
) -> None:
    """Regression: a look that found the next segment listed l/ to find the rest, and a
    local store's listing reads the whole of l/, which is never pruned. Beside a writer
    that commits every second, each look so cost a core for longer as the log grew:
    25 ms per look at 25,000 segments (a 25-minute agent soak), 0.8 s at 300,000."""
    store = WatchedLog(volume_store)
    async with mounted(volume_store) as writer, mounted(store, **IDLE) as reader:  # type: ignore[arg-type]
        assert reader.follower is not None
        store.lists = 0
        for k in range(3):
            await mkfile(writer, ROOT_INO, b"f%d" % k, b"x")
            await writer.fsync()
            await reader.follower.catch_up()
        await mkfile(writer, ROOT_INO, b"g", b"y")
        await writer.fsync()
        await mkfile(writer, ROOT_INO, b"h", b"z")
        await writer.fsync()
        await reader.follower.catch_up()
        assert await names(reader, ROOT_INO) == [b"f0", b"f1", b"f2", b"g", b"h"]
        assert reader.meta.generation == writer.commits.generation
        assert store.lists == 0


async def test_a_segment_the_store_hides_while_it_keeps_later_ones_stops_the_follower(
    volume_store: ObjectStore, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A look finds new segments by stats from the next generation on, so a store that
    lost or hid that one segment but kept the writer's later ones showed it nothing, for
    good, and the mount stayed behind without a word, where the listing it replaced
    named the gap. Every GAP_PROBE_LOOKS looks that find nothing, one also stats a few
    generations further on."""
    monkeypatch.setattr(follower, "GAP_PROBE_LOOKS", 3)
    async with mounted(volume_store) as writer, mounted(volume_store, **IDLE) as reader:
        await mkfile(writer, ROOT_INO, b"seen", b"x")
        await writer.fsync()
        assert reader.follower is not None
        await reader.follower.catch_up()
        seen = reader.meta.generation
        for k in range(3):
            await mkfile(writer, ROOT_INO, b"after%d" % k, b"y")
            await writer.fsync()
        volume_store.delete(segment_name(seen + 1))
        await reader.follower.catch_up()  # a look finds nothing, as it would anyway
        assert reader.follower.stopped is None
        for _ in range(follower.GAP_PROBE_LOOKS):
            await reader.follower.catch_up()
        await _stays_at(reader, seen, f"log generation {seen + 1} is missing", caplog)


@pytest.mark.parametrize("commits", [16, 40])
async def test_a_look_that_finds_many_new_commits_does_not_list_the_log_either(
    volume_store: ObjectStore, monkeypatch: pytest.MonkeyPatch, commits: int
) -> None:
    """A writer that fsyncs often commits many times an interval (24 times a second in
    an agent soak), and a follower behind has a backlog: a look finds where the new
    segments end by stats that double the distance, then halve it, a few per doubling
    of the backlog (a stat per segment would cost a round trip each on S3)."""
    monkeypatch.setattr(follower, "FOLLOW_BATCH", 32)
    store = WatchedLog(volume_store)
    async with mounted(volume_store) as writer, mounted(store, **IDLE) as reader:  # type: ignore[arg-type]
        assert reader.follower is not None
        store.lists = store.stats = 0
        for k in range(commits):
            await mkfile(writer, ROOT_INO, b"f%d" % k, b"x")
            await writer.fsync()
        await reader.follower.catch_up()
        assert reader.meta.generation == writer.commits.generation
        assert len(await names(reader, ROOT_INO)) == commits
        assert store.lists == 0
        assert store.stats <= 2 * 2 * math.log2(commits) + 2  # two looks, then one more stat


async def test_an_unmount_does_not_wait_for_a_look_at_a_stalled_store(
    volume_store: ObjectStore,
) -> None:
    """A read-only mount has nothing to commit, yet its unmount waited for the look in
    flight: up to --store-timeout (300 s), and `sealfs umount` gave up after 60 s, saying
    the daemon was still committing."""
    store = WatchedLog(volume_store)
    try:
        async with mounted(store, read_only=True, commit_interval=0.01):  # type: ignore[arg-type]
            store.stall = True
            assert await trio.to_thread.run_sync(store.looking.wait, 5)
            began = time.monotonic()
        assert time.monotonic() - began < 2
    finally:
        store.released.set()


async def test_a_damaged_segment_stops_following_at_the_generation_before(
    volume_store: ObjectStore, caplog: pytest.LogCaptureFixture
) -> None:
    async with mounted(volume_store) as writer, mounted(volume_store, **IDLE) as reader:
        await mkfile(writer, ROOT_INO, b"good", b"x")
        await writer.fsync()
        good = writer.commits.generation
        await mkfile(writer, ROOT_INO, b"bad", b"y")
        await writer.fsync()
        name = segment_name(writer.commits.generation)
        sealed = bytearray(volume_store.get(name))
        sealed[-1] ^= 1
        volume_store.put(name, bytes(sealed))
        await reader.follower.catch_up()  # type: ignore[union-attr]
        await _stays_at(reader, good, f"log segment {name} is damaged", caplog)
        assert await names(reader, ROOT_INO) == [b"good"]


def unlock_again(data: bytes) -> Unlocked:
    """What the daemon of a mount unlocked from a passphrase file does at a rekey."""
    return unlock(data, Passphrase(PASSPHRASE))


@pytest.mark.parametrize("rekeys", [1, 2])
async def test_a_reader_follows_through_rekeys_unlocking_the_new_header_itself(
    volume_store: ObjectStore, rekeys: int
) -> None:
    """Without the new key it stopped at the rekey's first commit, and was to be
    remounted. One that missed whole rekeys (it looked rarely) takes the newest key."""
    async with (
        mounted(volume_store) as writer,
        mounted(volume_store, unlock_again, **IDLE) as reader,
    ):
        before, f = await _rekeyed_to_the_end(writer, reader, volume_store)
        for _ in range(rekeys - 1):
            await _rekey_to_the_end(writer, volume_store)
        await _followed_file(writer, reader, b"after", b"sealed under the new key")
        assert reader.follower.stopped is None  # type: ignore[union-attr]
        assert reader.meta.generation == writer.commits.generation > before
        assert reader.loaded.keys.epoch == writer.loaded.keys.epoch == rekeys
        assert reader.loaded.keys.retired_epoch is None
        assert await read_all(reader, await ino_of(reader, "after")) == b"sealed under the new key"
        assert await read_all(reader, f) == b"sealed under the old key"  # re-sealed meanwhile


async def test_a_reader_follows_a_rekey_that_is_still_re_sealing(
    volume_store: ObjectStore,
) -> None:
    """While the writer re-seals, objects of both epochs are in the store: the reader
    holds both keys, as the header does."""
    async with (
        mounted(volume_store) as writer,
        mounted(volume_store, unlock_again, **IDLE) as reader,
    ):
        await _followed_file(writer, reader, b"old", b"sealed under the old key")
        await _switch_without_re_sealing(writer, volume_store)
        await _followed_file(writer, reader, b"new", b"sealed under the new key")
        assert reader.loaded.keys.retired_epoch == 0 and reader.loaded.keys.epoch == 1
        assert await read_all(reader, await ino_of(reader, "old")) == b"sealed under the old key"
        assert await read_all(reader, await ino_of(reader, "new")) == b"sealed under the new key"


async def test_a_read_that_meets_an_idle_writers_rekey_takes_the_new_key(
    volume_store: ObjectStore,
) -> None:
    """No commit came after the rekey, so no look met it: the read that fails takes the
    key and is answered (it failed with EIO, and the mount stopped following)."""
    async with (
        mounted(volume_store) as writer,
        mounted(volume_store, unlock_again, **IDLE) as reader,
    ):
        before, f = await _rekeyed_to_the_end(writer, reader, volume_store)
        assert writer.commits.generation == before  # nothing new to look at
        assert await read_all(reader, f) == b"sealed under the old key"
        assert reader.loaded.keys.epoch == 1
        assert reader.follower.stopped is None  # type: ignore[union-attr]


async def test_a_header_of_another_volume_stops_the_reader_before_any_unlock(
    volume_store: ObjectStore, kdf_params: Argon2Params, caplog: pytest.LogCaptureFixture
) -> None:
    """Found after the unlock, it cost an Argon2id run (or a KMS call) first."""
    unlocks: list[bytes] = []

    def counting(data: bytes) -> Unlocked:
        unlocks.append(data)
        return unlock_again(data)

    async with mounted(volume_store, counting, **IDLE) as reader:
        other = MemoryStore()
        create_volume(other, PASSPHRASE, kdf_params, RECOVERY_KEY)
        start_rekey(other)  # a newer epoch than the reader's, under another volume id
        volume_store.put(HEADER_NAME, other.get(HEADER_NAME))
        assert not await reader.follower.notice_rekey(0)  # type: ignore[union-attr]
        await _stays_at(reader, reader.meta.generation, "belongs to another volume", caplog)
        assert unlocks == []


async def test_a_reader_that_cannot_unlock_the_new_header_stops_and_says_why(
    volume_store: ObjectStore, caplog: pytest.LogCaptureFixture
) -> None:
    """Its passphrase changed, or its slot was dropped by the rekey: it stays where it is."""

    def wrong_passphrase(data: bytes) -> Unlocked:
        return unlock(data, Passphrase(b"not the passphrase any more"))

    async with (
        mounted(volume_store) as writer,
        mounted(volume_store, wrong_passphrase, **IDLE) as reader,
    ):
        before = writer.commits.generation
        await writer.adopt_rekey(start_rekey(volume_store))
        await _followed_file(writer, reader, b"after", b"sealed under the new key")
        await _stays_at(reader, before, "could not unlock its new key: wrong passphrase", caplog)


async def test_a_rekey_stops_a_reader_unlocked_on_a_terminal_and_says_to_remount(
    volume_store: ObjectStore, caplog: pytest.LogCaptureFixture
) -> None:
    async with mounted(volume_store) as writer, mounted(volume_store, **IDLE) as reader:
        before = writer.commits.generation
        await writer.adopt_rekey(start_rekey(volume_store))
        await _followed_file(writer, reader, b"after", b"sealed under the new key")
        # A token's PIN typed at the mount cannot be read again either: the status said
        # "a passphrase" to whoever had typed no passphrase at all.
        await _stays_at(reader, before, "a passphrase or PKCS#11 PIN typed on a terminal", caplog)


async def test_after_a_rekey_data_a_reader_unlocked_on_a_terminal_had_not_read_fails(
    volume_store: ObjectStore, caplog: pytest.LogCaptureFixture
) -> None:
    """The rekey re-seals the files' chunks in place, under a key this mount lacks: it
    stays at its generation, but what it had not read (cached) can no longer be read.
    With no commit after the rekey, the read that fails is what meets it."""
    async with mounted(volume_store) as writer, mounted(volume_store, **IDLE) as reader:
        before, f = await _rekeyed_to_the_end(writer, reader, volume_store)
        with pytest.raises(IntegrityError, match="must be mounted again"):
            await read_all(reader, f)
        await _stays_at(reader, before, "typed on a terminal", caplog)
    async with mounted(volume_store, **IDLE) as remounted:
        assert await read_all(remounted, f) == b"sealed under the old key"


async def _followed_file(writer: Volume, reader: Volume, name: bytes, data: bytes) -> None:
    """The writer commits a new file in the root, and the reader follows that commit."""
    await mkfile(writer, ROOT_INO, name, data)
    await writer.fsync()
    await reader.follower.catch_up()  # type: ignore[union-attr]


async def _switch_without_re_sealing(writer: Volume, store: ObjectStore) -> Callable[[], None]:
    """The writer takes the new key and seals under it, but re-seals nothing yet: objects
    of both epochs stay in the store. Returns what starts its re-sealing."""
    start = writer._start_rekey
    writer._start_rekey = lambda: None  # type: ignore[method-assign]
    await writer.adopt_rekey(start_rekey(store))
    return start


async def _rekeyed_to_the_end(
    writer: Volume, reader: Volume, store: ObjectStore
) -> tuple[int, int]:
    """The writer commits file f, the reader follows, then the writer rekeys the volume to
    the end (every chunk re-sealed): (the generation the reader holds, f's inode)."""
    await mkfile(writer, ROOT_INO, b"f", b"sealed under the old key")
    await writer.fsync()
    before = writer.commits.generation
    await reader.follower.catch_up()  # type: ignore[union-attr]
    f = await ino_of(reader, "f")
    await _rekey_to_the_end(writer, store)
    return before, f


async def _rekey_to_the_end(writer: Volume, store: ObjectStore) -> None:
    await writer.adopt_rekey(start_rekey(store))
    assert writer.rekey is not None
    with trio.fail_after(60):
        await writer.rekey.ended.wait()
    assert writer.rekey.progress.finished, writer.rekey.progress.error


async def _stays_at(
    reader: Volume, generation: int, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The reader stopped following at generation, said why in its log and its status."""
    assert reader.follower is not None
    assert reader.meta.generation == generation
    stopped = reader.follower.stopped
    assert stopped is not None and stopped.startswith(f"stays at generation {generation}: ")
    assert why in stopped
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any(why in e and "remount it to see later changes" in e for e in errors), errors
    status = volume_status(reader) | {"log_file": "/var/log/sealfs.log"}
    assert status["follow_stopped"] == stopped
    assert dict(_rows(status))["not following"] == f"{stopped}; remount to see later changes"
    await reader.follower.catch_up()  # stopped: it looks no more
    assert reader.meta.generation == generation


async def test_a_reader_drops_the_retired_key_once_the_writer_has_re_sealed_everything(
    volume_store: ObjectStore,
) -> None:
    """A reader that took the key while the writer re-sealed (as `sealfs rekey` has it do
    at once) held the old one for good: whoever had the key the rekey was to revoke
    could then put chunks sealed under it in the store, and the reader served their
    bytes, where the writer refuses them. Its status said the rekey was unfinished."""
    async with (
        mounted(volume_store) as writer,
        mounted(volume_store, unlock_again, **IDLE) as reader,
    ):
        await _followed_file(writer, reader, b"f", b"the writer's bytes")
        f = await ino_of(reader, "f")
        (cid,) = reader.meta.chunks
        old_keys = reader.loaded.keys.current
        start = await _switch_without_re_sealing(writer, volume_store)
        await reader.take_new_key()
        assert reader.loaded.keys.retired_epoch == 0
        start()
        assert writer.rekey is not None
        with trio.fail_after(60):
            await writer.rekey.ended.wait()
        assert writer.rekey.progress.finished, writer.rekey.progress.error
        await reader.follower.catch_up()  # type: ignore[union-attr]  # an idle writer's look

        assert reader.loaded.keys.retired_epoch is None
        assert "rekey" not in dict(_rows(volume_status(reader) | {"log_file": None}))
        forged = seal_object(
            old_keys.chunk_key, ObjectKind.CHUNK, chunk_binding(reader.loaded.volume_id, cid),
            b"forged with the old key", epoch=0,
        )  # fmt: skip
        volume_store.put(chunk_name(cid), forged)
        with pytest.raises(IntegrityError):
            await read_all(reader, f)
        assert reader.follower.stopped is None  # type: ignore[union-attr]


async def test_a_read_that_failed_under_the_old_key_is_retried_when_another_took_the_new(
    volume_store: ObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reads fail together at a rekey. One whose chunk failed under the old key while
    another request was taking the new key (its unlock in a worker thread, then the
    switch on the loop) found the new key already held, and failed with EIO."""
    async with (
        mounted(volume_store) as writer,
        mounted(volume_store, unlock_again, **IDLE) as reader,
    ):
        _, f = await _rekeyed_to_the_end(writer, reader, volume_store)
        failed_under_old_key = reader.files.read

        async def meanwhile_another_takes_the_key(inode: int, offset: int, size: int) -> bytes:
            try:
                return await failed_under_old_key(inode, offset, size)
            except IntegrityError:
                monkeypatch.undo()
                await reader.take_new_key()  # another request, before this one resumes
                raise

        monkeypatch.setattr(reader.files, "read", meanwhile_another_takes_the_key)
        assert await read_all(reader, f) == b"sealed under the old key"
        assert reader.loaded.keys.epoch == 1


async def test_a_key_service_out_of_reach_at_the_rekey_is_tried_again_later(
    volume_store: ObjectStore, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KMS unreachable for a moment (or a token unplugged) stopped the mount for good, to be
    remounted, where an unreachable store only postpones the next look."""
    tries: list[bool] = []
    reachable = False
    now = [1000.0]
    monkeypatch.setattr(follower, "time", SimpleNamespace(monotonic=lambda: now[0]))

    def via_kms(data: bytes) -> Unlocked:
        tries.append(reachable)
        if not reachable:
            raise KeyUnavailableError("aws-kms keyslot 2: cannot reach AWS KMS")
        return unlock_again(data)

    async with (
        mounted(volume_store) as writer,
        mounted(volume_store, via_kms, **IDLE) as reader,
    ):
        assert reader.follower is not None
        before, f = await _rekeyed_to_the_end(writer, reader, volume_store)
        for _ in range(2):  # the second soon after: KMS is not asked at every read
            with pytest.raises(IntegrityError):
                await read_all(reader, f)
        assert tries == [False]
        assert reader.follower.stopped is None
        assert "cannot reach AWS KMS" in caplog.text
        status = volume_status(reader) | {"log_file": None}  # says why, not only the log
        (waiting,) = status["follow_failing"]
        assert waiting["what"] == "unlocking the rekey's new header"
        assert "cannot reach AWS KMS" in waiting["error"] and waiting["attempts"] == 1
        row = dict(_rows(status))["following"]
        assert row.startswith("unlocking the rekey's new header failing since ")
        assert row.endswith("(1 attempt; retried): aws-kms keyslot 2: cannot reach AWS KMS")
        reachable = True
        now[0] += follower.KEY_RETRY_SECONDS
        await reader.take_new_key()  # what a read, a look or `sealfs rekey` asks, later
        assert tries == [False, True]
        assert volume_status(reader)["follow_failing"] == []
        assert reader.loaded.keys.epoch == 1
        assert await read_all(reader, f) == b"sealed under the old key"
        assert reader.meta.generation == before and reader.follower.stopped is None
