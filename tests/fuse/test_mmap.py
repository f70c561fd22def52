"""Shared mappings and the other I/O paths the kernel serves from its page cache.

numpy.memmap, safetensors, LMDB and SQLite's mmap_size read and write files
through mmap(2): the daemon then sees only the kernel's writeback of dirty
pages (on msync, munmap, close or fsync), never the stores themselves. These
tests pin what such programs rely on: msync is a commit, the mapping and
read/write agree, MAP_PRIVATE stays private, truncation under a mapping gives
zeros or SIGBUS, never old bytes; and what sealfs refuses (fallocate) changes
nothing.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import random
import signal
import subprocess
import sys

import pytest

from tests.mounts import VolumeEnv

pytestmark = [pytest.mark.fuse, pytest.mark.timeout(60)]

PAGE = mmap.PAGESIZE
MiB = 1 << 20
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
FALLOC_FL_ZERO_RANGE = 0x10

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def fallocate_errno(fd: int, mode: int, offset: int, length: int) -> int:
    """fallocate(2) through glibc (os has only posix_fallocate): 0 or the errno."""
    if _libc.fallocate(fd, mode, offset, length) == 0:
        return 0
    return ctypes.get_errno()


def test_msync_makes_mapped_writes_survive_a_crash(volume_env: VolumeEnv) -> None:
    """msync(MS_SYNC) is fsync for a mapping: the kernel writes the dirty pages back,
    then sends FSYNC. munmap writes them back too (without a commit), so an fsync
    after it commits them. Both must survive a SIGKILL of the daemon; with an hour's
    commit interval only those syncs can have committed anything."""
    env = volume_env
    env.mount("--commit-interval", "3600")
    synced, unmapped = env.mnt / "synced", env.mnt / "unmapped"
    for path in (synced, unmapped):
        path.write_bytes(b"." * 3 * PAGE)
    fd = os.open(synced, os.O_RDWR)
    mapping = mmap.mmap(fd, 3 * PAGE)
    mapping[5:10] = b"first"
    mapping[2 * PAGE + 7 : 2 * PAGE + 11] = b"last"
    mapping.flush()  # msync(MS_SYNC)
    fd2 = os.open(unmapped, os.O_RDWR)
    with mmap.mmap(fd2, 3 * PAGE) as other:
        other[PAGE : PAGE + 8] = b"unmapped"
    os.fsync(fd2)
    os.close(fd2)
    env.kill()  # the first mapping is still alive: nothing but msync wrote it back
    mapping.close()
    os.close(fd)
    env.mount()
    expected = bytearray(b"." * 3 * PAGE)
    expected[5:10] = b"first"
    expected[2 * PAGE + 7 : 2 * PAGE + 11] = b"last"
    assert synced.read_bytes() == expected
    expected = bytearray(b"." * 3 * PAGE)
    expected[PAGE : PAGE + 8] = b"unmapped"
    assert unmapped.read_bytes() == expected
    env.umount()


def test_mapping_and_plain_io_see_each_other(mounted_env: VolumeEnv) -> None:
    """One page cache serves the mapping, read(2) on another descriptor and write(2):
    each sees the others' bytes at once, before any writeback. An O_DIRECT read goes
    to the daemon, so the kernel must write dirty pages back first."""
    path = mounted_env.mnt / "shared"
    path.write_bytes(bytes(4 * PAGE))
    fd = os.open(path, os.O_RDWR)
    reader = os.open(path, os.O_RDONLY)
    direct = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        with mmap.mmap(fd, 4 * PAGE) as mapping:
            mapping[PAGE : PAGE + 6] = b"mapped"
            assert os.pread(reader, 6, PAGE) == b"mapped"
            os.pwrite(fd, b"written", 3 * PAGE)
            assert mapping[3 * PAGE : 3 * PAGE + 7] == b"written"
            aligned = mmap.mmap(-1, 4 * PAGE)  # O_DIRECT wants an aligned buffer
            assert os.preadv(direct, [aligned], 0) == 4 * PAGE
            assert aligned[:] == mapping[:]
            aligned.close()
    finally:
        for each in (fd, reader, direct):
            os.close(each)
    expected = bytearray(4 * PAGE)
    expected[PAGE : PAGE + 6] = b"mapped"
    expected[3 * PAGE : 3 * PAGE + 7] = b"written"
    assert path.read_bytes() == expected


def test_private_mapping_never_reaches_the_file(mounted_env: VolumeEnv) -> None:
    """A MAP_PRIVATE mapping is copy-on-write: its stores stay in the process, whatever
    is synced or unmounted afterwards."""
    path = mounted_env.mnt / "private"
    path.write_bytes(b"p" * 2 * PAGE)
    fd = os.open(path, os.O_RDWR)
    with mmap.mmap(fd, 2 * PAGE, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE) as mapping:
        mapping[0:7] = b"private"
        assert mapping[0:7] == b"private"
        os.fsync(fd)
        assert os.pread(fd, 7, 0) == b"ppppppp"
    os.close(fd)
    mounted_env.umount()
    mounted_env.mount()
    assert path.read_bytes() == b"p" * 2 * PAGE


def test_sparse_file_written_through_a_mapping(volume_env: VolumeEnv) -> None:
    """numpy.memmap's pattern: size the file with ftruncate, map it whole, store here and
    there. Only the pages stored to become data (st_blocks stays small), the rest reads
    as zeros, and after msync and a crash the file is byte for byte what was stored."""
    env = volume_env
    env.mount("--commit-interval", "3600")
    path = env.mnt / "sparse"
    size = 64 * MiB
    rng = random.Random(11)
    expected = bytearray(size)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    os.ftruncate(fd, size)
    with mmap.mmap(fd, size) as mapping:
        assert mapping[size // 2 : size // 2 + MiB] == bytes(MiB)  # a hole reads zeros
        for _ in range(40):
            at = rng.randrange(size - 32)
            piece = rng.randbytes(32)
            mapping[at : at + 32] = piece
            expected[at : at + 32] = piece
        mapping.flush()
    os.close(fd)
    assert 0 < path.stat().st_blocks * 512 < 8 * MiB
    env.kill()
    env.mount()
    assert path.stat().st_size == size
    assert path.read_bytes() == expected
    env.umount()


SIGBUS_PROBE = """
import mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
mapping = mmap.mmap(fd, 3 * mmap.PAGESIZE)
os.truncate(sys.argv[1], mmap.PAGESIZE)  # as another process would, by path
print("read", mapping[2 * mmap.PAGESIZE], flush=True)  # past the end now: SIGBUS
"""


def test_truncate_under_a_mapping_gives_zeros_or_sigbus(mounted_env: VolumeEnv) -> None:
    """A file shrunk under a mapping and grown again reads zeros past the cut (through
    the mapping and through read(2)), never the bytes it held or the dirty pages it had;
    a page wholly past the end faults with SIGBUS, as on any Linux file system."""
    path = mounted_env.mnt / "cut"
    path.write_bytes(b"a" * 5 * PAGE)
    fd = os.open(path, os.O_RDWR)
    with mmap.mmap(fd, 5 * PAGE) as mapping:
        mapping[3 * PAGE : 3 * PAGE + 5] = b"synced"[:5]  # in the daemon's buffers
        mapping.flush()
        mapping[4 * PAGE : 4 * PAGE + 5] = b"dirty"  # only in the kernel's page cache
        os.ftruncate(fd, PAGE + 100)
        os.ftruncate(fd, 5 * PAGE)
        assert mapping[: PAGE + 100] == b"a" * (PAGE + 100)
        assert mapping[PAGE + 100 :] == bytes(4 * PAGE - 100)
        assert os.pread(fd, 5 * PAGE, 0) == mapping[:]
    os.close(fd)
    probe = subprocess.run(
        [sys.executable, "-c", SIGBUS_PROBE, str(path)],
        capture_output=True, text=True, timeout=20, check=False,
    )  # fmt: skip
    assert probe.returncode == -signal.SIGBUS, probe.stdout + probe.stderr
    assert path.read_bytes() == b"a" * PAGE


def test_fallocate_is_refused_and_changes_nothing(mounted_env: VolumeEnv) -> None:
    """pyfuse3 has no fallocate handler: every mode gets EOPNOTSUPP (README, "Known
    limits"), and the file keeps its size, bytes and times. posix_fallocate then falls
    back to glibc's emulation (a zero byte written where a block reads zero), which
    must keep every byte the file held and add zeros up to the new size."""
    path = mounted_env.mnt / "f"
    data = random.Random(5).randbytes(3 * PAGE + 17)
    path.write_bytes(data)
    before = path.stat()
    fd = os.open(path, os.O_RDWR)
    try:
        for mode in (
            0,
            FALLOC_FL_KEEP_SIZE,
            FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
            FALLOC_FL_ZERO_RANGE,
        ):
            assert fallocate_errno(fd, mode, 100, 10 * PAGE) == errno.EOPNOTSUPP, mode
        after = path.stat()
        assert (after.st_size, after.st_mtime_ns, after.st_ctime_ns) == (
            before.st_size, before.st_mtime_ns, before.st_ctime_ns,
        )  # fmt: skip
        assert path.read_bytes() == data
        os.posix_fallocate(fd, 2 * PAGE, 10 * PAGE)
    finally:
        os.close(fd)
    assert path.stat().st_size == 12 * PAGE
    assert path.read_bytes() == data + bytes(12 * PAGE - len(data))
