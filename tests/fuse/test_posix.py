"""POSIX behaviour through a real mount: plain os calls, exact results and errno.

Each test drives the kernel's view of the mount (os, pathlib, subprocess) and,
where the result is stored state, checks it again after an unmount and a mount.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import json
import os
import random
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from sealfs.meta import ops
from sealfs.meta.model import ROOT_INO
from sealfs.store.local import LocalStore
from tests.acls import NAMED_USER_ACL, mode_acl
from tests.conftest import mounted
from tests.mounts import VolumeEnv
from tests.prereq import require

pytestmark = [pytest.mark.fuse, pytest.mark.timeout(60)]

GiB = 1 << 30
MiB = 1 << 20
AT_FDCWD = -100
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2

_libc = ctypes.CDLL(None, use_errno=True)


# -- helpers -----------------------------------------------------------------------------


def remount(env: VolumeEnv) -> None:
    env.umount()
    env.mount()


def assert_errno(code: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    with pytest.raises(OSError) as info:
        fn(*args, **kwargs)
    assert info.value.errno == code, (
        f"expected {errno.errorcode[code]}, got {errno.errorcode.get(info.value.errno or 0)}"
    )


def renameat2(old: Path | bytes, new: Path | bytes, flags: int) -> None:
    """rename(2) with flags, through glibc; raises OSError like os.rename."""
    rc = _libc.renameat2(AT_FDCWD, os.fsencode(old), AT_FDCWD, os.fsencode(new), flags)
    if rc != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), os.fsdecode(old))


def write_committed(path: Path, data: bytes) -> None:
    """Write a file and fsync it: its bytes then live in sealed chunks, not in buffers."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def pread_all(path: Path | bytes) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def listing(path: Path | bytes) -> list[bytes]:
    return sorted(os.listdir(os.fsencode(path)))


def run(*command: str | Path, timeout: float = 20) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(c) for c in command], capture_output=True, text=True, timeout=timeout, check=True
    )


def manifest(root: Path | bytes, *, ctime: bool = True) -> dict[bytes, dict[str, Any]]:
    """Everything stored about a tree, by path relative to root (b"" is root itself).

    Names, types and modes, owners, sizes, content hashes, symlink targets,
    device numbers, xattrs, times in ns and which names are hard links of one inode.
    """
    base = os.fsencode(root)
    out: dict[bytes, dict[str, Any]] = {}
    by_ino: dict[int, list[bytes]] = {}

    def visit(rel: bytes) -> None:
        path = os.path.join(base, rel) if rel else base
        st = os.lstat(path)
        entry: dict[str, Any] = {
            "mode": st.st_mode,
            "uid": st.st_uid,
            "gid": st.st_gid,
            "atime_ns": st.st_atime_ns,
            "mtime_ns": st.st_mtime_ns,
            "xattrs": {
                name: os.getxattr(path, name, follow_symlinks=False)
                for name in sorted(os.listxattr(path, follow_symlinks=False))
            },
        }
        if ctime:
            entry["ctime_ns"] = st.st_ctime_ns
        if stat.S_ISREG(st.st_mode):
            entry["size"] = st.st_size
            entry["nlink"] = st.st_nlink
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                while block := f.read(MiB):
                    digest.update(block)
            entry["sha256"] = digest.hexdigest()
            by_ino.setdefault(st.st_ino, []).append(rel)
        elif stat.S_ISLNK(st.st_mode):
            entry["target"] = os.readlink(path)
            entry["size"] = st.st_size
        elif stat.S_ISDIR(st.st_mode):
            entry["nlink"] = st.st_nlink
            entry["size"] = st.st_size
            for name in sorted(os.listdir(path)):
                visit(os.path.join(rel, name) if rel else name)
        elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
            entry["rdev"] = st.st_rdev
        out[rel] = entry

    visit(b"")
    for names in by_ino.values():
        for name in names:
            out[name]["links"] = sorted(names)
    return out


