"""LocalStore behaviour beyond the conformance suite: atomicity, full disks, sync, temp files."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import os
import shutil
import subprocess
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sealfs.errors import (
    FormatError,
    NoSpaceError,
    ObjectExistsError,
    PreconditionFailedError,
    StoreError,
    SyncFailedError,
)
from sealfs.store import local
from sealfs.store.local import LOCK_NAME, TEMP_PREFIX, LocalStore
from tests.conftest import CrashableDisk
from tests.mounts import VolumeEnv
from tests.prereq import require
from tests.store.conftest import assert_owner_only_under, mounted_tmpfs


def _temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.startswith(TEMP_PREFIX)]


def test_object_is_a_file_at_its_name(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put("c/ab/xyz", b"sealed")
    assert (tmp_path / "c" / "ab" / "xyz").read_bytes() == b"sealed"
    assert _temp_files(tmp_path) == []


def test_readers_never_see_a_partial_object(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    versions = [bytes([i]) * (1 << 20) for i in range(1, 4)]
    store.put("c/ab/x", versions[0])
    stop = threading.Event()
    seen: list[str] = []

    def write() -> None:
        for i in range(30):
            store.put("c/ab/x", versions[i % 3])
            store.put_if_absent(f"c/ab/n{i}", versions[i % 3])
        stop.set()

    writer = threading.Thread(target=write)
    writer.start()
    while not stop.is_set():
        if store.get("c/ab/x") not in versions:
            seen.append("partial object")
        seen.extend(n for n in store.list("c/") if not n.startswith("c/ab/"))
        names = store.list("c/ab/")
        seen.extend(n for n in names if TEMP_PREFIX in n)
        seen.extend(n for n in names if n != "c/ab/x" and store.get(n) not in versions)
    writer.join()
    assert seen == []
    assert _temp_files(tmp_path) == []


def test_leftover_temp_files_are_ignored_and_cleaned(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put("c/ab/x", b"x")
    old = tmp_path / "c" / "ab" / f"{TEMP_PREFIX}crashed"
    young = tmp_path / "l" / f"{TEMP_PREFIX}in-flight"
    young.parent.mkdir()
    old.write_bytes(b"half")
    young.write_bytes(b"half")
    two_hours_ago = time.time() - 7200
    os.utime(old, (two_hours_ago, two_hours_ago))
    assert store.list("") == ["c/ab/x"]
    assert store.list("l/") == []
    assert store.remove_crash_leftovers(3600) == 1
    assert not old.exists()
    assert young.exists()
    assert store.get("c/ab/x") == b"x"


def test_a_leftover_dated_in_the_future_is_removed_too(tmp_path: Path) -> None:
    """Regression: only temp files dated more than an hour in the past were removed. One
    a crash left while the clock ran ahead (a VM booted with a wrong clock, then set back
    by NTP) is dated in the future, and stayed until the clock caught up: for ever, after
    a clock years ahead. No live writer's temp file is dated an hour ahead either."""
    store = LocalStore(tmp_path)
    store.put("c/ab/x", b"x")
    now = time.time()
    ahead = {
        tmp_path / "c" / "ab" / f"{TEMP_PREFIX}written-a-day-ahead": now + 86400,
        tmp_path / "c" / "ab" / f"{TEMP_PREFIX}written-years-ahead": now + 10 * 365 * 86400,
    }
    near = {
        tmp_path / "c" / "ab" / f"{TEMP_PREFIX}in-flight-minutes-ahead": now + 600,
        tmp_path / "c" / "ab" / f"{TEMP_PREFIX}in-flight-minutes-ago": now - 600,
    }
    for path, stamp in {**ahead, **near}.items():
        path.write_bytes(b"half")
        os.utime(path, (stamp, stamp))
    assert store.remove_crash_leftovers(3600) == 2
    assert not any(path.exists() for path in ahead)
    assert all(path.exists() for path in near)
    assert store.get("c/ab/x") == b"x"


def test_crash_leftovers_are_looked_for_only_where_objects_are_written(tmp_path: Path) -> None:
    """Regression: the sweep walked every directory under the root, into other file
    systems too, and removed any old ".tmp-*" file there: a user's file in a plaintext
    view mounted under the store, or in a folder of their own kept in it."""
    store = LocalStore(tmp_path)
    store.put("c/ab/x", b"x")
    with mounted_tmpfs(tmp_path / "view", "1m"):  # another file system, object-like name
        crashed = tmp_path / "c" / "ab" / f"{TEMP_PREFIX}crashed"
        foreign = [
            tmp_path / "My Files" / f"{TEMP_PREFIX}notes",
            tmp_path / "view" / f"{TEMP_PREFIX}a",
        ]
        two_hours_ago = time.time() - 7200
        for path in [crashed, *foreign]:
            path.parent.mkdir(exist_ok=True)
            path.write_bytes(b"bytes")
            os.utime(path, (two_hours_ago, two_hours_ago))
        assert store.remove_crash_leftovers(3600) == 1
        assert not crashed.exists()
        assert all(path.exists() for path in foreign)


