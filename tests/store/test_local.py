"""LocalStore behaviour beyond the conformance suite: atomicity, full disks, sync, temp files."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sealfs.errors import NoSpaceError, ObjectExistsError, PreconditionFailedError, StoreError
from sealfs.store import local
from sealfs.store.local import LOCK_NAME, TEMP_PREFIX, LocalStore
from tests.store.conftest import CrashableDisk


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
    assert store.cleanup_temp() == 1
    assert not old.exists()
    assert young.exists()
    assert store.get("c/ab/x") == b"x"


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
    with pytest.raises(NoSpaceError, match=f"store disk full at {tiny_tmpfs}: free space"):
        store.put("c/ab/big", big)
    with pytest.raises(NoSpaceError):
        store.put_if_absent("l/00000001", big)
    assert _temp_files(tiny_tmpfs) == []
    assert store.list("") == ["c/ab/small"]
    store.put("c/ab/after", b"fits")  # the failed writes freed their space
    assert store.get("c/ab/after") == b"fits"


def test_sync_calls_syncfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = local._syncfs
    assert real is not None, "this libc should have syncfs"

    def spy(fd: int) -> int:
        calls.append(fd)
        return real(fd)

    monkeypatch.setattr(local, "_syncfs", spy)
    store = LocalStore(tmp_path)
    store.put("c/ab/x", b"x")
    store.sync()
    assert len(calls) == 1


def test_sync_falls_back_to_os_sync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(local, "_syncfs", None)
    monkeypatch.setattr(os, "sync", lambda: calls.append("sync"))
    store = LocalStore(tmp_path)
    store.put("c/ab/x", b"x")
    store.sync()
    assert calls == ["sync"]


def test_sync_error_becomes_store_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(fd: int) -> int:
        ctypes.set_errno(errno.EIO)
        return -1

    monkeypatch.setattr(local, "_syncfs", failing)
    with pytest.raises(StoreError, match="syncfs failed"):
        LocalStore(tmp_path).sync()


def test_missing_root_reads_as_empty(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "not-yet")
    assert store.list("") == []
    store.sync()
    store.delete("c/ab/x")
    store.put("c/ab/x", b"x")  # creates the root lazily
    assert store.list("") == ["c/ab/x"]


@pytest.mark.parametrize("count", [5, 200], ids=["few", "many"])
def test_synced_objects_survive_a_power_cut(crashable_disk: CrashableDisk, count: int) -> None:
    root = crashable_disk.path / "store"
    store = LocalStore(root)
    store.put("sealfs.vol", b"header v1")
    store.sync()
    objects = {f"c/{i % 40:02x}/{i}": os.urandom(100 + i * 997 % 70_000) for i in range(count)}
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