@contextlib.contextmanager
def bound_unix_socket(path: Path) -> Any:
    """A listening unix socket bound at path (chdir first: sun_path holds 108 bytes)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with contextlib.chdir(path.parent):
            sock.bind(path.name)
        sock.listen(1)
        yield sock
    finally:
        sock.close()


# -- regular files -----------------------------------------------------------------------


def test_random_reads_and_writes_at_offsets_match_a_reference(mounted_env: VolumeEnv) -> None:
    path = mounted_env.mnt / "random"
    rnd = random.Random(42)
    ref = bytearray()
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        for step in range(300):
            if rnd.random() < 0.6:
                offset = rnd.randrange(0, 3 * MiB)
                data = rnd.randbytes(rnd.choice([1, 17, 4096, 65536, 300_000]))
                assert os.pwrite(fd, data, offset) == len(data)
                if offset > len(ref):
                    ref.extend(bytes(offset - len(ref)))
                ref[offset : offset + len(data)] = data
            else:
                offset = rnd.randrange(0, len(ref) + 10_000)
                size = rnd.choice([1, 100, 4096, 200_000])
                assert os.pread(fd, size, offset) == bytes(ref[offset : offset + size])
            if step % 50 == 49:
                os.fsync(fd)  # seal what is buffered, then keep writing over it
            assert os.fstat(fd).st_size == len(ref)
    finally:
        os.close(fd)
    assert path.read_bytes() == ref
    remount(mounted_env)
    assert path.read_bytes() == ref


def test_append_from_two_descriptors_interleaves_at_the_end(mounted_env: VolumeEnv) -> None:
    path = mounted_env.mnt / "log"
    path.write_bytes(b"head\n")
    a = os.open(path, os.O_WRONLY | os.O_APPEND)
    b = os.open(path, os.O_WRONLY | os.O_APPEND)
    other = os.open(path, os.O_RDWR)
    expected = bytearray(b"head\n")
    try:
        for k in range(50):
            fd, tag = (a, b"A") if k % 2 == 0 else (b, b"B")
            record = tag + b"%03d\n" % k
            assert os.write(fd, record) == len(record)
            expected += record
            if k == 25:
                # A plain write that extends the file: appends must follow it.
                os.pwrite(other, b"X" * 10, len(expected))
                expected += b"X" * 10
        # An offset given to an O_APPEND descriptor is ignored (Linux pwrite).
        os.lseek(a, 0, os.SEEK_SET)
        os.write(a, b"end\n")
        expected += b"end\n"
    finally:
        for fd in (a, b, other):
            os.close(fd)
    assert path.read_bytes() == expected
    remount(mounted_env)
    assert path.read_bytes() == expected


def test_o_append_cleared_by_fcntl_writes_at_the_given_offset(mounted_env: VolumeEnv) -> None:
    """Regression: the engine kept appending for a descriptor opened with O_APPEND after
    fcntl(F_SETFL) had cleared the flag (the kernel alone sees that change)."""
    path = mounted_env.mnt / "f"
    path.write_bytes(b"0123456789")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, 0)
        os.pwrite(fd, b"AB", 2)
    finally:
        os.close(fd)
    assert path.read_bytes() == b"01AB456789"
    fd = os.open(path, os.O_WRONLY)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, os.O_APPEND)
        os.write(fd, b"Z")
    finally:
        os.close(fd)
    assert path.read_bytes() == b"01AB456789Z"
    remount(mounted_env)
    assert path.read_bytes() == b"01AB456789Z"


def test_truncate_up_reads_zeros_and_down_forgets_data(mounted_env: VolumeEnv) -> None:
    path = mounted_env.mnt / "trunc"
    data = random.Random(1).randbytes(300_000)
    path.write_bytes(data)
    os.truncate(path, 1_000_000)
    assert path.stat().st_size == 1_000_000
    assert path.read_bytes() == data + bytes(700_000)
    os.truncate(path, 1000)
    assert path.read_bytes() == data[:1000]
    # Extending again must show zeros, never the old bytes beyond the cut.
    os.truncate(path, 300_000)
    assert path.read_bytes() == data[:1000] + bytes(299_000)
    remount(mounted_env)
    assert path.read_bytes() == data[:1000] + bytes(299_000)


def test_truncate_of_committed_data_then_extend_reads_zeros(mounted_env: VolumeEnv) -> None:
    path = mounted_env.mnt / "committed"
    data = random.Random(2).randbytes(3 * MiB)
    write_committed(path, data)
    with open(path, "r+b") as f:
        f.truncate(MiB + 123)
        f.seek(2 * MiB)
        f.write(b"tail")
    expected = data[: MiB + 123] + bytes(2 * MiB - MiB - 123) + b"tail"
    assert path.read_bytes() == expected
    remount(mounted_env)
    assert path.read_bytes() == expected
    os.truncate(path, 0)
    assert path.stat().st_size == 0
    assert path.read_bytes() == b""


def test_sparse_file_beyond_4_gib(mounted_env: VolumeEnv) -> None:
    path = mounted_env.mnt / "sparse"
    far = 10 * GiB
    with open(path, "wb") as f:
        f.write(b"start")
        f.seek(far)
        f.write(b"far end")
        f.seek((1 << 32) - 3)
        f.write(b"straddle")  # crosses the 4 GiB boundary
    expected_size = far + len(b"far end")

    def check() -> None:
        assert path.stat().st_size == expected_size > 4 * GiB
        with open(path, "rb") as f:
            assert f.read(5) == b"start"
            f.seek(5 * GiB)
            assert f.read(MiB) == bytes(MiB)  # a hole reads as zeros
            f.seek((1 << 32) - 10)
            assert f.read(20) == bytes(7) + b"straddle" + bytes(5)
            f.seek(far - 4)
            assert f.read(100) == bytes(4) + b"far end"
            assert f.read(100) == b""
            assert f.seek(0, os.SEEK_END) == expected_size

    check()
    remount(mounted_env)
    check()


def test_sparse_files_look_sparse_to_du_and_cp(mounted_env: VolumeEnv, tmp_path: Path) -> None:
    """st_blocks counts data, not holes: du reports it and cp keeps the holes on copying out."""
    path = mounted_env.mnt / "sparse"
    with open(path, "wb") as f:
        f.write(b"head" * 1024)
        f.seek(GiB)
        f.write(b"tail")
    assert path.stat().st_blocks == 9  # 4 KiB + 4 bytes, in 512-byte units
    du = subprocess.run(["du", "-k", str(path)], capture_output=True, text=True, check=True)
    assert int(du.stdout.split()[0]) < 64
    remount(mounted_env)
    assert path.stat().st_blocks == 9
    copy = tmp_path / "copy"
    subprocess.run(["cp", "--sparse=auto", str(path), str(copy)], check=True, timeout=120)
    assert copy.stat().st_size == GiB + 4
    assert copy.stat().st_blocks * 512 < 16 * MiB  # the holes stayed holes
    with open(copy, "rb") as f:
        assert f.read(8) == b"headhead"
        f.seek(GiB)
        assert f.read() == b"tail"


def test_truncate_to_a_logical_size_above_4_gib(mounted_env: VolumeEnv) -> None:
    path = mounted_env.mnt / "huge"
    path.write_bytes(b"abc")
    os.truncate(path, 6 * GiB + 1)
    assert path.stat().st_size == 6 * GiB + 1
    with open(path, "rb") as f:
        f.seek(6 * GiB - 4096)
        assert f.read() == bytes(4097)
    remount(mounted_env)
    assert path.stat().st_size == 6 * GiB + 1
    with open(path, "rb") as f:
        assert f.read(4) == b"abc\0"


def test_o_excl_refuses_an_existing_name(mounted_env: VolumeEnv) -> None:
    path = mounted_env.mnt / "excl"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    os.write(fd, b"first")
    os.close(fd)
    assert_errno(errno.EEXIST, os.open, path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    os.mkdir(mounted_env.mnt / "dir")
    assert_errno(errno.EEXIST, os.open, mounted_env.mnt / "dir", os.O_CREAT | os.O_EXCL)
    os.symlink("excl", mounted_env.mnt / "link")
    # O_EXCL does not follow a symlink, even to an existing file.
    assert_errno(errno.EEXIST, os.open, mounted_env.mnt / "link", os.O_CREAT | os.O_EXCL)
    assert path.read_bytes() == b"first"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_o_trunc_empties_an_existing_file(mounted_env: VolumeEnv) -> None:
    path = mounted_env.mnt / "t"
    write_committed(path, os.urandom(2 * MiB))
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
    try:
        assert os.fstat(fd).st_size == 0
        os.write(fd, b"new")
    finally:
        os.close(fd)
    assert path.read_bytes() == b"new"
    os.close(os.open(path, os.O_RDONLY))  # no O_TRUNC: nothing changes
    assert path.read_bytes() == b"new"
    remount(mounted_env)
    assert path.read_bytes() == b"new"


def test_o_trunc_with_o_rdonly_truncates_and_sets_times_of_empty_files(
    mounted_env: VolumeEnv,
) -> None:
    """Regression: O_RDONLY|O_TRUNC left the file whole (Linux truncates it), and O_TRUNC
    of an already empty file left mtime and ctime alone (`: > file` must touch it)."""
    path = mounted_env.mnt / "t"
    path.write_bytes(b"content")
    os.close(os.open(path, os.O_RDONLY | os.O_TRUNC))
    assert path.stat().st_size == 0
    assert path.read_bytes() == b""
    os.utime(path, ns=(10**18, 10**18))
    ctime = path.stat().st_ctime_ns
    os.close(os.open(path, os.O_WRONLY | os.O_TRUNC))
    st = path.stat()
    assert st.st_mtime_ns > 10**18
    assert st.st_ctime_ns > ctime
    remount(mounted_env)
    assert path.stat().st_size == 0
    assert path.stat().st_mtime_ns == st.st_mtime_ns


def test_overwrite_in_the_middle_of_a_multi_chunk_file(mounted_env: VolumeEnv) -> None:
    path = mounted_env.mnt / "big"
    ref = bytearray(random.Random(8).randbytes(8 * MiB))
    write_committed(path, ref)
    assert mounted_env.status()["chunks"] > 1
    patch = random.Random(9).randbytes(1024)
    with open(path, "r+b") as f:
        f.seek(3 * MiB)
        f.write(patch)
    ref[3 * MiB : 3 * MiB + 1024] = patch
    assert path.read_bytes() == ref
    assert path.stat().st_size == 8 * MiB
    remount(mounted_env)
    assert path.read_bytes() == ref
    # Once more, before anything was committed, and read through the same descriptor.
    with open(path, "r+b") as f:
        f.seek(5 * MiB - 512)
        f.write(b"\xee" * 1024)
        ref[5 * MiB - 512 : 5 * MiB + 512] = b"\xee" * 1024
        f.seek(0)
        assert f.read() == ref
    remount(mounted_env)
    assert path.read_bytes() == ref


def test_ftruncate_and_write_through_one_descriptor(mounted_env: VolumeEnv) -> None:
    path = mounted_env.mnt / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"0123456789")
        os.ftruncate(fd, 4)
        assert os.pread(fd, 100, 0) == b"0123"
        os.pwrite(fd, b"Z", 8)
        assert os.pread(fd, 100, 0) == b"0123\0\0\0\0Z"
    finally:
        os.close(fd)
    remount(mounted_env)
    assert path.read_bytes() == b"0123\0\0\0\0Z"


# -- directories -------------------------------------------------------------------------


def test_mkdir_rmdir_and_their_errors(mounted_env: VolumeEnv) -> None:
    mnt = mounted_env.mnt
    d = mnt / "d"
    os.mkdir(d, 0o755)
    assert stat.S_ISDIR(d.stat().st_mode)
    assert stat.S_IMODE(d.stat().st_mode) == 0o755
    assert_errno(errno.EEXIST, os.mkdir, d)
    (d / "file").write_bytes(b"x")
    assert_errno(errno.ENOTEMPTY, os.rmdir, d)
    assert_errno(errno.ENOTDIR, os.rmdir, d / "file")
    assert_errno(errno.EISDIR, os.unlink, d)
    assert_errno(errno.ENOENT, os.rmdir, mnt / "missing")
    assert_errno(errno.ENOENT, os.unlink, mnt / "missing")
    assert_errno(errno.ENOTDIR, os.mkdir, d / "file" / "sub")
    assert_errno(errno.ENOENT, os.mkdir, mnt / "no" / "sub")
    os.unlink(d / "file")
    os.rmdir(d)
    assert not d.exists()
    assert listing(mnt) == []
    remount(mounted_env)
    assert listing(mnt) == []


def test_directory_nlink_counts_subdirectories(mounted_env: VolumeEnv) -> None:
    mnt = mounted_env.mnt
    root_links = os.stat(mnt).st_nlink
    top = mnt / "top"
    top.mkdir()
    assert os.stat(mnt).st_nlink == root_links + 1
    for name in ("a", "b", "c"):
        (top / name).mkdir()
    (top / "file").write_bytes(b"")
    assert os.stat(top).st_nlink == 5
    os.rmdir(top / "c")
    assert os.stat(top).st_nlink == 4
    os.rename(top / "b", mnt / "b")  # moved out: one fewer here, one more at the root
    assert os.stat(top).st_nlink == 3
    assert os.stat(mnt).st_nlink == root_links + 2
    assert os.stat(top / "a").st_nlink == 2
    os.rename(top / "file", top / "renamed")  # files do not count
    assert os.stat(top).st_nlink == 3
    remount(mounted_env)
    assert os.stat(top).st_nlink == 3
    assert os.stat(mnt).st_nlink == root_links + 2
    assert os.stat(mnt / "b").st_nlink == 2


def test_directory_times_follow_entry_changes(mounted_env: VolumeEnv) -> None:
    mnt = mounted_env.mnt
    a, b = mnt / "a", mnt / "b"
    a.mkdir()
    b.mkdir()
    old = (1, 1)

    def reset() -> None:
        for d in (a, b):
            os.utime(d, ns=old)

    def changed(d: Path) -> bool:
        st = os.stat(d)
        return st.st_mtime_ns > 10**18 and st.st_ctime_ns > 10**18

    reset()
    (a / "f").write_bytes(b"x")
    assert changed(a) and os.stat(b).st_mtime_ns == 1
    reset()
    os.rename(a / "f", b / "f")
    assert changed(a) and changed(b)
    file_ctime = os.stat(b / "f").st_ctime_ns
    reset()
    os.link(b / "f", b / "g")
    assert changed(b) and os.stat(a).st_mtime_ns == 1
    assert os.stat(b / "f").st_ctime_ns > file_ctime  # its link count changed
    reset()
    os.unlink(b / "g")
    assert changed(b)
    reset()
    (a / "d").mkdir()
    os.rmdir(a / "d")
    assert changed(a)
    dir_fd = os.open(a, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)  # fsyncdir commits too
    finally:
        os.close(dir_fd)
    assert mounted_env.status()["pending_records"] == 0
    times = {d: (os.stat(d).st_mtime_ns, os.stat(d).st_ctime_ns) for d in (a, b)}
    remount(mounted_env)
    assert {d: (os.stat(d).st_mtime_ns, os.stat(d).st_ctime_ns) for d in (a, b)} == times


def test_listing_with_listdir_and_ls_shows_dot_entries(mounted_env: VolumeEnv) -> None:
    mnt = mounted_env.mnt
    d = mnt / "dir"
    d.mkdir()
    names = [f"file-{k:03d}" for k in range(150)]
    for name in names:
        (d / name).write_bytes(name.encode())
    (d / "sub").mkdir()
    assert sorted(os.listdir(d)) == sorted([*names, "sub"])
    out = run("ls", "-la", d).stdout.splitlines()
    assert out[0].startswith("total")
    shown = [line.split()[-1] for line in out[1:]]
    assert sorted(shown) == sorted([".", "..", *names, "sub"])
    dot = next(line for line in out[1:] if line.split()[-1] == ".")
    assert dot.startswith("d")
    assert int(dot.split()[1]) == 3  # ls reports the nlink of "." (2 + one subdir)
    root = [line.split()[-1] for line in run("ls", "-la", mnt).stdout.splitlines()[1:]]
    assert sorted(root) == [".", "..", "dir"]
    # Directory inode numbers seen through ".." match the parent's.
    assert os.stat(d / "sub" / "..").st_ino == os.stat(d).st_ino
    assert os.stat(d / "..").st_ino == os.stat(mnt).st_ino
    os.symlink("sub", d / "link")
    os.mkfifo(d / "fifo")
    with os.scandir(d) as it:  # d_type comes with the listing
        types = {
            e.name: (e.is_file(follow_symlinks=False), e.is_dir(follow_symlinks=False),
                     e.is_symlink())
            for e in it
        }  # fmt: skip
    assert types["file-000"] == (True, False, False)
    assert types["sub"] == (False, True, False)
    assert types["link"] == (False, False, True)
    assert types["fifo"] == (False, False, False)
    remount(mounted_env)
    assert sorted(os.listdir(d)) == sorted([*names, "sub", "link", "fifo"])
    assert (d / "file-149").read_bytes() == b"file-149"


def test_listing_a_huge_directory_is_not_quadratic(volume_env: VolumeEnv) -> None:
    """Regression: each readdir page built the attributes of the whole rest of the
    directory, so listing 40,000 names took 18 s and 100,000 names minutes."""
    n = 60_000

    async def fill() -> None:
        async with mounted(LocalStore(volume_env.store)) as volume:
            huge = (await volume.mkdir(ROOT_INO, b"huge", 0o755, 0, 0)).ino
            for k in range(n):
                await volume.mknod(huge, b"f%06d" % k, stat.S_IFREG | 0o644, 0, 0, 0)

    trio.run(fill)  # through the engine: creating 60,000 nodes over FUSE takes a minute
    volume_env.mount()
    try:
        started = time.monotonic()
        names = os.listdir(volume_env.mnt / "huge")
        elapsed = time.monotonic() - started
        assert len(names) == n
        assert elapsed < 12, f"listing {n} names took {elapsed:.1f} s"
    finally:
        volume_env.umount()


def test_listing_while_entries_are_removed(mounted_env: VolumeEnv) -> None:
    d = mounted_env.mnt / "d"
    d.mkdir()
    for k in range(300):
        (d / f"f{k:03d}").write_bytes(b"")
    seen = []
    with os.scandir(d) as it:
        for entry in it:
            seen.append(entry.name)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
    assert len(seen) == len(set(seen))
    for name in seen:
        assert not (d / name).exists()
    leftover = os.listdir(d)
    for name in leftover:
        os.unlink(d / name)
    assert sorted(seen + leftover) == [f"f{k:03d}" for k in range(300)]
    os.rmdir(d)


def test_a_name_renamed_away_during_a_listing_stays_gone(mounted_env: VolumeEnv) -> None:
    """Regression: a listing pass spanning several readdir requests served names as they
    were when it began, and the kernel made a dentry of each (readdirplus). A file
    renamed away meanwhile kept its old name in the kernel for the entry timeout, so
    open(old, "w") truncated and overwrote the renamed file and created nothing."""
    d = mounted_env.mnt / "d"
    d.mkdir()
    n = 3000  # far more than one readdir request holds
    for k in range(n):
        (d / f"f{k:04d}").write_bytes(b"old %d" % k)
    with os.scandir(d) as it:
        next(it)  # the pass has begun: the first request is answered
        os.rename(d / "f2500", d / "g2500")
        for _ in it:  # the rest of the pass
            pass
    assert not (d / "f2500").exists()
    (d / "f2500").write_bytes(b"new")
    assert (d / "g2500").read_bytes() == b"old 2500"
    assert (d / "f2500").read_bytes() == b"new"
    assert os.stat(d / "f2500").st_ino != os.stat(d / "g2500").st_ino


def test_listing_an_open_directory_again_shows_it_as_it_is_now(mounted_env: VolumeEnv) -> None:
    """Regression: the listing was taken at opendir, so rewinddir (os.listdir of an open
    descriptor) showed a poller the names of its first pass forever, new files missing
    and renamed ones still there."""
    d = mounted_env.mnt / "d"
    d.mkdir()
    for name in ("a", "b", "c"):
        (d / name).write_bytes(b"")
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert sorted(os.listdir(fd)) == ["a", "b", "c"]
        (d / "new").write_bytes(b"")
        os.unlink(d / "a")
        os.rename(d / "b", d / "z")
        assert sorted(os.listdir(fd)) == ["c", "new", "z"]
    finally:
        os.close(fd)


# -- symlinks and hard links -------------------------------------------------------------


def test_symlinks(mounted_env: VolumeEnv) -> None:
    mnt = mounted_env.mnt
    (mnt / "dir").mkdir()
    (mnt / "dir" / "file").write_bytes(b"content")
    os.symlink("dir/file", mnt / "rel")
    os.symlink(str(mnt / "dir"), mnt / "abs")
    os.symlink("nowhere", mnt / "dangling")
    long_target = "x/" * 2000 + "y"
    os.symlink(long_target, mnt / "long")

    def check() -> None:
        st = os.lstat(mnt / "rel")
        assert stat.S_ISLNK(st.st_mode)
        assert st.st_size == len("dir/file")
        assert os.readlink(mnt / "rel") == "dir/file"
        assert (mnt / "rel").read_bytes() == b"content"
        assert os.stat(mnt / "rel").st_ino == os.stat(mnt / "dir" / "file").st_ino
        assert (mnt / "abs" / "file").read_bytes() == b"content"
        assert os.readlink(mnt / "dangling") == "nowhere"
        assert_errno(errno.ENOENT, os.stat, mnt / "dangling")
        assert os.readlink(mnt / "long") == long_target
        assert_errno(errno.EINVAL, os.readlink, mnt / "dir" / "file")

    check()
    assert_errno(errno.EEXIST, os.symlink, "other", mnt / "rel")
    remount(mounted_env)
    check()
    os.unlink(mnt / "rel")
    assert (mnt / "dir" / "file").read_bytes() == b"content"


def test_hard_links_share_inode_and_data(mounted_env: VolumeEnv) -> None:
    mnt = mounted_env.mnt
    (mnt / "sub").mkdir()
    a, b = mnt / "a", mnt / "sub" / "b"
    a.write_bytes(b"shared")
    os.link(a, b)
    assert os.stat(a).st_ino == os.stat(b).st_ino
    assert os.stat(a).st_nlink == os.stat(b).st_nlink == 2
    with open(b, "ab") as f:
        f.write(b" data")
    assert a.read_bytes() == b"shared data"
    assert_errno(errno.EEXIST, os.link, a, b)
    assert_errno(errno.EPERM, os.link, mnt / "sub", mnt / "dirlink")
    remount(mounted_env)
    assert os.stat(a).st_ino == os.stat(b).st_ino
    assert os.stat(a).st_nlink == 2
    assert b.read_bytes() == b"shared data"
    os.unlink(a)
    assert os.stat(b).st_nlink == 1
    assert b.read_bytes() == b"shared data"
    remount(mounted_env)
    assert not a.exists()
    assert os.stat(b).st_nlink == 1
    assert b.read_bytes() == b"shared data"


# -- rename ------------------------------------------------------------------------------


def test_rename_over_an_existing_file_replaces_it(mounted_env: VolumeEnv) -> None:
    mnt = mounted_env.mnt
    (mnt / "old").write_bytes(b"old content")
    (mnt / "new").write_bytes(b"new content")
    ino = os.stat(mnt / "new").st_ino
    os.rename(mnt / "new", mnt / "old")
    assert (mnt / "old").read_bytes() == b"new content"
    assert os.stat(mnt / "old").st_ino == ino
    assert not (mnt / "new").exists()
    assert listing(mnt) == [b"old"]
    remount(mounted_env)
    assert (mnt / "old").read_bytes() == b"new content"
    assert listing(mnt) == [b"old"]


def test_write_fsync_rename_replaces_a_committed_file(mounted_env: VolumeEnv) -> None:
    mnt = mounted_env.mnt
    write_committed(mnt / "config", b"v1" * 100_000)
    with open(mnt / "config.tmp", "wb") as f:
        f.write(b"v2" * 50_000)
        f.flush()
        os.fsync(f.fileno())
    os.rename(mnt / "config.tmp", mnt / "config")
    assert (mnt / "config").read_bytes() == b"v2" * 50_000
    remount(mounted_env)
    assert (mnt / "config").read_bytes() == b"v2" * 50_000
    assert listing(mnt) == [b"config"]


def test_rename_directories_over_directories(mounted_env: VolumeEnv) -> None:
    mnt = mounted_env.mnt
    for name in ("src", "empty", "full"):
        (mnt / name).mkdir()
    (mnt / "src" / "inside").write_bytes(b"in")
    (mnt / "full" / "x").write_bytes(b"x")
    root_links = os.stat(mnt).st_nlink
    assert_errno(errno.ENOTEMPTY, os.rename, mnt / "src", mnt / "full")
    os.rename(mnt / "src", mnt / "empty")  # over an empty directory
    assert (mnt / "empty" / "inside").read_bytes() == b"in"
    assert not (mnt / "src").exists()
    assert os.stat(mnt).st_nlink == root_links - 1
    remount(mounted_env)
    assert sorted(os.listdir(mnt)) == ["empty", "full"]
    assert (mnt / "empty" / "inside").read_bytes() == b"in"
    assert os.stat(mnt).st_nlink == root_links - 1


def test_rename_type_mismatches_and_cycles(mounted_env: VolumeEnv) -> None:
    mnt = mounted_env.mnt
    (mnt / "dir" / "sub" / "deeper").mkdir(parents=True)
    (mnt / "file").write_bytes(b"f")
    assert_errno(errno.EISDIR, os.rename, mnt / "file", mnt / "dir")
    assert_errno(errno.ENOTDIR, os.rename, mnt / "dir", mnt / "file")
    assert_errno(errno.EINVAL, os.rename, mnt / "dir", mnt / "dir" / "sub" / "moved")
    assert_errno(errno.EINVAL, os.rename, mnt / "dir", mnt / "dir" / "sub" / "deeper" / "x")
    assert_errno(errno.ENOENT, os.rename, mnt / "missing", mnt / "x")
    assert_errno(errno.ENOTDIR, os.rename, mnt / "file", mnt / "file" / "x")
    assert (mnt / "file").read_bytes() == b"f"
    assert sorted(os.listdir(mnt)) == ["dir", "file"]
    # Renaming a directory to its own name, or a file onto itself, changes nothing.
    os.rename(mnt / "dir", mnt / "dir")
    os.rename(mnt / "file", mnt / "file")
    assert sorted(os.listdir(mnt)) == ["dir", "file"]


def test_rename_noreplace_and_exchange(mounted_env: VolumeEnv) -> None:
    mnt = mounted_env.mnt
    (mnt / "a").write_bytes(b"A")
    (mnt / "b").write_bytes(b"B")
    (mnt / "d").mkdir()
    (mnt / "d" / "inner").write_bytes(b"inner")
    assert_errno(errno.EEXIST, renameat2, mnt / "a", mnt / "b", RENAME_NOREPLACE)
    assert (mnt / "a").read_bytes() == b"A"
    renameat2(mnt / "a", mnt / "c", RENAME_NOREPLACE)
    assert not (mnt / "a").exists()
    assert (mnt / "c").read_bytes() == b"A"
    renameat2(mnt / "c", mnt / "b", RENAME_EXCHANGE)
    assert (mnt / "c").read_bytes() == b"B"
    assert (mnt / "b").read_bytes() == b"A"
    assert_errno(errno.ENOENT, renameat2, mnt / "b", mnt / "nothing", RENAME_EXCHANGE)
    assert_errno(errno.EINVAL, renameat2, mnt / "b", mnt / "c", RENAME_EXCHANGE | RENAME_NOREPLACE)
    # Exchange a file with a directory in another directory: parents' nlink follow.
    root_links = os.stat(mnt).st_nlink
    (mnt / "other").mkdir()
    (mnt / "other" / "f").write_bytes(b"other file")
    renameat2(mnt / "d", mnt / "other" / "f", RENAME_EXCHANGE)
    assert (mnt / "d").read_bytes() == b"other file"
    assert (mnt / "other" / "f" / "inner").read_bytes() == b"inner"
    assert os.stat(mnt).st_nlink == root_links  # lost d, gained other
    assert os.stat(mnt / "other").st_nlink == 3
    assert os.stat(mnt / "other" / "f" / "..").st_ino == os.stat(mnt / "other").st_ino
    remount(mounted_env)
    assert (mnt / "c").read_bytes() == b"B"
    assert (mnt / "b").read_bytes() == b"A"
    assert (mnt / "d").read_bytes() == b"other file"
    assert (mnt / "other" / "f" / "inner").read_bytes() == b"inner"
    assert os.stat(mnt / "other").st_nlink == 3
    assert os.stat(mnt).st_nlink == root_links


def test_rename_of_hard_linked_names(mounted_env: VolumeEnv) -> None:
    mnt = mounted_env.mnt
    (mnt / "one").write_bytes(b"data")
    os.link(mnt / "one", mnt / "two")
    # Two names of one inode: rename does nothing and both names stay (POSIX).
    os.rename(mnt / "one", mnt / "two")
    assert sorted(os.listdir(mnt)) == ["one", "two"]
    assert os.stat(mnt / "one").st_nlink == 2
    os.rename(mnt / "one", mnt / "three")
    assert sorted(os.listdir(mnt)) == ["three", "two"]
    assert os.stat(mnt / "two").st_nlink == 2
    # Replacing one hard-linked name leaves the other name and its data alone.
    (mnt / "fresh").write_bytes(b"fresh")
    os.rename(mnt / "fresh", mnt / "two")
    assert (mnt / "two").read_bytes() == b"fresh"
    assert os.stat(mnt / "two").st_nlink == 1
    assert os.stat(mnt / "three").st_nlink == 1
    assert (mnt / "three").read_bytes() == b"data"
    remount(mounted_env)
    assert sorted(os.listdir(mnt)) == ["three", "two"]
    assert (mnt / "three").read_bytes() == b"data"
    assert os.stat(mnt / "three").st_nlink == 1


# -- attributes --------------------------------------------------------------------------


def test_chmod_changes_mode_and_ctime(mounted_env: VolumeEnv) -> None:
    path = mounted_env.mnt / "f"
    path.write_bytes(b"x")
    before = os.stat(path)
    os.chmod(path, 0o4751)
    after = os.stat(path)
    assert after.st_mode == stat.S_IFREG | 0o4751
    assert after.st_ctime_ns > before.st_ctime_ns
    assert after.st_mtime_ns == before.st_mtime_ns
    d = mounted_env.mnt / "d"
    d.mkdir()
    os.chmod(d, 0o1777)
    assert os.stat(d).st_mode == stat.S_IFDIR | 0o1777
    remount(mounted_env)
    assert os.stat(path).st_mode == stat.S_IFREG | 0o4751
    assert os.stat(path).st_ctime_ns == after.st_ctime_ns
    assert os.stat(d).st_mode == stat.S_IFDIR | 0o1777


def test_chown_changes_owner_and_clears_setuid(mounted_env: VolumeEnv) -> None:
    mnt = mounted_env.mnt
    path = mnt / "f"
    path.write_bytes(b"x")
    os.chown(path, 1234, 5678)
    st = os.stat(path)
    assert (st.st_uid, st.st_gid) == (1234, 5678)
    os.chown(path, -1, 42)
    assert (os.stat(path).st_uid, os.stat(path).st_gid) == (1234, 42)
    os.chmod(path, 0o6755)
    os.chown(path, 1, 1)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o755  # Linux clears set-id bits
    os.symlink("f", mnt / "link")
    os.lchown(mnt / "link", 77, 88)
    assert (os.lstat(mnt / "link").st_uid, os.lstat(mnt / "link").st_gid) == (77, 88)
    assert os.stat(path).st_uid == 1
    # A new node in a setgid directory takes the directory's group.
    d = mnt / "sgid"
    d.mkdir()
    os.chown(d, 0, 4321)
    os.chmod(d, 0o2775)
    (d / "child").write_bytes(b"")
    (d / "subdir").mkdir()
    assert os.stat(d / "child").st_gid == 4321
    assert os.stat(d / "subdir").st_gid == 4321
    assert os.stat(d / "subdir").st_mode & stat.S_ISGID
    remount(mounted_env)
    assert (os.stat(path).st_uid, os.stat(path).st_gid) == (1, 1)
    assert (os.lstat(mnt / "link").st_uid, os.lstat(mnt / "link").st_gid) == (77, 88)
    assert os.stat(d / "child").st_gid == 4321


def test_utimens_with_nanoseconds_reads_back_exactly(mounted_env: VolumeEnv) -> None:
    mnt = mounted_env.mnt
    f, d = mnt / "f", mnt / "d"
    f.write_bytes(b"x")
    d.mkdir()
    os.symlink("f", mnt / "link")
    times = {
        f: (1_234_567_890_123_456_789, 1_500_000_000_987_654_321),
        d: (1, 999_999_999),
        mnt / "link": (2_000_000_000_000_000_001, 1_700_000_000_000_000_007),
    }
    for path, ns in times.items():
        os.utime(path, ns=ns, follow_symlinks=False)

    def check() -> None:
        for path, (atime, mtime) in times.items():
            st = os.lstat(path)
            assert (st.st_atime_ns, st.st_mtime_ns) == (atime, mtime), path

    check()
    remount(mounted_env)
    check()
    before = os.stat(f).st_ctime_ns
    os.utime(f)  # "now"
    now = os.stat(f)
    assert now.st_mtime_ns > 1_600_000_000 * 10**9
    assert now.st_ctime_ns >= before


def test_times_before_1970_are_kept_and_far_ones_clamped(mounted_env: VolumeEnv) -> None:
    """touch -d 1960 works as on ext4; a time the format cannot hold is clamped, not fatal.

    Year 3000 once reached the commit unchecked, failed to encode there and
    took the daemon down with everything not yet committed.
    """
    mnt = mounted_env.mnt
    old, far = mnt / "old", mnt / "far"
    old.write_bytes(b"from the sixties")
    far.write_bytes(b"from the future")
    before_1970 = -315_619_199_999_999_999  # 1960-01-01, plus a nanosecond
    os.utime(old, ns=(before_1970, before_1970 - 10**9))
    os.utime(far, ns=(32_503_680_000 * 10**9, 0))  # year 3000
    expected = {old: (before_1970, before_1970 - 10**9), far: (ops.TIME_MAX_NS, 0)}

    def check() -> None:
        for path, times in expected.items():
            st = os.stat(path)
            assert (st.st_atime_ns, st.st_mtime_ns) == times, path

    check()
    remount(mounted_env)
    check()
    assert old.read_bytes() == b"from the sixties"


def test_writes_update_mtime_and_it_persists(mounted_env: VolumeEnv) -> None:
    path = mounted_env.mnt / "f"
    path.write_bytes(b"one")
    os.utime(path, ns=(10**18, 10**18))
    with open(path, "ab") as f:
        f.write(b"two")
    st = os.stat(path)
    assert st.st_mtime_ns > 10**18 + 1  # now, not the stale value
    remount(mounted_env)
    again = os.stat(path)
    assert again.st_mtime_ns == st.st_mtime_ns
    assert again.st_ctime_ns == st.st_ctime_ns
    assert path.read_bytes() == b"onetwo"


def test_touch_sets_atime_and_mtime_separately(mounted_env: VolumeEnv) -> None:
    path = mounted_env.mnt / "f"
    path.write_bytes(b"")
    run("touch", "-a", "-d", "@1234567890.123456789", path)
    mtime = path.stat().st_mtime_ns
    assert path.stat().st_atime_ns == 1_234_567_890_123_456_789
    run("touch", "-m", "-d", "@1000000000.5", path)
    st = path.stat()
    assert (st.st_atime_ns, st.st_mtime_ns) == (
        1_234_567_890_123_456_789,
        1_000_000_000_500_000_000,
    )
    assert mtime != st.st_mtime_ns
    remount(mounted_env)
    assert (path.stat().st_atime_ns, path.stat().st_mtime_ns) == (st.st_atime_ns, st.st_mtime_ns)


def test_umask_applies_to_new_nodes(mounted_env: VolumeEnv) -> None:
    old = os.umask(0o027)
    try:
        os.close(os.open(mounted_env.mnt / "f", os.O_CREAT | os.O_WRONLY, 0o666))
        os.mkdir(mounted_env.mnt / "d", 0o777)
    finally:
        os.umask(old)
    assert os.stat(mounted_env.mnt / "f").st_mode == stat.S_IFREG | 0o640
    assert os.stat(mounted_env.mnt / "d").st_mode == stat.S_IFDIR | 0o750


SYSTEM_PYTHON = "/usr/bin/python3"  # the venv's may not be readable by other users
PERMISSION_PROBE = """
import json, os, sys
fd = int(sys.argv[1])
results = {}
def attempt(key, fn):
    try:
        out = fn()
        if isinstance(out, int) and key.startswith("open"):
            os.close(out)
        results[key] = 0
    except OSError as exc:
        results[key] = exc.errno