def test_lock_file_is_not_an_object(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put("sealfs.vol", b"v1")
    store.put_if_match("sealfs.vol", b"v2", store.stat("sealfs.vol").etag)
    assert (tmp_path / LOCK_NAME).exists()
    assert store.list("") == ["sealfs.vol"]


def test_put_if_match_waits_for_the_lock_held_by_another_process(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put("sealfs.vol", b"v1")
    etag = store.stat("sealfs.vol").etag
    # A separate open file description conflicts exactly as another process would.
    fd = os.open(tmp_path / LOCK_NAME, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    done = threading.Event()

    def replace() -> None:
        store.put_if_match("sealfs.vol", b"v2", etag)
        done.set()

    worker = threading.Thread(target=replace)
    try:
        worker.start()
        assert not done.wait(0.2)
        assert store.get("sealfs.vol") == b"v1"
    finally:
        os.close(fd)
    worker.join(5)
    assert done.is_set()
    assert store.get("sealfs.vol") == b"v2"


def test_put_if_match_race_across_processes_has_one_winner(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    for round_ in range(3):
        store.put("sealfs.vol", f"base {round_}".encode())
        etag = store.stat("sealfs.vol").etag
        children = []
        for who in range(2):
            pid = os.fork()
            if pid == 0:  # child: exit status 0 = won, 1 = lost, 2 = other error
                code = 2
                try:
                    LocalStore(tmp_path).put_if_match("sealfs.vol", f"w{who}".encode(), etag)
                    code = 0
                except PreconditionFailedError:
                    code = 1
                finally:
                    os._exit(code)
            children.append(pid)
        codes = sorted(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children)
        assert codes == [0, 1]


def test_existing_object_reports_exists_not_error(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put_if_absent("l/00000001", b"a")
    with pytest.raises(ObjectExistsError, match="l/00000001"):
        store.put_if_absent("l/00000001", b"b")
    assert _temp_files(tmp_path) == []


def test_os_errors_become_one_line_store_errors(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put("c/ab/x", b"x")
    with pytest.raises(StoreError) as info:
        store.put("c/ab/x/y", b"y")  # a file where a directory would have to be
    assert "\n" not in str(info.value)
    assert "c/ab/x/y" in str(info.value)
    assert type(info.value) is StoreError


def test_full_disk_raises_no_space_and_leaves_no_temp(tiny_tmpfs: Path) -> None:
    store = LocalStore(tiny_tmpfs)
    store.put("c/ab/small", b"s" * 1000)
    big = b"B" * (2 << 20)
    with pytest.raises(NoSpaceError) as info:
        store.put("c/ab/big", big)
    assert str(info.value).startswith(f"store disk full at {tiny_tmpfs}: free space on the disk")
    assert "(deleting files in the volume frees none)" in str(info.value)
    with pytest.raises(NoSpaceError):
        store.put_if_absent("l/00000001", big)
    assert _temp_files(tiny_tmpfs) == []
    assert store.list("") == ["c/ab/small"]
    store.put("c/ab/after", b"fits")  # the failed writes freed their space
    assert store.get("c/ab/after") == b"fits"


class Flushes:
    """Watches the real flush calls of the local store (each is still made) by path."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.lock = threading.Lock()
        self.files: list[str] = []
        self.dirs: list[str] = []
        self.syncfs = 0
        monkeypatch.setattr(local, "_fdatasync", self._watch(self.files, os.fdatasync))
        monkeypatch.setattr(local, "_fsync", self._watch(self.dirs, os.fsync))
        real_syncfs = local._syncfs
        assert real_syncfs is not None, "this libc should have syncfs"

        def syncfs(fd: int) -> int:
            with self.lock:
                self.syncfs += 1
            return real_syncfs(fd)

        monkeypatch.setattr(local, "_syncfs", syncfs)

    def _watch(self, into: list[str], real: Callable[[int], None]) -> Callable[[int], None]:
        def flush(fd: int) -> None:
            with self.lock:
                into.append(os.readlink(f"/proc/self/fd/{fd}"))
            real(fd)

        return flush

    def take(self) -> tuple[list[str], list[str]]:
        """The files and directories flushed since the last take, sorted."""
        with self.lock:
            files, dirs = sorted(self.files), sorted(self.dirs)
            self.files.clear()
            self.dirs.clear()
        return files, dirs


def test_sync_flushes_the_objects_written_and_the_directories_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    flushes = Flushes(monkeypatch)
    root = tmp_path / "store"
    store = LocalStore(root)
    store.sync()
    assert flushes.take() == ([], [])
    store.put("c/ab/x", b"x")
    store.put_if_absent("l/00000001", b"seg")
    files, _ = flushes.take()
    # An exclusive create flushes its bytes before the name exists (under a temp name).
    assert len(files) == 1 and files[0].startswith(str(root / "l" / local.TEMP_PREFIX))
    store.sync()
    # New directories are entries in their parents, up to the root's own entry.
    dirs = [str(tmp_path), str(root), str(root / "c"), str(root / "c/ab"), str(root / "l")]
    assert flushes.take() == ([str(root / "c/ab/x")], dirs)
    store.sync()
    assert flushes.take() == ([], [])  # nothing was written since

    store.put("c/ab/y", b"y")
    store.put("c/cd/z", b"z")  # a new directory in c
    store.delete("l/00000001")
    store.sync()
    at = [str(root / "c/ab/y"), str(root / "c/cd/z")]
    dirs = [str(root / p) for p in ("c", "c/ab", "c/cd", "l")]
    assert flushes.take() == (at, dirs)
    assert flushes.syncfs == 0


def test_sync_flushes_the_entries_of_directories_made_above_the_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: a store made under a path that did not exist flushed the root's
    parent but not the directories above it that were made with it."""
    flushes = Flushes(monkeypatch)
    root = tmp_path / "a" / "b" / "store"
    store = LocalStore(root)
    store.put("h", b"header")
    store.sync()
    dirs = set(flushes.take()[1])
    assert {str(tmp_path), str(tmp_path / "a"), str(tmp_path / "a" / "b"), str(root)} <= dirs
    store.put("c/ab/x", b"x")
    store.sync()
    assert str(tmp_path) not in flushes.take()[1]  # durable now: not flushed again


def test_sync_flushes_an_existing_object_that_put_if_absent_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Left unsynced by a writer that died: whoever finds it may rely on it now.
    LocalStore(tmp_path).put("l/00000001", b"seg")
    flushes = Flushes(monkeypatch)
    store = LocalStore(tmp_path)
    with pytest.raises(ObjectExistsError):
        store.put_if_absent("l/00000001", b"seg")
    flushes.take()
    store.sync()
    assert flushes.take()[0] == [str(tmp_path / "l/00000001")]


@pytest.mark.parametrize("noreplace", ["renameat2", "hard link"])
def test_put_without_replace_flushes_what_it_made_or_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, noreplace: str
) -> None:
    """Created or found, the chunk is flushed at the next sync (not before: chunks go
    to the disk together), whether the file system renames with RENAME_NOREPLACE or
    sealfs has to fall back to a hard link."""
    if noreplace == "hard link":
        monkeypatch.setattr(local, "_renameat2", None)
    LocalStore(tmp_path).put("c/ab/found", b"theirs")
    flushes = Flushes(monkeypatch)
    store = LocalStore(tmp_path)
    store.put("c/ab/made", b"ours", replace=False)
    with pytest.raises(ObjectExistsError):
        store.put("c/ab/found", b"ours", replace=False)
    assert flushes.take()[0] == []
    store.sync()
    assert sorted(flushes.take()[0]) == [str(tmp_path / "c/ab/found"), str(tmp_path / "c/ab/made")]
    assert (tmp_path / "c/ab/found").read_bytes() == b"theirs"
    assert sorted(p.name for p in (tmp_path / "c/ab").iterdir()) == ["found", "made"]


@pytest.mark.parametrize("count", [1, 10], ids=["inline", "threads"])
def test_a_failed_flush_fails_every_later_sync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, count: int
) -> None:
    """After a failed writeback Linux may drop the pages and reports the error once: a
    later fsync that succeeds proves nothing. Regression: the next sync flushed the same
    paths again and its success let the next commit claim them durable."""
    flushes = Flushes(monkeypatch)
    watched = local._fdatasync
    failures = [errno.EIO]

    def failing_once(fd: int) -> None:
        with flushes.lock:
            fail = failures.pop() if failures else 0
        if fail:
            raise OSError(fail, os.strerror(fail))
        watched(fd)

    monkeypatch.setattr(local, "_fdatasync", failing_once)
    store = LocalStore(tmp_path)
    for i in range(count):
        store.put(f"c/ab/x{i}", b"x")
    pattern = r"fsync of c/ab/x\d+ failed \(Input/output error\): objects written since"
    with pytest.raises(SyncFailedError, match=pattern):
        store.sync()
    assert not failures  # the fault is gone; the store must not forget it
    store.put("c/ab/later", b"y")
    for _ in range(2):
        with pytest.raises(SyncFailedError, match=pattern):
            store.sync()
    assert store.get("c/ab/later") == b"y"  # reads go on


def test_a_flush_the_kernel_refuses_stops_syncs(tmp_path: Path) -> None:
    """The same with a real refusal: fdatasync of a character device fails (EINVAL)."""
    store = LocalStore(tmp_path)
    store.put("c/ab/x", b"x")
    path = tmp_path / "c/ab/x"
    path.unlink()
    path.symlink_to("/dev/null")
    with pytest.raises(SyncFailedError, match=r"fsync of c/ab/x failed \(Invalid argument\)"):
        store.sync()
    path.unlink()
    store.put("c/ab/x", b"x")
    with pytest.raises(SyncFailedError):
        store.sync()


def test_a_path_that_cannot_be_opened_is_flushed_by_the_next_sync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Failing to open a path flushes nothing, so nothing is lost: the next sync retries."""
    flushes = Flushes(monkeypatch)
    store = LocalStore(tmp_path)
    store.put("c/ab/x", b"x")
    path = tmp_path / "c/ab/x"
    path.rename(tmp_path / "c/ab/kept")
    path.symlink_to(path.name)  # a loop: open fails with ELOOP
    with pytest.raises(StoreError, match="open c/ab/x for sync failed") as info:
        store.sync()
    assert not isinstance(info.value, SyncFailedError)
    path.unlink()
    (tmp_path / "c/ab/kept").rename(path)
    flushes.take()
    store.sync()
    assert flushes.take()[0] == [str(path)]


def test_many_objects_take_one_syncfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    flushes = Flushes(monkeypatch)
    store = LocalStore(tmp_path)
    for i in range(local.SYNCFS_ABOVE + 1):
        store.put(f"c/ab/{i}", b"x")
    store.sync()
    assert (flushes.syncfs, flushes.take()) == (1, ([], []))
    store.put("c/ab/one-more", b"x")
    store.sync()  # back to flushing just what changed
    one_more = ([str(tmp_path / "c/ab/one-more")], [str(tmp_path / "c/ab")])
    assert (flushes.syncfs, flushes.take()) == (1, one_more)


def test_sync_covers_every_put_that_returned_before_it_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(local, "SYNCFS_ABOVE", 1 << 20)  # always by path, so it can be checked
    flushes = Flushes(monkeypatch)
    store = LocalStore(tmp_path)
    done: list[str] = []  # objects whose put returned, in order
    lock = threading.Lock()
    writing = threading.Event()
    writing.set()

    def write(who: int) -> None:
        for i in range(150):
            name = f"c/{i % 7:02x}/{who}-{i}"
            store.put(name, b"x" * i)  # a new name: its bytes wait for the sync
            with lock:
                done.append(str(tmp_path / name))

    missed: list[str] = []

    def sync() -> None:  # two of these: a sync must wait for one in progress
        while writing.is_set():
            with lock:
                before = list(done)
            store.sync()
            with flushes.lock:
                flushed = set(flushes.files)
            missed.extend(path for path in before if path not in flushed)

    writers = [threading.Thread(target=write, args=(who,)) for who in range(4)]
    syncers = [threading.Thread(target=sync) for _ in range(2)]
    for t in writers + syncers:
        t.start()
    for t in writers:
        t.join()
    writing.clear()
    for t in syncers:
        t.join()
    assert missed == []
    assert len(set(flushes.files)) == len(done)


def test_sync_falls_back_to_os_sync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(local, "_syncfs", None)
    monkeypatch.setattr(os, "sync", lambda: calls.append("sync"))
    monkeypatch.setattr(local, "SYNCFS_ABOVE", 0)
    store = LocalStore(tmp_path)
    store.put("c/ab/x", b"x")
    store.sync()
    assert calls == ["sync"]


def test_syncfs_error_becomes_store_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(fd: int) -> int:
        ctypes.set_errno(errno.EIO)
        return -1

    monkeypatch.setattr(local, "_syncfs", failing)
    monkeypatch.setattr(local, "SYNCFS_ABOVE", 0)
    store = LocalStore(tmp_path)
    store.put("c/ab/x", b"x")
    with pytest.raises(SyncFailedError, match="syncfs failed"):
        store.sync()


def test_missing_root_reads_as_empty(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "not-yet")
    assert store.list("") == []
    store.sync()
    store.delete("c/ab/x")
    store.put("c/ab/x", b"x")  # creates the root lazily
    assert store.list("") == ["c/ab/x"]


@pytest.mark.parametrize("replaced", [False, True], ids=["gone", "replaced"])
def test_a_root_that_went_away_is_not_made_again(tmp_path: Path, replaced: bool) -> None:
    """Regression: with the store's disk unmounted under a mount, objects went on into a
    new store directory made on the file system underneath, and fsync reported commits
    that the store never saw. A root replaced by an empty directory (the mountpoint the
    disk was mounted on) is the same case."""
    root = tmp_path / "store"
    store = LocalStore(root)
    store.put("c/ab/x", b"x")  # makes the root: a store being created
    root.rename(tmp_path / "away")
    if replaced:
        root.mkdir()
    for name in ("c/cd/y", "l/0000000000000002"):
        with pytest.raises(StoreError, match="the store directory is gone or was replaced"):
            store.put_if_absent(name, b"y")
    assert os.listdir(root) == [] if replaced else not root.exists()


@pytest.mark.parametrize("how", ["moved-in", "symlink"])
def test_a_root_replaced_by_another_store_is_not_written(tmp_path: Path, how: str) -> None:
    """Regression: a root replaced by another volume's store (another disk mounted on
    the path, a symlink pointed elsewhere) already has the directories objects go in,
    so only a new directory noticed it: a commit that added no chunk wrote its log
    segment into the other volume, which then failed to mount, while fsync reported
    success here and the store it belonged to never saw it."""
    root = tmp_path / "store"
    store = LocalStore(root)
    store.put("c/ab/x", b"x")
    store.put_if_absent("l/0000000000000001", b"mine")
    store.sync()
    store.put("c/ab/y", b"unsynced")  # for the sync below
    other = LocalStore(tmp_path / "other")
    for name in ("c/ab/z", "l/0000000000000001", "s/0000000000000001"):
        other.put(name, b"theirs")
    root.rename(tmp_path / "away")
    if how == "symlink":
        root.symlink_to(other.root)
    else:
        other.root.rename(root)
    before = {name: other.get(name) for name in other.list("")}
    writes: list[Callable[[], object]] = [
        lambda: store.put_if_absent("l/0000000000000002", b"segment"),
        lambda: store.put("c/ab/w", b"chunk"),
        lambda: store.delete("s/0000000000000001"),
        store.sync,
    ]
    for write in writes:
        with pytest.raises(StoreError, match="the store directory is gone or was replaced"):
            write()
    assert {name: other.get(name) for name in other.list("")} == before
    assert sorted(os.listdir(root / "c" / "ab")) == ["z"]


@pytest.mark.parametrize("count", [5, 3 * local.SYNCFS_ABOVE], ids=["by-path", "syncfs"])
def test_synced_objects_survive_a_power_cut(crashable_disk: CrashableDisk, count: int) -> None:
    root = crashable_disk.path / "store"
    store = LocalStore(root)
    store.put("sealfs.vol", b"header v1")
    store.sync()
    objects = {f"c/{i % 40:02x}/{i}": os.urandom(100 + i * 997 % 70_000) for i in range(count)}
    # and some written past the page cache
    objects |= {f"c/ff/{i}": os.urandom(local.DIRECT_FROM + i * 4097) for i in range(3)}
    with ThreadPoolExecutor(4) as pool:  # puts come from several threads, as in a commit
        list(pool.map(lambda item: store.put(*item), objects.items()))
    store.put_if_absent("l/00000001", b"segment")
    store.put_if_match("sealfs.vol", b"header v2", store.stat("sealfs.vol").etag)
    store.delete("c/00/0")
    store.sync()
    store.put_if_absent("l/00000002", b"never synced")  # shows that the cut loses something
    crashable_disk.cut_power()
    after = LocalStore(root)
    del objects["c/00/0"]
    expected = {**objects, "l/00000001": b"segment", "sealfs.vol": b"header v2"}
    assert {name: after.get(name) for name in after.list("")} == expected


LOST_BEFORE_SYNC: dict[str, Callable[[LocalStore], object]] = {
    "buffered chunk": lambda store: store.put("c/ab/new", os.urandom(5000)),
    "direct chunk": lambda store: store.put("c/cd/new", os.urandom(local.DIRECT_FROM + 4096)),
    "segment": lambda store: store.put_if_absent("l/00000002", b"segment 2"),
}


@pytest.mark.parametrize("write", LOST_BEFORE_SYNC.values(), ids=LOST_BEFORE_SYNC.keys())
def test_objects_lost_to_a_power_cut_before_their_sync_fail_it(
    crashable_disk: CrashableDisk, write: Callable[[LocalStore], object]
) -> None:
    """The store's disk loses power after an object was written, before it was synced,
    and comes back (mounted again) while the store lives on, as under a mount whose
    daemon outlives a store disk that went away: the object is gone, or empty. Its bytes
    are in no one's memory any more, so the sync that would make it durable must fail,
    and so must every later one. Regression: the sync found nothing to flush for a path
    that was gone and flushed an emptied file as readily as a whole one, and the commit
    published a segment naming chunks that were lost, its fsync reporting success."""
    root = crashable_disk.path / "store"
    store = LocalStore(root)
    store.put("sealfs.vol", b"header")
    store.put_if_absent("l/00000001", b"segment 1")
    store.put("c/ab/old", os.urandom(5000))
    store.sync()
    write(store)
    crashable_disk.cut_power()
    with pytest.raises(SyncFailedError, match="lost writes"):
        store.sync()
    with pytest.raises(SyncFailedError, match="lost writes"):
        store.sync()  # the kernel lost them for good: no later sync may succeed


def test_objects_deleted_or_replaced_before_their_sync_are_not_taken_for_lost(
    tmp_path: Path,
) -> None:
    """What the store itself deleted since it wrote it, and an object replaced (the
    header, which a key change in another process may replace again meanwhile), are no
    loss: the check that catches lost objects must not stop the writer for them."""
    store = LocalStore(tmp_path / "store")
    store.put("sealfs.vol", b"header")
    store.sync()
    store.put("sealfs.vol", b"header 2")
    store.put_if_absent("s/00000001", b"snapshot")
    store.delete("s/00000001")
    (tmp_path / "store" / "sealfs.vol").write_bytes(b"header 3, written by another process")
    store.put("c/ab/x", b"chunk")
    store.put("c/ab/x", b"chunk sealed again, longer")  # a rekey re-seals in place
    store.sync()
    assert store.get("c/ab/x") == b"chunk sealed again, longer"


def test_an_object_deleted_or_replaced_while_a_sync_runs_is_not_taken_for_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store is thread-safe: a delete or a re-seal in another thread may land while
    a sync flushes. Regression: the sync had taken the objects to check already, and
    the delete (or the new size) reached only the record for the next sync, so the
    sync found the object gone (or of another size) and failed for good, turning the
    mount read-only as if its disk had lost writes."""
    store = LocalStore(tmp_path / "store")
    store.put("c/ab/kept", b"kept")
    store.put_if_absent("s/00000001", b"snapshot")
    store.put("c/ab/x", b"chunk")
    flush = local.LocalStore._sync_paths

    def flush_then_change(self: LocalStore, files: set[str], dirs: set[str]) -> None:
        flush(self, files, dirs)
        self.delete("s/00000001")  # as if another thread, between the flush and the check
        self.put("c/ab/x", b"chunk sealed again, longer")

    monkeypatch.setattr(local.LocalStore, "_sync_paths", flush_then_change)
    store.sync()
    monkeypatch.undo()
    store.sync()  # and the next one neither
    assert store.get("c/ab/x") == b"chunk sealed again, longer"


def test_an_object_deleted_after_a_failed_sync_is_not_taken_for_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sync that fails short of a flush (a path it cannot open) hands what it took
    to the next sync. Regression: an object deleted meanwhile came back with it, and
    the next sync found it gone and failed for good."""
    store = LocalStore(tmp_path / "store")
    store.put_if_absent("s/00000001", b"snapshot")

    def cannot_open(self: LocalStore, files: set[str], dirs: set[str]) -> None:
        self.delete("s/00000001")  # lands while the sync runs, before it fails
        raise StoreError("open s/00000001 for sync failed: EMFILE")

    monkeypatch.setattr(local.LocalStore, "_sync_paths", cannot_open)
    with pytest.raises(StoreError) as info:
        store.sync()
    assert not isinstance(info.value, SyncFailedError)
    monkeypatch.undo()
    store.sync()


def test_a_store_on_a_fuse_file_system_is_synced_by_path(
    volume_env: VolumeEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store inside a sealfs mount (or on sshfs, gocryptfs): the kernel answers syncfs
    on a FUSE file system without asking its daemon. Regression: a commit of more than
    SYNCFS_ABOVE paths called syncfs, so its chunks stayed uncommitted below (here, in
    the outer mount's buffers) while its segment, synced by path after them, was made
    durable: a power cut below lost the chunks of a commit reported durable."""
    env = volume_env
    env.mount("--commit-interval", "3600")  # commits only when asked to
    try:
        store = LocalStore(env.mnt / "store")
        flushes = Flushes(monkeypatch)
        for i in range(3 * local.SYNCFS_ABOVE):
            store.put(f"c/{i % 40:02x}/{i}", os.urandom(1000))
        store.sync()
        assert flushes.syncfs == 0
        assert len(flushes.take()[0]) == 3 * local.SYNCFS_ABOVE
        status = env.status()
        assert (status["pending_bytes"], status["pending_records"]) == (0, 0)  # committed
    finally:
        env.umount()


def test_a_store_on_fuse_below_a_parent_it_may_not_open_is_still_synced_by_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first sync flushes the directory holding the root too; one the user may not
    open (sshfs, a shared directory of mode 0711) made the sync fall back to syncfs.
    Regression: on a FUSE file system that syncfs is a no-op, and the directories the
    flush had not reached yet (the root and l/, after the parent it stopped at) were
    left unsynced: the new segment's entry was not durable, its commit reported so."""
    monkeypatch.setattr(local, "syncfs_reaches", lambda fd: False)
    top = str(tmp_path)
    real_open = os.open

    def open_(path: str | bytes | os.PathLike[str], flags: int, *args: int, **kw: int) -> int:
        if os.fspath(path) == top:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), top)
        return real_open(path, flags, *args, **kw)

    root = tmp_path / "store"
    root.mkdir()
    store = LocalStore(root)
    flushes = Flushes(monkeypatch)
    monkeypatch.setattr(os, "open", open_)
    store.put("l/00000001", b"segment")  # 1 file, 3 directories: flushed inline
    store.sync()
    assert flushes.take() == ([str(root / "l/00000001")], [str(root), str(root / "l")])
    assert flushes.syncfs == 0
    store.put("l/00000002", b"segment")  # the parent is not asked for again
    store.sync()
    assert flushes.take() == ([str(root / "l/00000002")], [str(root / "l")])


def test_a_replaced_or_exclusive_object_is_flushed_before_its_name_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crash must never leave a name pointing at bytes that were not written."""
    store = LocalStore(tmp_path)
    store.put("sealfs.vol", b"v1")
    flushes = Flushes(monkeypatch)
    store.put("c/ab/new", b"new")  # a new name: nothing to lose yet, flushed at sync
    assert flushes.take()[0] == []
    store.put("sealfs.vol", b"v2")  # a replacement: flushed before the rename
    store.put_if_absent("l/00000002", b"segment")
    files, _ = flushes.take()
    assert len(files) == 2
    assert all(os.path.basename(f).startswith(local.TEMP_PREFIX) for f in files)
    assert store.get("sealfs.vol") == b"v2" and store.get("l/00000002") == b"segment"


def test_the_store_s_directories_are_the_owner_s_only(tmp_path: Path) -> None:
    """Under umask 0 they were 0777: any local user could replace or delete objects."""
    old = os.umask(0)
    try:
        store = LocalStore(tmp_path / "parent" / "store")
        store.put("c/ab/x", b"x")
    finally:
        os.umask(old)

    assert_owner_only_under(tmp_path / "parent", "store")


def test_a_store_this_user_may_not_write_names_the_fix(tmp_path: Path) -> None:
    """A mount or init run as the wrong user said only "write l/... failed: Permission
    denied". An immutable directory refuses even root (the suite runs as root)."""
    require(shutil.which("chattr") is not None, "chattr (e2fsprogs) is needed")
    store = LocalStore(tmp_path / "store")
    store.put("c/ab/x", b"x")
    subprocess.run(["chattr", "+i", str(tmp_path / "store" / "c" / "ab")], check=True)
    try:
        with pytest.raises(StoreError) as info:
            store.put("c/ab/y", b"y")
    finally:
        subprocess.run(["chattr", "-i", str(tmp_path / "store" / "c" / "ab")], check=True)
    message = str(info.value)
    assert "write c/ab/y failed: Operation not permitted" in message, message
    assert "run sealfs as a user who may read and write the store" in message
    assert "--read-only" in message and "\n" not in message


class _FifoWriter:
    """A thread that opens a FIFO for writing (blocking until some reader opens it),
    writes data and closes it; release() lets it finish if no reader ever came."""

    def __init__(self, fifo: Path, data: bytes) -> None:
        self.fifo = fifo
        self.thread = threading.Thread(target=self._write, args=(data,))
        self.thread.start()

    def _write(self, data: bytes) -> None:
        fd = os.open(self.fifo, os.O_WRONLY)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)

    def release(self) -> None:
        fd = os.open(self.fifo, os.O_RDONLY | os.O_NONBLOCK)  # the reader it waits for
        self.thread.join()
        os.close(fd)


