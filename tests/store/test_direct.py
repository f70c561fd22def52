"""Writes and reads past the page cache: exact bytes, and plain I/O where O_DIRECT is refused."""

from __future__ import annotations

import fcntl
import logging
import os
import threading
from pathlib import Path

import pytest

from sealfs.store import direct
from sealfs.store.direct import (
    ALIGN,
    WINDOW,
    DirectIOUnsupported,
    open_direct,
    read_direct,
    write_direct,
)
from sealfs.store.local import DIRECT_FROM, LocalStore
from tests.conftest import CrashableDisk
from tests.store.conftest import (
    cached_bytes,
    evict_from_page_cache,
    mounted_ramfs,
    require_disk,
)

_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL


@pytest.mark.parametrize("size", [0, 1, ALIGN - 1, ALIGN, ALIGN + 1, 3 * ALIGN + 5, (1 << 20) + 17])
def test_a_direct_write_leaves_exactly_the_bytes(tmp_path: Path, size: int) -> None:
    data = os.urandom(size)
    path = tmp_path / "object"
    fd = open_direct(str(path), _NEW, 0o600)
    try:
        write_direct(fd, data)
        assert not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT  # later writes are plain
    finally:
        os.close(fd)
    assert path.read_bytes() == data


def test_a_direct_write_the_device_refuses_writes_nothing(crashable_disk: CrashableDisk) -> None:
    """An offset that is not block-aligned: ext4 on a block device answers EINVAL (tmpfs
    would take it, so the test makes its own ext4)."""
    path = crashable_disk.path / "object"
    fd = open_direct(str(path), _NEW, 0o600)
    try:
        os.lseek(fd, 1, os.SEEK_SET)
        with pytest.raises(DirectIOUnsupported):
            write_direct(fd, os.urandom(2 * ALIGN))
        assert not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT
    finally:
        os.close(fd)
    assert path.stat().st_size == 0


def _shared_resident() -> int:
    """Bytes of shared memory this process has resident: the threads' aligned buffers
    are anonymous shared mappings."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) << 10
    raise AssertionError("no RssShmem in /proc/self/status")


def test_a_thread_keeps_no_copy_of_the_largest_object_it_wrote(tmp_path: Path) -> None:
    """Regression: a thread's buffer grew to the largest object it ever wrote (the
    snapshot of a big volume: hundreds of MiB) and stayed while the thread lived, and
    trio keeps a busy mount's worker threads; with 8 of them, 8 such copies."""
    store = LocalStore(tmp_path)
    data = os.urandom(6 * WINDOW + ALIGN + 1)
    kept: list[int] = []

    def put() -> None:
        before = _shared_resident()
        store.put("c/ab/large", data)
        kept.append(_shared_resident() - before)

    thread = threading.Thread(target=put)
    thread.start()
    thread.join()
    assert store.get("c/ab/large") == data
    assert kept and kept[0] <= WINDOW


def test_large_objects_bypass_the_page_cache_and_small_ones_do_not(tmp_path: Path) -> None:
    require_disk(tmp_path)
    store = LocalStore(tmp_path)
    large, small = os.urandom(DIRECT_FROM + 100), os.urandom(DIRECT_FROM - 1)
    store.put("c/ab/large", large)
    store.put_if_absent("c/ab/small", small)
    assert cached_bytes(tmp_path / "c/ab/large") <= ALIGN  # only the tail went through it
    assert cached_bytes(tmp_path / "c/ab/small") > ALIGN  # all of it, unless evicted since
    for name in ("large", "small"):
        evict_from_page_cache(tmp_path / "c/ab" / name)
    assert store.get("c/ab/large") == large
    assert store.get("c/ab/small") == small
    assert cached_bytes(tmp_path / "c/ab/large") == 0
    assert cached_bytes(tmp_path / "c/ab/small") > ALIGN


def test_a_store_told_to_read_through_the_page_cache_does(tmp_path: Path) -> None:
    """As a read-only mount's store is: the page cache is the only cache its re-reads
    find, since the kernel drops the mount's own at every open."""
    LocalStore(tmp_path).put("c/ab/large", large := os.urandom(DIRECT_FROM + 100))
    evict_from_page_cache(tmp_path / "c/ab/large")
    assert LocalStore(tmp_path, direct_reads=False).get("c/ab/large") == large
    assert cached_bytes(tmp_path / "c/ab/large") > ALIGN


@pytest.mark.parametrize(
    "size", [0, 1, ALIGN - 1, ALIGN, ALIGN + 1, 3 * ALIGN + 5, (1 << 20) + 17, WINDOW - 1]
)
def test_a_direct_read_returns_exactly_the_bytes(tmp_path: Path, size: int) -> None:
    path = tmp_path / "object"
    path.write_bytes(data := os.urandom(size))
    evict_from_page_cache(path)
    with open(path, "rb", buffering=0) as f:
        assert read_direct(f, size) == data
        assert not fcntl.fcntl(f.fileno(), fcntl.F_GETFL) & os.O_DIRECT
    assert cached_bytes(path) == 0  # past the page cache, every byte