attempt("open secret", lambda: os.open("secret", os.O_RDONLY, dir_fd=fd))
attempt("open public", lambda: os.open("public", os.O_RDONLY, dir_fd=fd))
attempt("open public for writing", lambda: os.open("public", os.O_WRONLY, dir_fd=fd))
attempt("create at root", lambda: os.open("mine", os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=fd))
attempt("create in tmp", lambda: os.open("tmp/mine", os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=fd))
attempt("unlink own in tmp", lambda: os.unlink("tmp/mine", dir_fd=fd))
attempt("unlink root's in tmp", lambda: os.unlink("tmp/roots", dir_fd=fd))
attempt("rename root's in tmp",
        lambda: os.rename("tmp/roots", "tmp/x", src_dir_fd=fd, dst_dir_fd=fd))
attempt("chmod public", lambda: os.chmod("public", 0o777, dir_fd=fd))
attempt("utime public", lambda: os.utime("public", ns=(1, 1), dir_fd=fd))
attempt("truncate public", lambda: os.truncate(f"/proc/self/fd/{fd}/public", 0))
attempt("set a system xattr on public",
        lambda: os.setxattr(f"/proc/self/fd/{fd}/public", "system.x", b"v"))
attempt("enter private dir", lambda: os.stat("private/inside", dir_fd=fd))
print(json.dumps(results))
"""


@pytest.fixture
def shared_mount(volume_env: VolumeEnv) -> Iterator[Path]:
    """The volume mounted with --allow-other, for probes run as another user."""
    require(
        os.access(SYSTEM_PYTHON, os.X_OK),
        f"{SYSTEM_PYTHON} is needed to run a probe as another user",
    )
    volume_env.mount("--allow-other")
    try:
        yield volume_env.mnt
    finally:
        volume_env.umount()


def run_as_user(mnt: Path, probe: str) -> str:
    """Run a Python probe as uid 1000 with the mount's directory as fd argv[1] (the mount
    lies below root's 0700 tmp directory); return its stdout."""
    fd = os.open(mnt, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return subprocess.run(
            [SYSTEM_PYTHON, "-c", probe, str(fd)], pass_fds=(fd,), user=1000, group=1000,
            extra_groups=[], capture_output=True, text=True, timeout=20, check=True, cwd="/",
        ).stdout  # fmt: skip
    finally:
        os.close(fd)


def test_permissions_are_enforced_for_other_users(shared_mount: Path) -> None:
    mnt = shared_mount
    for name, mode in (("secret", 0o600), ("public", 0o644)):
        (mnt / name).write_bytes(name.encode())
        os.chmod(mnt / name, mode)
    (mnt / "tmp").mkdir()
    os.chmod(mnt / "tmp", 0o1777)
    (mnt / "tmp" / "roots").write_bytes(b"")
    (mnt / "private").mkdir(0o700)
    (mnt / "private" / "inside").write_bytes(b"")
    os.chmod(mnt, 0o755)
    got = json.loads(run_as_user(mnt, PERMISSION_PROBE))
    assert got == {
        "open secret": errno.EACCES,
        "open public": 0,
        "open public for writing": errno.EACCES,
        "create at root": errno.EACCES,
        "create in tmp": 0,
        "unlink own in tmp": 0,
        "unlink root's in tmp": errno.EPERM,
        "rename root's in tmp": errno.EPERM,
        "chmod public": errno.EPERM,
        "utime public": errno.EPERM,
        "truncate public": errno.EACCES,
        "set a system xattr on public": errno.EOPNOTSUPP,  # as ext4: no such namespace
        "enter private dir": errno.EACCES,
    }
    assert (mnt / "public").read_bytes() == b"public"
    assert os.stat(mnt / "public").st_mode == stat.S_IFREG | 0o644
    assert os.listxattr(mnt / "public") == []


def test_trusted_xattr_names_are_hidden_from_other_users(shared_mount: Path) -> None:
    """Regression: a user listed root's trusted.* names, which the kernel then refuses
    to read (ENODATA): rsync -X as that user failed (exit 23) where on ext4, which lists
    them only to CAP_SYS_ADMIN, it copies the rest."""
    mnt = shared_mount
    os.chmod(mnt, 0o755)
    (mnt / "f").write_bytes(b"")
    for name in ("user.u", "trusted.t", "security.s"):
        os.setxattr(mnt / "f", name, b"v")
    probe = "import os, sys; print(sorted(os.listxattr(f'/proc/self/fd/{sys.argv[1]}/f')))"
    assert run_as_user(mnt, probe).split() == ["['security.s',", "'user.u']"]
    assert sorted(os.listxattr(mnt / "f")) == ["security.s", "trusted.t", "user.u"]


OPEN_USERS_WITH_O_TRUNC = """
import os, sys
os.close(os.open("users", os.O_WRONLY | os.O_TRUNC, dir_fd=int(sys.argv[1])))
"""


def test_o_trunc_by_a_user_clears_set_id_bits(shared_mount: Path, volume_env: VolumeEnv) -> None:
    """Regression (differential fuzzing against ext4): open(O_TRUNC) by its unprivileged
    owner left a file set-user-ID and set-group-ID, where truncate(2), a write or a
    chown clear them. The kernel hands O_TRUNC to the daemon (atomic_o_trunc) and clears
    nothing itself then. Root (CAP_FSETID) keeps them, as on ext4."""
    mnt = shared_mount
    os.chmod(mnt, 0o755)
    for name in ("users", "roots"):
        (mnt / name).write_bytes(b"data")
        os.chown(mnt / name, 1000, 1000)
        os.chmod(mnt / name, 0o6755)
    run_as_user(mnt, OPEN_USERS_WITH_O_TRUNC)
    os.close(os.open(mnt / "roots", os.O_WRONLY | os.O_TRUNC))
    for _ in range(2):
        assert os.stat(mnt / "users").st_mode == stat.S_IFREG | 0o755
        assert os.stat(mnt / "users").st_size == 0
        assert os.stat(mnt / "roots").st_mode == stat.S_IFREG | 0o6755
        remount(volume_env)


def test_parallel_writers_and_readers(mounted_env: VolumeEnv) -> None:
    mnt = mounted_env.mnt
    log_fd = os.open(mnt / "shared.log", os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o644)
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            rnd = random.Random(k)
            ref = bytearray(rnd.randbytes(MiB))
            path = mnt / f"w{k}"
            path.write_bytes(ref)
            fd = os.open(path, os.O_RDWR)
            try:
                for step in range(60):
                    offset = rnd.randrange(0, MiB)
                    data = rnd.randbytes(rnd.randrange(1, 50_000))
                    os.pwrite(fd, data, offset)
                    ref[offset : offset + len(data)] = data
                    os.write(log_fd, b"%02d:%03d\n" % (k, step))
                    if step % 20 == 0:
                        os.fsync(fd)
                    at = rnd.randrange(0, len(ref))
                    assert os.pread(fd, 4096, at) == bytes(ref[at : at + 4096])
            finally:
                os.close(fd)
            assert path.read_bytes() == ref
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(40)
    os.close(log_fd)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    lines = (mnt / "shared.log").read_bytes().splitlines()
    assert sorted(lines) == sorted(b"%02d:%03d" % (k, s) for k in range(8) for s in range(60))
    for k in range(8):  # each writer's own records stay in order
        mine = [line for line in lines if line.startswith(b"%02d:" % k)]
        assert mine == sorted(mine)
    digests = {k: hashlib.sha256((mnt / f"w{k}").read_bytes()).digest() for k in range(8)}
    remount(mounted_env)
    for k in range(8):
        assert hashlib.sha256((mnt / f"w{k}").read_bytes()).digest() == digests[k]
    assert sorted((mnt / "shared.log").read_bytes().splitlines()) == sorted(lines)


_LOCK_HOLDER = """
import fcntl, os, sys
whole = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
ranged = os.open(sys.argv[2], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(whole, fcntl.LOCK_EX)
fcntl.lockf(ranged, fcntl.LOCK_EX, 5, 10)
print("held", flush=True)
sys.stdin.readline()
os.close(whole)
print("closed", flush=True)
sys.stdin.readline()
"""

_COUNTER = """
import fcntl, os, sys
lock, counter = sys.argv[1], sys.argv[2]
for _ in range(50):
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    c = os.open(counter, os.O_RDWR | os.O_CREAT, 0o644)
    value = int(os.pread(c, 20, 0) or b"0")
    os.pwrite(c, b"%20d" % (value + 1), 0)
    os.close(c)
    os.close(fd)
"""


def test_advisory_locks_exclude_other_processes_until_close_or_exit(
    mounted_env: VolumeEnv,
) -> None:
    """flock and POSIX record locks on the mount work between processes as on ext4, and
    the filelock pattern (lock, read what the last holder wrote, write, unlock) loses
    no update: the kernel keeps the locks, the daemon must show each holder's writes."""
    mnt = mounted_env.mnt
    whole, ranged = mnt / "whole.lock", mnt / "ranged.lock"
    with subprocess.Popen(
        [sys.executable, "-c", _LOCK_HOLDER, str(whole), str(ranged)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    ) as holder:  # fmt: skip
        assert holder.stdin is not None and holder.stdout is not None
        assert holder.stdout.readline() == "held\n"
        a, b = os.open(whole, os.O_RDWR), os.open(ranged, os.O_RDWR)
        try:
            assert_errno(errno.EWOULDBLOCK, fcntl.flock, a, fcntl.LOCK_EX | fcntl.LOCK_NB)
            with pytest.raises(OSError) as info:
                fcntl.lockf(b, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 12)
            assert info.value.errno in (errno.EAGAIN, errno.EACCES)
            fcntl.lockf(b, fcntl.LOCK_EX | fcntl.LOCK_NB, 5, 0)  # a range nobody holds
            holder.stdin.write("\n")
            holder.stdin.flush()
            assert holder.stdout.readline() == "closed\n"
            fcntl.flock(a, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released by the holder's close
            holder.send_signal(signal.SIGKILL)
            holder.wait(10)
            fcntl.lockf(b, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 12)  # released by its exit
        finally:
            os.close(a)
            os.close(b)
            holder.kill()
    counter = mnt / "counter"
    workers = [
        subprocess.Popen([sys.executable, "-c", _COUNTER, str(mnt / "counter.lock"), str(counter)])
        for _ in range(4)
    ]
    assert [w.wait(30) for w in workers] == [0] * 4
    assert int(counter.read_bytes()) == 200
    remount(mounted_env)
    assert int(counter.read_bytes()) == 200


# -- extended attributes -----------------------------------------------------------------


def test_xattrs_set_get_list_remove(mounted_env: VolumeEnv) -> None:
    mnt = mounted_env.mnt
    f = mnt / "f"
    f.write_bytes(b"")
    d = mnt / "d"
    d.mkdir()
    big = random.Random(3).randbytes(65536)
    long_name = "user." + "n" * 250  # 255 bytes: XATTR_NAME_MAX
    os.setxattr(f, "user.mime", b"text/plain")
    os.setxattr(f, "user.empty", b"")
    os.setxattr(f, "user.binary", b"\0\xff\0")
    os.setxattr(f, "user.big", big)
    os.setxattr(f, long_name, b"long")
    os.setxattr(d, "user.on-dir", b"yes")
    assert_errno(errno.ENODATA, os.getxattr, f, "user.missing")
    assert_errno(errno.ENODATA, os.removexattr, f, "user.missing")
    assert_errno(errno.EEXIST, os.setxattr, f, "user.mime", b"x", os.XATTR_CREATE)
    assert_errno(errno.ENODATA, os.setxattr, f, "user.new", b"x", os.XATTR_REPLACE)
    assert_errno(errno.ERANGE, os.setxattr, f, "user." + "n" * 251, b"x")
    assert_errno(errno.EINVAL, os.setxattr, f, "user.", b"x")  # a namespace, no name: as ext4
    assert_errno(errno.EINVAL, os.getxattr, f, "user.")
    assert_errno(errno.EINVAL, os.removexattr, f, "user.")
    assert_errno(errno.E2BIG, os.setxattr, f, "user.huge", bytes(65537))
    os.setxattr(f, "user.mime", b"application/json", os.XATTR_REPLACE)
    os.setxattr(f, "user.created", b"c", os.XATTR_CREATE)
    os.setxattr(f, "user.gone", b"bye")
    os.removexattr(f, "user.gone")
    expected = {
        "user.mime": b"application/json",
        "user.empty": b"",
        "user.binary": b"\0\xff\0",
        "user.big": big,
        long_name: b"long",
        "user.created": b"c",
    }

    def check() -> None:
        assert sorted(os.listxattr(f)) == sorted(expected)
        for name, value in expected.items():
            assert os.getxattr(f, name) == value
        assert os.listxattr(d) == ["user.on-dir"]
        assert os.getxattr(d, "user.on-dir") == b"yes"
        assert_errno(errno.ENODATA, os.getxattr, f, "user.gone")

    check()
    remount(mounted_env)
    check()
    os.removexattr(f, "user.big")
    remount(mounted_env)
    assert "user.big" not in os.listxattr(f)


def test_xattrs_outside_the_linux_namespaces_are_refused(mounted_env: VolumeEnv) -> None:
    """Regression: any name was stored. The kernel leaves system.* names wholly to a FUSE
    daemon and checks no permission for them, so on an --allow-other mount any user who
    could see a file could set and remove them on it. ext4 refuses them: EOPNOTSUPP."""
    f = mounted_env.mnt / "f"
    f.write_bytes(b"")
    for name in ("system.x", "system.nfs4_acl", "other.x", "no-namespace"):
        assert_errno(errno.EOPNOTSUPP, os.setxattr, f, name, b"v")
        assert_errno(errno.EOPNOTSUPP, os.getxattr, f, name)
        assert_errno(errno.EOPNOTSUPP, os.removexattr, f, name)
    # trusted.* and security.* need CAP_SYS_ADMIN, which the kernel checks.
    names = ["user.x", *(["trusted.x", "security.x"] if os.geteuid() == 0 else [])]
    for name in names:
        os.setxattr(f, name, b"v")
    remount(mounted_env)
    assert sorted(os.listxattr(f)) == sorted(names)
    assert all(os.getxattr(f, name) == b"v" for name in names)


def test_xattr_change_updates_ctime(mounted_env: VolumeEnv) -> None:
    f = mounted_env.mnt / "f"
    f.write_bytes(b"x")
    before = os.stat(f)
    os.setxattr(f, "user.k", b"v")
    after = os.stat(f)
    assert after.st_ctime_ns > before.st_ctime_ns
    assert after.st_mtime_ns == before.st_mtime_ns


def test_posix_acl_restating_the_mode_is_a_chmod(mounted_env: VolumeEnv) -> None:
    """cp -a sets modes with such an ACL and chmods only when it is refused: applying it as
    a chmod (as ext4 does; nothing is stored) saves a request per copied file."""
    script = mounted_env.mnt / "script"
    script.write_text("#!/bin/sh\nexit 0\n")
    os.chmod(script, 0o755)
    subprocess.run([script], check=True)
    os.setxattr(script, "system.posix_acl_access", mode_acl(0o644))
    with pytest.raises(PermissionError):  # even root needs an x bit: the kernel saw 0644
        subprocess.run([script], check=False)
    f = mounted_env.mnt / "f"
    f.write_bytes(b"")
    os.chmod(f, 0o600)
    before = os.stat(f)
    os.setxattr(f, "system.posix_acl_access", mode_acl(0o640))
    after = os.stat(f)
    assert after.st_mode == stat.S_IFREG | 0o640  # at once: the kernel's cached mode is gone
    assert after.st_ctime_ns > before.st_ctime_ns
    assert_errno(errno.ENODATA, os.getxattr, f, "system.posix_acl_access")
    assert os.listxattr(f) == []
    os.removexattr(f, "system.posix_acl_access")  # there is none to remove: as on ext4
    remount(mounted_env)
    assert os.stat(f).st_mode == stat.S_IFREG | 0o640


def test_posix_acls_beyond_the_mode_are_refused(mounted_env: VolumeEnv) -> None:
    """Regression: ACL xattrs were stored as plain xattrs, so cp -a took them as applied
    and left every copied file at its creation mode 0600. Those the mode cannot express
    still fail, so that programs fall back to chmod."""
    mnt = mounted_env.mnt
    f, d, sgid = mnt / "f", mnt / "d", mnt / "sgid"
    f.write_bytes(b"")
    os.chmod(f, 0o600)
    d.mkdir(mode=0o755)
    sgid.write_bytes(b"")
    os.chmod(sgid, 0o2750)
    assert_errno(errno.EOPNOTSUPP, os.setxattr, f, "system.posix_acl_access", NAMED_USER_ACL)
    assert_errno(errno.EOPNOTSUPP, os.setxattr, d, "system.posix_acl_default", mode_acl(0o700))
    # ext4 would clear S_ISGID for a caller outside the group; the daemon cannot tell.
    assert_errno(errno.EOPNOTSUPP, os.setxattr, sgid, "system.posix_acl_access", mode_acl(0))
    assert os.stat(f).st_mode == stat.S_IFREG | 0o600
    assert os.stat(sgid).st_mode == stat.S_IFREG | 0o2750
    assert os.listxattr(f) == os.listxattr(d) == []


def test_cp_a_keeps_modes(mounted_env: VolumeEnv, tmp_path: Path) -> None:
    src = tmp_path / "src"
    modes = {"plain": 0o644, "private": 0o600, "suid": 0o4755, "sgid-dir": 0o2750}
    src.mkdir()
    for name, mode in modes.items():
        path = src / name
        if name.endswith("-dir"):
            path.mkdir()
            (path / "inner").write_bytes(b"x")
            os.chmod(path / "inner", 0o640)
        else:
            path.write_bytes(b"data")
        os.chmod(path, mode)
    run("cp", "-a", src, mounted_env.mnt / "copy")
    for _ in range(2):
        for name, mode in modes.items():
            assert stat.S_IMODE(os.stat(mounted_env.mnt / "copy" / name).st_mode) == mode, name
        assert stat.S_IMODE(os.stat(mounted_env.mnt / "copy/sgid-dir/inner").st_mode) == 0o640
        remount(mounted_env)


# -- whole volume and special nodes ------------------------------------------------------


def host_free_bytes(path: Path) -> int:
    host = os.statvfs(path)
    return host.f_bavail * host.f_frsize


def test_statvfs_is_sane(mounted_env: VolumeEnv) -> None:
    vfs = os.statvfs(mounted_env.mnt)
    assert vfs.f_namemax == 255
    assert vfs.f_bsize > 0
    assert vfs.f_frsize > 0
    assert 0 < vfs.f_bavail <= vfs.f_bfree <= vfs.f_blocks
    assert 0 < vfs.f_ffree <= vfs.f_files
    # The volume's free space is its store's file system's, in whole blocks. Anything
    # else writing to that file system moves it between two statvfs calls: take the
    # volume's figure between two equal ones of the host (a quiet moment).
    deadline = time.monotonic() + 60
    while True:
        before = host_free_bytes(mounted_env.store)
        free = os.statvfs(mounted_env.mnt).f_bavail * vfs.f_frsize
        if before == host_free_bytes(mounted_env.store):
            break
        assert time.monotonic() < deadline, "the store's file system never stood still"
        time.sleep(0.01)
    assert free == before - before % vfs.f_frsize  # the store's file system, in blocks
    with open(mounted_env.mnt / "blob", "wb") as f:
        f.write(os.urandom(4 * MiB))
        f.flush()
        os.fsync(f.fileno())  # syncfs(2) never reaches a /dev/fuse file system
    vfs2 = os.statvfs(mounted_env.mnt)
    used = (vfs.f_blocks - vfs.f_bfree) * vfs.f_frsize
    used2 = (vfs2.f_blocks - vfs2.f_bfree) * vfs2.f_frsize
    assert used2 - used >= 4 * MiB  # random data does not compress
    assert vfs2.f_files - vfs2.f_ffree > vfs.f_files - vfs.f_ffree


def test_fifo_and_unix_socket_nodes(mounted_env: VolumeEnv) -> None:
    mnt = mounted_env.mnt
    fifo = mnt / "fifo"
    os.mkfifo(fifo, 0o640)
    assert os.stat(fifo).st_mode == stat.S_IFIFO | 0o640
    # The pipe itself is the kernel's: both ends open without blocking.
    fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
    try:
        os.write(fd, b"through the pipe")
        assert os.read(fd, 100) == b"through the pipe"
    finally:
        os.close(fd)
    sock_path = mnt / "sock"
    with bound_unix_socket(sock_path) as server:
        assert stat.S_ISSOCK(os.stat(sock_path).st_mode)
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.settimeout(5)
        try:
            with contextlib.chdir(mnt):
                client.connect("sock")
            conn, _ = server.accept()
            with conn:
                client.sendall(b"ping")
                assert conn.recv(4) == b"ping"
        finally:
            client.close()
    os.mknod(mnt / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    assert_errno(errno.EEXIST, os.mkfifo, fifo)
    remount(mounted_env)
    assert os.stat(fifo).st_mode == stat.S_IFIFO | 0o640
    assert stat.S_ISSOCK(os.stat(sock_path).st_mode)
    st = os.stat(mnt / "null")
    assert stat.S_ISCHR(st.st_mode)
    assert st.st_rdev == os.makedev(1, 3)
    assert sorted(os.listdir(mnt)) == ["fifo", "null", "sock"]
    os.unlink(sock_path)
    os.unlink(fifo)
    assert os.listdir(mnt) == ["null"]


def test_name_length_limits(mounted_env: VolumeEnv) -> None:
    mnt = mounted_env.mnt
    longest = "n" * 255
    too_long = "n" * 256
    (mnt / longest).write_bytes(b"ok")
    (mnt / ("d" * 255)).mkdir()
    os.symlink("target", mnt / ("s" * 255))
    assert_errno(errno.ENAMETOOLONG, os.open, mnt / too_long, os.O_CREAT | os.O_WRONLY)
    assert_errno(errno.ENAMETOOLONG, os.mkdir, mnt / too_long)
    assert_errno(errno.ENAMETOOLONG, os.stat, mnt / too_long)
    assert_errno(errno.ENAMETOOLONG, os.symlink, "t", mnt / too_long)
    assert_errno(errno.ENAMETOOLONG, os.rename, mnt / longest, mnt / too_long)
    assert_errno(errno.ENAMETOOLONG, os.link, mnt / longest, mnt / too_long)
    # Multi-byte characters count in bytes: 128 two-byte letters are 256 bytes.
    assert_errno(errno.ENAMETOOLONG, os.mkdir, mnt / ("é" * 128))
    (mnt / ("é" * 127)).write_bytes(b"")
    remount(mounted_env)
    assert (mnt / longest).read_bytes() == b"ok"
    assert sorted(os.listdir(mnt)) == sorted([longest, "d" * 255, "s" * 255, "é" * 127])


def test_non_utf8_byte_names(mounted_env: VolumeEnv) -> None:
    mnt = os.fsencode(mounted_env.mnt)
    names = [b"\xff\xfe", b"latin1-\xe9t\xe9", b"\x80", b"tab\there", b"new\nline", b" "]
    for name in names:
        with open(os.path.join(mnt, name), "wb") as f:
            f.write(name)
    os.mkdir(os.path.join(mnt, b"dir-\xc3\x28"))
    os.rename(os.path.join(mnt, b"\x80"), os.path.join(mnt, b"dir-\xc3\x28", b"\x81"))
    expected = sorted([*(n for n in names if n != b"\x80"), b"dir-\xc3\x28"])

    def check() -> None:
        assert listing(mnt) == expected
        for name in names:
            if name != b"\x80":
                assert pread_all(os.path.join(mnt, name)) == name
        assert pread_all(os.path.join(mnt, b"dir-\xc3\x28", b"\x81")) == b"\x80"

    check()
    remount(mounted_env)
    check()


def test_unlinked_open_file_stays_usable_until_closed(mounted_env: VolumeEnv) -> None:
    mnt = mounted_env.mnt
    inodes_before = mounted_env.status()["inodes"]
    path = mnt / "tmp"
    data = os.urandom(2 * MiB)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.write(fd, data)
        os.unlink(path)
        assert not path.exists()
        assert listing(mnt) == []
        assert os.fstat(fd).st_nlink == 0
        assert os.pread(fd, len(data) + 10, 0) == data
        os.pwrite(fd, b"more", len(data))
        os.fsync(fd)  # a commit while the file is an orphan
        assert os.pread(fd, 10, len(data)) == b"more"
        assert os.fstat(fd).st_size == len(data) + 4
        # The name is free again, for a different file.
        path.write_bytes(b"new file")
        assert os.fstat(fd).st_ino != os.stat(path).st_ino
        assert os.pread(fd, 4, len(data)) == b"more"
    finally:
        os.close(fd)
    assert path.read_bytes() == b"new file"
    remount(mounted_env)
    assert listing(mnt) == [b"tmp"]
    assert path.read_bytes() == b"new file"
    assert mounted_env.status()["inodes"] == inodes_before + 1  # the orphan is gone


def test_orphan_left_by_a_crash_is_gone_after_the_next_mount(mounted_env: VolumeEnv) -> None:
    """A file unlinked while open, when the daemon dies, must not live on in the volume."""
    mnt = mounted_env.mnt
    inodes_before = mounted_env.status()["inodes"]
    path = mnt / "orphan"
    f = open(path, "w+b", buffering=0)  # noqa: SIM115
    try:
        f.write(b"x" * 100_000)
        os.unlink(path)
        os.fsync(f.fileno())  # the orphan (nlink 0) is committed
        mounted_env.kill()
    finally:
        with contextlib.suppress(OSError):
            f.close()
    mounted_env.mount()
    assert listing(mnt) == []
    assert mounted_env.status()["inodes"] == inodes_before
    remount(mounted_env)
    assert mounted_env.status()["inodes"] == inodes_before


# -- everything at once, across a remount ------------------------------------------------


def build_tree(root: Path) -> None:
    """A small tree holding one of each thing a volume stores."""
    rnd = random.Random(1234)
    root.mkdir()
    (root / "empty").write_bytes(b"")
    (root / "small").write_bytes(b"hello\n")
    (root / "medium").write_bytes(rnd.randbytes(200_000))
    (root / "big").write_bytes(rnd.randbytes(3 * MiB))
    (root / "untimed").write_bytes(b"times left as the write set them")
    with open(root / "sparse", "wb") as f:
        f.write(b"head")
        f.seek(40 * MiB)  # small enough to hash; test_sparse_file_beyond_4_gib goes further
        f.write(b"tail")
    deeper = root / "dir" / "sub" / "deeper"
    deeper.mkdir(parents=True)
    (deeper / "leaf").write_bytes(b"leaf")
    os.symlink("dir/sub/deeper/leaf", root / "rel-link")
    os.symlink("/nonexistent/target", root / "dangling")
    os.symlink("dir", root / "dir-link")
    os.link(root / "small", root / "dir" / "small-hardlink")
    os.mkfifo(root / "fifo", 0o640)
    with bound_unix_socket(root / "sock"):
        pass
    os.mknod(root / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    raw = os.fsencode(root)
    with open(os.path.join(raw, b"\xff\xfe-bytes-\xe9"), "wb") as f:
        f.write(b"non-utf8 name")
    (root / ("L" * 255)).write_bytes(b"long name")
    os.setxattr(root / "small", "user.mime", b"text/plain")
    os.setxattr(root / "medium", "user.big", rnd.randbytes(65536))
    os.setxattr(root / "medium", "user.empty", b"")
    os.setxattr(root / "dir", "user.on-dir", b"\0\1\2")
    os.chown(root / "medium", 1000, 1001)
    os.lchown(root / "rel-link", 1002, 1003)
    os.chmod(root / "medium", 0o600)
    os.chmod(root / "big", 0o4755)
    os.chmod(root / "dir", 0o750)
    os.chmod(deeper, 0o1777)
    # Times last, leaves before their directories (creating a child changes them).
    stamp = 1_600_000_000_000_000_000
    for k, rel in enumerate(
        ["empty", "small", "medium", "big", "sparse", "dir/sub/deeper/leaf", "rel-link",
         "dangling", "fifo", "sock", "null", "L" * 255,
         "dir/sub/deeper", "dir/sub", "dir"]
    ):  # fmt: skip
        os.utime(root / rel, ns=(stamp + k * 1_000_000_007, stamp + k * 999_999_937 + 1),
                 follow_symlinks=False)  # fmt: skip
    os.utime(root, ns=(stamp - 1, stamp - 3))


def test_tree_manifest_survives_remount(mounted_env: VolumeEnv) -> None:
    root = mounted_env.mnt / "tree"
    build_tree(root)
    before = manifest(root)
    # The manifest saw what the tree holds (guards against a vacuous comparison).
    assert before[b"medium"]["mode"] == stat.S_IFREG | 0o600
    assert (before[b"medium"]["uid"], before[b"medium"]["gid"]) == (1000, 1001)
    assert len(before[b"medium"]["xattrs"]["user.big"]) == 65536
    assert before[b"big"]["mode"] == stat.S_IFREG | 0o4755
    assert before[b"small"]["links"] == [b"dir/small-hardlink", b"small"]
    assert before[b"rel-link"]["target"] == b"dir/sub/deeper/leaf"
    assert stat.S_ISSOCK(before[b"sock"]["mode"])
    assert stat.S_ISFIFO(before[b"fifo"]["mode"])
    assert before[b"null"]["rdev"] == os.makedev(1, 3)
    assert before[b"sparse"]["size"] == 40 * MiB + 4
    assert before[b"dir"]["mtime_ns"] == 1_600_000_000_000_000_000 + 14 * 999_999_937 + 1
    assert before[b""]["mtime_ns"] == 1_600_000_000_000_000_000 - 3
    assert before[b"dir"]["nlink"] == 3
    assert b"\xff\xfe-bytes-\xe9" in before
    remount(mounted_env)
    after = manifest(root)
    assert after == before
    remount(mounted_env)
    assert manifest(root) == before


def test_an_open_with_o_trunc_never_cuts_another_thread_s_write_in_two(
    mounted_env: VolumeEnv,
) -> None:
    """The kernel sends a write(2) that begins inside a page in more than one request.
    With libfuse's default atomic_o_trunc, an open with O_TRUNC truncated in the daemon
    without waiting for that write, so it could land between two of its requests: 10 KB
    written at offset 100 left zeros up to 4096 and its rest after them in 20 of 100
    rounds. ext4 orders the two, as the mount now does (sealfs.fuse.conncaps)."""
    path = mounted_env.mnt / "truncated"
    written = b"w" * 10_000
    whole = {b"", b"h" * 100 + written, bytes(100) + written}  # as ext4 leaves it
    rounds, start, done = 100, threading.Barrier(2), threading.Barrier(2)

    def write_each_round() -> None:
        for _ in range(rounds):
            start.wait()
            fd = os.open(path, os.O_WRONLY)
            try:
                os.pwrite(fd, written, 100)
            finally:
                os.close(fd)
            done.wait()

    writer = threading.Thread(target=write_each_round, daemon=True)
    writer.start()
    rng = random.Random(3)
    cut = []
    for k in range(rounds):
        path.write_bytes(b"h" * 100)
        start.wait(timeout=30)
        time.sleep(rng.random() * 0.0005)
        os.close(os.open(path, os.O_WRONLY | os.O_TRUNC))
        done.wait(timeout=30)
        content = path.read_bytes()
        if content not in whole:
            cut.append((k, len(content), content.count(0), content.find(b"w")))
    writer.join(30)
    assert cut == [], f"{len(cut)} of {rounds} rounds cut (round, size, zeros, first written byte)"