def test_an_object_that_is_a_fifo_is_damaged_not_read(tmp_path: Path) -> None:
    # Whoever can write to the store's directory may leave a FIFO at an object's name.
    # Opening it blocked until a writer came: with none, a mount (and its unmount) hung
    # for good on a chunk read; with one, the store served what it wrote.
    store = LocalStore(tmp_path)
    store.put("c/ab/x", b"sealed")
    fifo = tmp_path / "c" / "ab" / "x"
    fifo.unlink()
    os.mkfifo(fifo)
    writer = _FifoWriter(fifo, b"forged")
    try:
        with pytest.raises(FormatError, match=r"c/ab/x .*not a regular file"):
            store.get("c/ab/x")
    finally:
        writer.release()


def test_an_object_that_links_to_a_device_is_damaged_not_read(tmp_path: Path) -> None:
    # /dev/null, not /dev/zero: that one was read into memory until the OOM killer came.
    store = LocalStore(tmp_path)
    (tmp_path / "l").mkdir()
    (tmp_path / "l" / "00000001").symlink_to("/dev/null")
    with pytest.raises(FormatError, match=r"l/00000001 .*not a regular file"):
        store.get("l/00000001")


def test_stat_hashes_an_object_without_holding_it_whole(tmp_path: Path) -> None:
    # A local store's etag is the SHA-256 of the object, so stat reads all of it; it read
    # it into memory at once, and a header grown without bound in the store (a sparse
    # file costs nothing) took all memory from every key command, which stats it first.
    store = LocalStore(tmp_path)
    store.put("sealfs.vol", b"header")
    with open(tmp_path / "sealfs.vol", "r+b") as f:
        f.truncate(256 << 20)
    tracemalloc.start()
    try:
        info = store.stat("sealfs.vol")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert info.size == 256 << 20
    assert info.etag == hashlib.sha256(b"header" + bytes((256 << 20) - 6)).hexdigest()
    assert peak < 16 << 20