def test_a_file_larger_than_the_buffer_is_read_through_the_page_cache(tmp_path: Path) -> None:
    """A big snapshot: reading it directly would grow every worker thread's buffer to
    its size, for as long as the thread lives."""
    path = tmp_path / "object"
    path.write_bytes(data := os.urandom(WINDOW))
    evict_from_page_cache(path)
    read: list[bytes] = []
    kept: list[int] = []

    def read_it() -> None:
        before = _shared_resident()
        with open(path, "rb", buffering=0) as f:
            read.append(read_direct(f, WINDOW))
        kept.append(_shared_resident() - before)  # while the thread, and its buffer, live

    thread = threading.Thread(target=read_it)
    thread.start()
    thread.join()
    assert read == [data]
    assert kept == [0]  # no buffer made for it
    assert cached_bytes(path) > WINDOW // 2


def test_the_main_thread_keeps_no_buffer_after_a_direct_read(tmp_path: Path) -> None:
    """Regression: a mount reads its snapshot in the main thread, which then runs the
    FUSE loop for the mount's whole life and kept the buffer (up to WINDOW) as long.
    A worker thread keeps its own, to reuse."""
    path = tmp_path / "object"
    path.write_bytes(data := os.urandom(3 << 20))
    kept: list[int] = []

    def read_it() -> None:
        before = _shared_resident()
        with open(path, "rb", buffering=0) as f:
            assert read_direct(f, len(data)) == data
        kept.append(_shared_resident() - before)

    with open(path, "rb", buffering=0) as f:
        assert read_direct(f, len(data)) == data
    # Looked at directly: RSS would not show a buffer an earlier test left in this thread.
    assert getattr(direct._local, "buf", None) is None
    thread = threading.Thread(target=read_it)
    thread.start()
    thread.join()
    assert kept and kept[0] >= len(data)


def test_the_main_thread_keeps_no_buffer_after_a_direct_write(tmp_path: Path) -> None:
    """The buffer is lent the same way both ways: a write does not leave one either."""
    path = tmp_path / "object"
    fd = open_direct(str(path), _NEW, 0o600)
    try:
        write_direct(fd, data := os.urandom((1 << 20) + 17))
    finally:
        os.close(fd)
    assert path.read_bytes() == data
    assert getattr(direct._local, "buf", None) is None


@pytest.mark.parametrize("told", [2 * ALIGN, 5 * ALIGN, 5 * ALIGN + 2])
def test_a_file_grown_since_its_size_was_taken_is_read_whole(tmp_path: Path, told: int) -> None:
    """Objects never grow, but a file someone appended to must not be read cut short
    (the caller's size bound would then not see it)."""
    path = tmp_path / "object"
    path.write_bytes(data := os.urandom(5 * ALIGN + 3))
    with open(path, "rb", buffering=0) as f:
        assert read_direct(f, told) == data
        assert not fcntl.fcntl(f.fileno(), fcntl.F_GETFL) & os.O_DIRECT


def test_where_o_direct_is_refused_a_read_goes_through_the_page_cache(tmp_path: Path) -> None:
    with mounted_ramfs(tmp_path / "ram") as ram:
        path = ram / "object"
        path.write_bytes(data := os.urandom(DIRECT_FROM + 1))
        with open(path, "rb", buffering=0) as f:
            assert read_direct(f, len(data)) == data


def test_open_direct_where_it_is_refused_leaves_no_file(tmp_path: Path) -> None:
    with mounted_ramfs(tmp_path / "ram") as ram:
        with pytest.raises(DirectIOUnsupported):
            open_direct(str(ram / "object"), _NEW, 0o600)
        assert list(ram.iterdir()) == []


def test_a_store_where_o_direct_is_refused_writes_through_the_page_cache(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with mounted_ramfs(tmp_path / "ram") as ram:
        store = LocalStore(ram)
        objects = {f"c/ab/{i}": os.urandom(DIRECT_FROM + i) for i in range(3)}
        with caplog.at_level(logging.INFO, logger="sealfs.store"):
            for name, data in objects.items():
                store.put(name, data)
            store.put_if_absent("l/00000001", objects["c/ab/0"])
            store.sync()
        assert {name: store.get(name) for name in objects} == objects
        assert store.get("l/00000001") == objects["c/ab/0"]
        notes = [r.getMessage() for r in caplog.records if "O_DIRECT" in r.getMessage()]
        assert notes == [
            f"local store at {ram}: the file system refuses O_DIRECT (Invalid argument);"
            " writing through the page cache"
        ]
        assert not [p for p in ram.rglob(".tmp-*")]