@contextlib.contextmanager
def _opens_of(path: Path) -> Iterator[Callable[[], int]]:
    """A counter of the opens of path from now on (inotify IN_OPEN), for a test to read."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    assert fd >= 0, os.strerror(ctypes.get_errno())
    seen = 0

    def opens() -> int:
        nonlocal seen
        try:
            while data := os.read(fd, 4096):
                seen += len(data) // 16  # struct inotify_event, no name for a watched file
        except BlockingIOError:
            pass
        return seen

    try:
        assert libc.inotify_add_watch(fd, os.fsencode(path), 0x20) >= 0  # IN_OPEN
        yield opens
    finally:
        os.close(fd)


def test_an_object_that_is_no_regular_file_is_never_opened(tmp_path: Path) -> None:
    # Opening a device can act: /dev/watchdog starts the watchdog, which reboots the host
    # when its file is closed without the magic character; a tape rewinds. Whoever may
    # write to the store's directory could link an object's name to one, and the daemon
    # (root, often) opened it before it looked at what it was.
    store = LocalStore(tmp_path)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "c" / "ab").mkdir(parents=True)
    (tmp_path / "c" / "ab" / "x").symlink_to(fifo)
    with _opens_of(fifo) as opens:
        with pytest.raises(FormatError, match="not a regular file"):
            store.get("c/ab/x")
        with pytest.raises(FormatError, match="not a regular file"):
            store.stat("c/ab/x")
        assert opens() == 0
    store.put("c/ab/y", b"sealed")  # a regular object still reads, through its link too
    (tmp_path / "c" / "ab" / "x").unlink()
    (tmp_path / "c" / "ab" / "x").symlink_to(tmp_path / "c" / "ab" / "y")
    assert store.get("c/ab/x") == b"sealed"
    assert store.stat("c/ab/x").size == 6
