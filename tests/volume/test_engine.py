"""POSIX semantics of the Volume engine on the memory store, with exact errnos.

Every scenario ends by unmounting and loading the volume again from the store:
the replayed state must equal the live state the engine showed.
"""

from __future__ import annotations

import errno
import os
import stat
import tracemalloc
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any

import pytest

from sealfs.errors import FsError
from sealfs.keys.slots import Passphrase, Unlocked
from sealfs.meta import ops
from sealfs.meta.model import ROOT_INO, MetaState
from sealfs.store.base import ObjectStore
from sealfs.volume import loader
from sealfs.volume.engine import RENAME_EXCHANGE, RENAME_NOREPLACE, Volume
from sealfs.volume.loader import open_volume
from sealfs.volume.xattrs import XATTR_CREATE, XATTR_REPLACE, XATTR_TOTAL_MAX
from tests.acls import NAMED_USER_ACL, mode_acl
from tests.conftest import PASSPHRASE, mounted
from tests.meta.test_codec import inode_signature

UID, GID = os.getuid(), os.getgid()
R, W, RW = os.O_RDONLY, os.O_WRONLY, os.O_RDWR

# -- helpers shared by the volume tests -----------------------------------------------------


def install_cached_unlock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unlock each header once per test: the Argon2 run dominates a remount otherwise."""
    real = loader.unlock
    cache: dict[bytes, Unlocked] = {}

    def unlock(header_bytes: bytes, secret: Any) -> Unlocked:
        if header_bytes not in cache:
            cache[header_bytes] = real(header_bytes, secret)
        return cache[header_bytes]

    monkeypatch.setattr(loader, "unlock", unlock)


@pytest.fixture(autouse=True)
def _cached_unlock(monkeypatch: pytest.MonkeyPatch) -> None:
    install_cached_unlock(monkeypatch)


def meta_signature(state: MetaState) -> dict[str, Any]:
    """The tree, attributes, extents and chunk table (not the log head, which the
    live state does not track)."""
    return {
        "next_ino": state.next_ino,
        "writer": state.writer,
        "chunks": dict(state.chunks),
        "inodes": {ino: inode_signature(inode) for ino, inode in state.inodes.items()},
    }


def load(store: ObjectStore) -> MetaState:
    return open_volume(store, Passphrase(PASSPHRASE)).live


def assert_replay_equals_live(store: ObjectStore, volume: Volume) -> None:
    state = load(store)
    assert meta_signature(state) == meta_signature(volume.meta)
    assert state.generation == volume.commits.generation


@asynccontextmanager
async def session(store: ObjectStore, **options: Any) -> AsyncIterator[Volume]:
    """mounted(), then a check that a fresh load from the store equals the live state."""
    async with mounted(store, **options) as volume:
        yield volume
    assert_replay_equals_live(store, volume)


async def expect(err: int, call: Awaitable[Any]) -> None:
    with pytest.raises(FsError) as info:
        await call
    assert info.value.errno == err, (errno.errorcode[info.value.errno], errno.errorcode[err])


async def ino_of(volume: Volume, path: str) -> int:
    ino = ROOT_INO
    for part in path.strip("/").split("/"):
        if part:
            ino = (await volume.lookup(ino, part.encode())).ino
    return ino


async def mkfile(
    volume: Volume, parent: int, name: bytes, data: bytes = b"", mode: int = 0o644
) -> int:
    fh, attr = await volume.create(parent, name, mode, W, UID, GID)
    if data:
        await volume.write(fh, 0, data)
    await volume.release(fh)
    return attr.ino


async def mkdir(volume: Volume, parent: int, name: bytes, mode: int = 0o755) -> int:
    return (await volume.mkdir(parent, name, mode, UID, GID)).ino


async def read_all(volume: Volume, ino: int) -> bytes:
    fh = await volume.open(ino, R)
    try:
        return await volume.read(fh, 0, volume.inode(ino).size + 10)
    finally:
        await volume.release(fh)


async def write_at(volume: Volume, ino: int, offset: int, data: bytes) -> None:
    fh = await volume.open(ino, W)
    await volume.write(fh, offset, data)
    await volume.release(fh)


async def names(volume: Volume, ino: int) -> list[bytes]:
    fh = await volume.opendir(ino)
    try:
        return [e.name for e in await volume.readdir(fh, 0)]
    finally:
        await volume.releasedir(fh)


async def forget_all(volume: Volume) -> None:
    """What the kernel does on unmount or memory pressure: drop every reference."""
    await volume.forget(list(volume._lookups.items()))


def nlink(volume: Volume, ino: int) -> int:
    return volume.inode(ino).nlink


# -- creating and looking up --------------------------------------------------------------


async def test_create_lookup_and_eexist(volume_store: ObjectStore) -> None:
    async with session(volume_store) as v:
        ino = await mkfile(v, ROOT_INO, b"a", b"hello")
        attr = await v.lookup(ROOT_INO, b"a")
        assert attr.ino == ino and attr.size == 5 and stat.S_ISREG(attr.mode)
        assert stat.S_IMODE(attr.mode) == 0o644 and attr.nlink == 1
        await expect(errno.EEXIST, v.create(ROOT_INO, b"a", 0o644, W, UID, GID))
        await expect(errno.EEXIST, v.mkdir(ROOT_INO, b"a", 0o755, UID, GID))
        await expect(errno.EEXIST, v.symlink(ROOT_INO, b"a", b"t", UID, GID))
        await expect(errno.EEXIST, v.mknod(ROOT_INO, b"a", stat.S_IFIFO | 0o600, 0, UID, GID))
        await expect(errno.ENOENT, v.lookup(ROOT_INO, b"missing"))
        await expect(errno.ENOTDIR, v.lookup(ino, b"x"))
        await expect(errno.ENOTDIR, v.create(ino, b"x", 0o644, W, UID, GID))
        await expect(errno.ENOENT, v.getattr(12345))
        assert await read_all(v, ino) == b"hello"
        assert await names(v, ROOT_INO) == [b"a"]
    async with session(volume_store) as v:
        assert await read_all(v, await ino_of(v, "a")) == b"hello"


async def test_name_rules(volume_store: ObjectStore) -> None:
    async with session(volume_store) as v:
        ok, long = b"n" * 255, b"n" * 256
        d = await mkdir(v, ROOT_INO, b"d")
        await mkfile(v, ROOT_INO, ok)
        assert (await v.lookup(ROOT_INO, ok)).ino
        await expect(errno.ENAMETOOLONG, v.create(ROOT_INO, long, 0o644, W, UID, GID))
        await expect(errno.ENAMETOOLONG, v.mkdir(ROOT_INO, long, 0o755, UID, GID))
        await expect(errno.ENAMETOOLONG, v.symlink(ROOT_INO, long, b"t", UID, GID))
        await expect(errno.ENAMETOOLONG, v.lookup(ROOT_INO, long))
        await expect(errno.ENAMETOOLONG, v.unlink(ROOT_INO, long))
        await expect(errno.ENAMETOOLONG, v.rmdir(ROOT_INO, long))
        await expect(errno.ENAMETOOLONG, v.rename(ROOT_INO, ok, ROOT_INO, long))
        await expect(errno.ENAMETOOLONG, v.rename(ROOT_INO, long, ROOT_INO, b"x"))
        await expect(errno.ENAMETOOLONG, v.link(await ino_of(v, ok.decode()), d, long))
        await expect(errno.ENAMETOOLONG, v.symlink(ROOT_INO, b"s", b"t" * 4096, UID, GID))
        await v.symlink(ROOT_INO, b"s", b"t" * 4095, UID, GID)
        for bad in (b"", b".", b"..", b"a/b", b"a\0b"):
            await expect(errno.EINVAL, v.create(ROOT_INO, bad, 0o644, W, UID, GID))
        assert sorted(await names(v, ROOT_INO)) == sorted([b"d", ok, b"s"])


async def test_mknod_types(volume_store: ObjectStore) -> None:
    async with session(volume_store) as v:
        fifo = await v.mknod(ROOT_INO, b"fifo", stat.S_IFIFO | 0o640, 0, UID, GID)
        assert stat.S_ISFIFO(fifo.mode)
        dev = await v.mknod(ROOT_INO, b"dev", stat.S_IFCHR | 0o600, 0x0103, UID, GID)
        assert dev.rdev == 0x0103
        await expect(errno.EINVAL, v.mknod(ROOT_INO, b"d", stat.S_IFDIR | 0o755, 0, UID, GID))
        await expect(errno.EINVAL, v.mknod(ROOT_INO, b"l", stat.S_IFLNK | 0o777, 0, UID, GID))
        fh = await v.open(fifo.ino, R)
        await expect(errno.EINVAL, v.read(fh, 0, 10))
        await v.release(fh)


# -- removing -----------------------------------------------------------------------------


async def test_unlink_and_rmdir_errors(volume_store: ObjectStore) -> None:
    async with session(volume_store) as v:
        d = await mkdir(v, ROOT_INO, b"d")
        f = await mkfile(v, d, b"f", b"x")
        await expect(errno.ENOENT, v.unlink(ROOT_INO, b"nope"))
        await expect(errno.ENOENT, v.rmdir(ROOT_INO, b"nope"))
        await expect(errno.EISDIR, v.unlink(ROOT_INO, b"d"))
        await expect(errno.ENOTDIR, v.rmdir(d, b"f"))
        await expect(errno.ENOTEMPTY, v.rmdir(ROOT_INO, b"d"))
        await expect(errno.ENOTDIR, v.unlink(f, b"x"))
        assert nlink(v, ROOT_INO) == 3
        await v.unlink(d, b"f")
        await expect(errno.ENOENT, v.lookup(d, b"f"))
        assert nlink(v, f) == 0
        await v.rmdir(ROOT_INO, b"d")
        assert nlink(v, ROOT_INO) == 2
        await expect(errno.ENOENT, v.lookup(ROOT_INO, b"d"))
        await forget_all(v)
        assert f not in v.meta.inodes and d not in v.meta.inodes
        assert await names(v, ROOT_INO) == []


# -- rename -------------------------------------------------------------------------------


async def test_rename_files(volume_store: ObjectStore) -> None:
    async with session(volume_store) as v:
        d = await mkdir(v, ROOT_INO, b"d")
        a = await mkfile(v, ROOT_INO, b"a", b"AAA")
        b = await mkfile(v, ROOT_INO, b"b", b"BB")
        await v.rename(ROOT_INO, b"a", ROOT_INO, b"a2")
        assert await names(v, ROOT_INO) == [b"a2", b"b", b"d"]
        await v.rename(ROOT_INO, b"a2", d, b"a")
        assert await ino_of(v, "d/a") == a
        # over an existing file: the victim loses its name
        await v.rename(ROOT_INO, b"b", d, b"a")
        assert await ino_of(v, "d/a") == b
        assert await read_all(v, b) == b"BB"
        assert nlink(v, a) == 0
        await expect(errno.ENOENT, v.rename(ROOT_INO, b"b", ROOT_INO, b"c"))
        await expect(errno.ENOENT, v.rename(12345, b"b", ROOT_INO, b"c"))
        await expect(errno.ENOTDIR, v.rename(b, b"b", ROOT_INO, b"c"))
        # onto itself: nothing happens
        await v.rename(d, b"a", d, b"a")
        assert await ino_of(v, "d/a") == b and nlink(v, b) == 1
        await forget_all(v)
        assert a not in v.meta.inodes


async def test_rename_between_hard_links_does_nothing(volume_store: ObjectStore) -> None:
    async with session(volume_store) as v:
        f = await mkfile(v, ROOT_INO, b"f", b"x")
        await v.link(f, ROOT_INO, b"g")
        await v.rename(ROOT_INO, b"f", ROOT_INO, b"g")
        assert await names(v, ROOT_INO) == [b"f", b"g"]
        assert nlink(v, f) == 2
        await expect(errno.EEXIST, v.rename(ROOT_INO, b"f", ROOT_INO, b"g", RENAME_NOREPLACE))


async def test_rename_type_conflicts(volume_store: ObjectStore) -> None:
    async with session(volume_store) as v:
        await mkdir(v, ROOT_INO, b"d")
        full = await mkdir(v, ROOT_INO, b"full")
        await mkfile(v, full, b"x")
        await mkdir(v, ROOT_INO, b"empty")
        await mkfile(v, ROOT_INO, b"f")
        await expect(errno.EISDIR, v.rename(ROOT_INO, b"f", ROOT_INO, b"d"))
        await expect(errno.ENOTDIR, v.rename(ROOT_INO, b"d", ROOT_INO, b"f"))
        await expect(errno.ENOTEMPTY, v.rename(ROOT_INO, b"d", ROOT_INO, b"full"))
        assert nlink(v, ROOT_INO) == 5
        await v.rename(ROOT_INO, b"d", ROOT_INO, b"empty")  # over an empty directory
        assert nlink(v, ROOT_INO) == 4
        assert sorted(await names(v, ROOT_INO)) == [b"empty", b"f", b"full"]


async def test_rename_flags(volume_store: ObjectStore) -> None:
    async with session(volume_store) as v:
        a = await mkfile(v, ROOT_INO, b"a", b"A")
        b = await mkfile(v, ROOT_INO, b"b", b"B")
        await expect(errno.EEXIST, v.rename(ROOT_INO, b"a", ROOT_INO, b"b", RENAME_NOREPLACE))
        await v.rename(ROOT_INO, b"a", ROOT_INO, b"c", RENAME_NOREPLACE)
        await expect(errno.ENOENT, v.rename(ROOT_INO, b"c", ROOT_INO, b"zz", RENAME_EXCHANGE))
        await v.rename(ROOT_INO, b"c", ROOT_INO, b"b", RENAME_EXCHANGE)
        assert await ino_of(v, "b") == a and await ino_of(v, "c") == b
        both = RENAME_NOREPLACE | RENAME_EXCHANGE
        await expect(errno.EINVAL, v.rename(ROOT_INO, b"c", ROOT_INO, b"b", both))
        await expect(errno.EINVAL, v.rename(ROOT_INO, b"c", ROOT_INO, b"b", 4))
        assert nlink(v, a) == 1 and nlink(v, b) == 1


async def test_rename_exchange_file_and_directory_across_dirs(volume_store: ObjectStore) -> None:
    async with session(volume_store) as v:
        left = await mkdir(v, ROOT_INO, b"left")
        right = await mkdir(v, ROOT_INO, b"right")
        sub = await mkdir(v, left, b"sub")
        f = await mkfile(v, right, b"f", b"data")
        assert nlink(v, left) == 3 and nlink(v, right) == 2
        await v.rename(left, b"sub", right, b"f", RENAME_EXCHANGE)
        assert await ino_of(v, "left/sub") == f and await ino_of(v, "right/f") == sub
        assert nlink(v, left) == 2 and nlink(v, right) == 3
        assert v.inode(sub).parent == right
        # the moved directory's new parent is what the subtree check walks
        await expect(errno.EINVAL, v.rename(ROOT_INO, b"right", sub, b"x"))
        await v.rename(ROOT_INO, b"left", sub, b"x")
        assert await ino_of(v, "right/f/x/sub") == f
        assert nlink(v, ROOT_INO) == 3 and nlink(v, sub) == 3


async def test_rename_into_own_subtree_is_einval(volume_store: ObjectStore) -> None:
    async with session(volume_store) as v:
        a = await mkdir(v, ROOT_INO, b"a")
        b = await mkdir(v, a, b"b")
        c = await mkdir(v, b, b"c")
        await expect(errno.EINVAL, v.rename(ROOT_INO, b"a", a, b"x"))
        await expect(errno.EINVAL, v.rename(ROOT_INO, b"a", c, b"x"))
        await expect(errno.EINVAL, v.rename(a, b"b", c, b"b"))
        await expect(errno.EINVAL, v.rename(ROOT_INO, b"a", c, b"x", RENAME_NOREPLACE))
        await expect(errno.EINVAL, v.rename(ROOT_INO, b"a", b, b"c", RENAME_EXCHANGE))
        await expect(errno.EINVAL, v.rename(b, b"c", ROOT_INO, b"a", RENAME_EXCHANGE))
        # moving a directory up is fine
        await v.rename(b, b"c", ROOT_INO, b"c")
        assert v.inode(c).parent == ROOT_INO
        assert nlink(v, ROOT_INO) == 4 and nlink(v, b) == 2


async def test_directory_nlink_after_mkdir_rmdir_and_rename(volume_store: ObjectStore) -> None:
    async with session(volume_store) as v:
        assert nlink(v, ROOT_INO) == 2
        d1 = await mkdir(v, ROOT_INO, b"d1")
        d2 = await mkdir(v, ROOT_INO, b"d2")
        assert nlink(v, ROOT_INO) == 4 and nlink(v, d1) == 2
        for k in range(3):
            await mkdir(v, d1, b"s%d" % k)
        await mkfile(v, d1, b"file")
        assert nlink(v, d1) == 5
        await v.rename(d1, b"s0", d2, b"s0")
        assert nlink(v, d1) == 4 and nlink(v, d2) == 3
        await v.rename(d1, b"s1", d2, b"s0")  # replaces the empty s0 in d2
        assert nlink(v, d1) == 3 and nlink(v, d2) == 3
        await v.rename(d1, b"s2", d1, b"s9")  # same directory
        assert nlink(v, d1) == 3
        await v.rename(d1, b"s9", d1, b"file", RENAME_EXCHANGE)
        assert nlink(v, d1) == 3
        await v.rmdir(d1, b"file")  # the directory now called "file"
        assert nlink(v, d1) == 2
        await expect(errno.ENOTDIR, v.rename(d2, b"s0", d1, b"s9"))  # s9 is now a file
        assert nlink(v, d1) == 2 and nlink(v, d2) == 3
        await v.rename(ROOT_INO, b"d2", d1, b"d2")
        assert nlink(v, ROOT_INO) == 3 and nlink(v, d1) == 3


# -- hard links ----------------------------------------------------------------------------


async def test_link_counts(volume_store: ObjectStore) -> None:
    async with session(volume_store) as v:
        d = await mkdir(v, ROOT_INO, b"d")
        f = await mkfile(v, ROOT_INO, b"f", b"shared")
        attr = await v.link(f, d, b"g")
        assert attr.nlink == 2
        await v.link(f, ROOT_INO, b"h")
        assert nlink(v, f) == 3
        await expect(errno.EEXIST, v.link(f, d, b"g"))
        await expect(errno.EPERM, v.link(d, ROOT_INO, b"dd"))
        await expect(errno.ENOENT, v.link(9999, ROOT_INO, b"zz"))
        await expect(errno.ENOTDIR, v.link(f, f, b"zz"))
        await write_at(v, await ino_of(v, "d/g"), 0, b"SH")
        assert await read_all(v, f) == b"SHared"
        await v.unlink(ROOT_INO, b"f")
        assert nlink(v, f) == 2
        await v.rename(ROOT_INO, b"h", d, b"g")  # same inode: nothing happens
        assert nlink(v, f) == 2
        await v.unlink(ROOT_INO, b"h")
        assert nlink(v, f) == 1
        assert await read_all(v, await ino_of(v, "d/g")) == b"SHared"


# -- attributes -----------------------------------------------------------------------------


async def test_setattr_size_down_and_up(volume_store: ObjectStore) -> None:
    async with session(volume_store) as v:
        f = await mkfile(v, ROOT_INO, b"f", b"0123456789")
        await v.setattr(f, size=4)
        assert await read_all(v, f) == b"0123"
        await v.setattr(f, size=8)
        assert await read_all(v, f) == b"0123" + bytes(4)
        await v.fsync()
        # now the same with committed (sealed) data underneath
        await v.setattr(f, size=2)
        await v.setattr(f, size=6)
        assert await read_all(v, f) == b"01" + bytes(4)
        await write_at(v, f, 10, b"Z")
        assert await read_all(v, f) == b"01" + bytes(8) + b"Z"
        await expect(errno.EISDIR, v.setattr(ROOT_INO, size=0))
        s = await v.symlink(ROOT_INO, b"s", b"t", UID, GID)
        await expect(errno.EINVAL, v.setattr(s.ino, size=0))
    async with session(volume_store) as v:
        assert await read_all(v, await ino_of(v, "f")) == b"01" + bytes(8) + b"Z"


async def test_setattr_mode_owner_times(volume_store: ObjectStore) -> None:
    async with session(volume_store) as v:
        f = await mkfile(v, ROOT_INO, b"f")
        attr = await v.setattr(
            f, mode=stat.S_IFDIR | 0o4711, uid=5, gid=6, atime_ns=111, mtime_ns=222
        )
        assert attr.mode == stat.S_IFREG | 0o4711  # the type never changes
        assert (attr.uid, attr.gid, attr.atime_ns, attr.mtime_ns) == (5, 6, 111, 222)
        assert attr.ctime_ns > 222


async def test_setattr_times_before_1970_and_past_the_format_range(
    volume_store: ObjectStore,
) -> None:
    """Negative times are kept; times the format cannot hold are clamped, as Linux clamps."""
    before_1970, far_future = -315_619_200_000_000_001, 32_503_680_000 * 10**9  # 1960, 3000
    async with session(volume_store) as v:
        f = await mkfile(v, ROOT_INO, b"f")
        attr = await v.setattr(f, atime_ns=far_future, mtime_ns=before_1970)
        assert (attr.atime_ns, attr.mtime_ns) == (ops.TIME_MAX_NS, before_1970)
        attr = await v.setattr(f, atime_ns=-(2**70))
        assert attr.atime_ns == ops.TIME_MIN_NS
    async with session(volume_store) as v:  # it was committed
        inode = v.inode(await ino_of(v, "f"))
        assert (inode.atime_ns, inode.mtime_ns) == (ops.TIME_MIN_NS, before_1970)


async def test_blocks_count_the_bytes_outside_holes(volume_store: ObjectStore) -> None:
    """st_blocks follows the data, buffered or stored, so du and cp see sparse files."""
    far = 1 << 30
    async with session(volume_store) as v:
        sparse = await mkfile(v, ROOT_INO, b"sparse")
        await write_at(v, sparse, far, b"x" * 5000)
        assert v.files.buffered_in(sparse) == 5000
        assert (await v.getattr(sparse)).blocks == 10  # 5000 bytes in 512-byte units
        await v.fsync()
        assert v.files.buffered_in(sparse) == 0
        assert (await v.getattr(sparse)).blocks == 10
        full = await mkfile(v, ROOT_INO, b"full", b"y" * 100_000)
        await v.fsync()
        await write_at(v, full, 0, b"z" * 100_000)  # buffered over stored: counted once
        assert (await v.getattr(full)).blocks == 196
        hole = await mkfile(v, ROOT_INO, b"hole")
        await v.setattr(hole, size=far)
        assert (await v.getattr(hole)).blocks == 1  # never 0 once not empty (GNU tar)
        await v.setattr(hole, size=0)
        assert (await v.getattr(hole)).blocks == 0
    async with session(volume_store) as v:  # from the log, and from a snapshot
        assert (await v.getattr(await ino_of(v, "sparse"))).blocks == 10
        await v.commits.snapshot()
    async with session(volume_store) as v:
        attrs = {e.name: e.attr.blocks for e in await v.readdir(await v.opendir(ROOT_INO), 0)}
        assert (attrs[b"sparse"], attrs[b"full"], attrs[b"hole"]) == (10, 196, 0)


async def test_open_with_o_trunc_and_append(volume_store: ObjectStore) -> None:
    async with session(volume_store) as v:
        f = await mkfile(v, ROOT_INO, b"f", b"abcdef")
        await v.fsync()
        fh = await v.open(f, W | os.O_TRUNC)
        assert v.inode(f).size == 0
        await v.write(fh, 0, b"xy")
        await v.release(fh)
        fh = await v.open(f, W | os.O_APPEND)
        await v.write(fh, 0, b"12")
        await v.release(fh)
        assert await read_all(v, f) == b"xy12"
        await expect(errno.EISDIR, v.open(ROOT_INO, R))
        await expect(errno.EBADF, v.read(999, 0, 1))
        await expect(errno.EBADF, v.write(999, 0, b"x"))


async def test_sparse_write_reads_zeros_in_the_hole(volume_store: ObjectStore) -> None:
    async with session(volume_store) as v:
        f = await mkfile(v, ROOT_INO, b"f")
        await write_at(v, f, 1 << 20, b"end")
        await write_at(v, f, 0, b"start")
        expected = b"start" + bytes((1 << 20) - 5) + b"end"
        assert await read_all(v, f) == expected
        await v.fsync()
        assert await read_all(v, f) == expected
        fh = await v.open(f, R)
        assert await v.read(fh, (1 << 20) + 1, 100) == b"nd"
        assert await v.read(fh, (1 << 20) + 10, 100) == b""
        await v.release(fh)


async def test_a_write_of_no_bytes_changes_nothing(volume_store: ObjectStore) -> None:
    """Regression (found by tests/spec/test_reader_differential.py): write() of no bytes
    set the size (past the end of the file) and the times in memory, but left nothing
    for a commit to record, so the file showed them until the next mount and lost them
    then. POSIX: a write of no bytes to a regular file has no other results."""
    async with session(volume_store) as v:
        f = await mkfile(v, ROOT_INO, b"f", b"data")
        await v.fsync()
        before = await v.getattr(f)
        await write_at(v, f, 100, b"")
        await write_at(v, f, 0, b"")
        assert await v.getattr(f) == before
        await v.fsync()
    async with session(volume_store) as v:
        assert await v.getattr(f) == before


async def test_setgid_directory_passes_its_group_on(volume_store: ObjectStore) -> None:
    async with session(volume_store) as v:
        d = await v.mkdir(ROOT_INO, b"d", 0o2775, UID, 4242)
        assert d.mode & stat.S_ISGID
        sub = await v.mkdir(d.ino, b"sub", 0o755, UID, 7)
        assert sub.gid == 4242 and sub.mode & stat.S_ISGID
        f = await mkfile(v, d.ino, b"f")
        assert v.inode(f).gid == 4242 and not v.inode(f).mode & stat.S_ISGID


# -- xattrs and symlinks ---------------------------------------------------------------------


async def test_xattrs(volume_store: ObjectStore) -> None:
    async with session(volume_store) as v:
        f = await mkfile(v, ROOT_INO, b"f")
        await v.setxattr(f, b"user.a", b"1")
        await v.setxattr(f, b"user.b", b"")
        assert await v.getxattr(f, b"user.a") == b"1"
        assert await v.getxattr(f, b"user.b") == b""
        assert await v.listxattr(f) == [b"user.a", b"user.b"]
        await expect(errno.EEXIST, v.setxattr(f, b"user.a", b"2", XATTR_CREATE))
        await expect(errno.ENODATA, v.setxattr(f, b"user.c", b"2", XATTR_REPLACE))
        await v.setxattr(f, b"user.a", b"2", XATTR_REPLACE)
        await v.setxattr(f, b"user.c", b"3", XATTR_CREATE)
        await expect(errno.ENODATA, v.getxattr(f, b"user.none"))
        await expect(errno.ENODATA, v.removexattr(f, b"user.none"))
        await expect(errno.ERANGE, v.setxattr(f, b"", b"x"))
        await expect(errno.ERANGE, v.setxattr(f, b"u" * 256, b"x"))
        await expect(errno.E2BIG, v.setxattr(f, b"user.big", b"x" * 65537))
        await v.setxattr(f, b"user." + b"u" * 250, b"x" * 65536)
        await v.removexattr(f, b"user.b")
        await v.setxattr(ROOT_INO, b"user.root", b"r")
        assert await v.listxattr(f) == sorted([b"user.a", b"user.c", b"user." + b"u" * 250])
    async with session(volume_store) as v:
        f = await ino_of(v, "f")
        assert await v.getxattr(f, b"user.a") == b"2"
        assert await v.getxattr(ROOT_INO, b"user.root") == b"r"
        await expect(errno.ENODATA, v.getxattr(f, b"user.b"))


async def test_trusted_xattr_names_are_listed_only_to_the_privileged(
    volume_store: ObjectStore,
) -> None:
    """Regression: trusted.* names were listed to every caller. ext4 lists them only to
    CAP_SYS_ADMIN, and the kernel answers an unprivileged getxattr of one with ENODATA,
    so rsync -X run by a user failed on every file root had marked (exit 23)."""
    async with session(volume_store) as v:
        f = await mkfile(v, ROOT_INO, b"f")
        for name in (b"user.u", b"trusted.t", b"security.s"):
            await v.setxattr(f, name, b"v")
        assert await v.listxattr(f) == [b"security.s", b"trusted.t", b"user.u"]
        assert await v.listxattr(f, privileged=False) == [b"security.s", b"user.u"]


async def test_xattr_names_stop_where_listxattr_could_no_longer_list_them(
    volume_store: ObjectStore,
) -> None:
    """Regression: names were accepted past the 64 KiB listxattr(2) returns at most, so
    listing them failed with E2BIG and cp -a silently copied none of the file's xattrs."""
    async with session(volume_store) as v:
        f = await mkfile(v, ROOT_INO, b"f")
        names = [b"user.%0250d" % k for k in range(65536 // 256)]  # 256 bytes listed each
        for name in names:
            await v.setxattr(f, name, b"v")
        await expect(errno.ENOSPC, v.setxattr(f, b"user.one-more", b"v"))
        await v.setxattr(f, names[0], b"replaced")  # replacing a value needs no room
        assert await v.listxattr(f) == names
        await v.removexattr(f, names[-1])
        await v.setxattr(f, b"user.one-more", b"v")


async def test_a_files_xattrs_stop_at_one_mebibyte_of_names_and_values(
    volume_store: ObjectStore,
) -> None:
    """Every snapshot and the daemon's memory hold all xattrs: one file took 128 MiB
    (2,000 values of 64 KiB) before their total was bounded. Past the bound a value
    that grows gets ENOSPC, as on a full ext4 inode; one that shrinks still fits."""
    async with session(volume_store) as v:
        f = await mkfile(v, ROOT_INO, b"f")
        full = b"x" * 65536
        names = [b"user.%02d" % k for k in range(15)]  # 15 * (7 + 65536) bytes
        for name in names:
            await v.setxattr(f, name, full)
        room = XATTR_TOTAL_MAX - 15 * (7 + 65536)
        await v.setxattr(f, b"user.last", b"y" * (room - 9))  # exactly full
        await expect(errno.ENOSPC, v.setxattr(f, b"user.z", b""))
        await expect(errno.ENOSPC, v.setxattr(f, b"user.last", b"y" * (room - 8)))
        await v.setxattr(f, names[0], b"small")  # shrinking needs no room
        await v.setxattr(f, b"user.z", b"now it fits")
        g = await mkfile(v, ROOT_INO, b"g")
        await v.setxattr(g, names[0], full)  # the bound is per file
    async with session(volume_store) as v:
        f = await ino_of(v, "f")
        assert await v.getxattr(f, b"user.z") == b"now it fits"
        assert await v.getxattr(f, names[1]) == full


async def test_access_acl_restating_the_mode_is_a_chmod(volume_store: ObjectStore) -> None:
    async with session(volume_store) as v:
        f = await mkfile(v, ROOT_INO, b"f")
        await v.setattr(f, mode=0o4600)
        before = v.inode(f).ctime_ns
        await v.setxattr(f, b"system.posix_acl_access", mode_acl(0o751))
        assert v.inode(f).mode == stat.S_IFREG | 0o4751  # special bits are not the ACL's
        assert v.inode(f).ctime_ns > before
        assert await v.listxattr(f) == []
        await expect(errno.ENODATA, v.getxattr(f, b"system.posix_acl_access"))
        await v.removexattr(f, b"system.posix_acl_access")  # never one to remove: as ext4
        await v.removexattr(f, b"system.posix_acl_default")
        await expect(errno.EOPNOTSUPP, v.setxattr(f, b"system.posix_acl_access", NAMED_USER_ACL))
        await expect(errno.EOPNOTSUPP, v.setxattr(f, b"system.posix_acl_access", b"\2\0\0\0"))
        await expect(errno.EOPNOTSUPP, v.setxattr(ROOT_INO, b"system.posix_acl_default",
                                                  mode_acl(0o755)))  # fmt: skip
        await v.setattr(f, mode=0o2750)  # ext4 might clear S_ISGID here; the daemon can't tell
        await expect(errno.EOPNOTSUPP, v.setxattr(f, b"system.posix_acl_access", mode_acl(0)))
        assert v.inode(f).mode == stat.S_IFREG | 0o2750
    async with session(volume_store) as v:
        assert v.inode(await ino_of(v, "f")).mode == stat.S_IFREG | 0o2750


async def test_symlinks(volume_store: ObjectStore) -> None:
    async with session(volume_store) as v:
        attr = await v.symlink(ROOT_INO, b"s", b"../some/where", UID, GID)
        assert stat.S_ISLNK(attr.mode) and attr.size == len(b"../some/where")
        assert await v.readlink(attr.ino) == b"../some/where"
        f = await mkfile(v, ROOT_INO, b"f")
        await expect(errno.EINVAL, v.readlink(f))
        await v.link(attr.ino, ROOT_INO, b"s2")  # hard links to symlinks are allowed
        assert nlink(v, attr.ino) == 2
    async with session(volume_store) as v:
        assert await v.readlink(await ino_of(v, "s2")) == b"../some/where"


# -- orphans ----------------------------------------------------------------------------------


async def test_orphan_is_readable_until_release_then_deleted_after_forget(
    volume_store: ObjectStore,
) -> None:
    async with session(volume_store) as v:
        fh, attr = await v.create(ROOT_INO, b"f", 0o644, RW, UID, GID)
        f = attr.ino
        await v.write(fh, 0, b"committed")
        await v.fsync()
        await v.write(fh, 9, b"+dirty")
        await v.unlink(ROOT_INO, b"f")
        await expect(errno.ENOENT, v.lookup(ROOT_INO, b"f"))
        assert nlink(v, f) == 0
        assert await v.read(fh, 0, 100) == b"committed+dirty"
        await v.write(fh, 15, b"!")
        await v.fsync()
        assert await v.read(fh, 0, 100) == b"committed+dirty!"
        await v.release(fh)
        assert f in v.meta.inodes  # the kernel still holds a lookup reference
        await v.forget([(f, 1)])
        assert f not in v.meta.inodes
        assert f not in v.files.files
        assert v.files.buffered_bytes == 0
    assert f not in load(volume_store).inodes


async def test_forget_before_release_keeps_the_orphan_open(volume_store: ObjectStore) -> None:
    async with session(volume_store) as v:
        fh, attr = await v.create(ROOT_INO, b"f", 0o644, RW, UID, GID)
        await v.write(fh, 0, b"data")
        await v.unlink(ROOT_INO, b"f")
        await v.forget([(attr.ino, 1)])
        assert await v.read(fh, 0, 10) == b"data"
        await v.release(fh)
        assert attr.ino not in v.meta.inodes
        assert v.files.buffered_bytes == 0


async def test_open_orphan_left_at_unmount_is_purged_at_next_mount(
    volume_store: ObjectStore,
) -> None:
    async with session(volume_store) as v:
        fh, attr = await v.create(ROOT_INO, b"f", 0o644, RW, UID, GID)
        await v.write(fh, 0, b"x" * 1000)
        await v.unlink(ROOT_INO, b"f")
    assert load(volume_store).inodes[attr.ino].nlink == 0
    async with session(volume_store) as v:
        assert attr.ino not in v.meta.inodes
    assert attr.ino not in load(volume_store).inodes


# -- read-only ---------------------------------------------------------------------------------


async def test_read_only_volume_refuses_changes_with_erofs(volume_store: ObjectStore) -> None:
    async with session(volume_store) as v:
        d = await mkdir(v, ROOT_INO, b"d")
        f = await mkfile(v, d, b"f", b"content")
        await v.setxattr(f, b"user.x", b"1")
    before = dict(volume_store.counts)  # type: ignore[attr-defined]
    async with mounted(volume_store, read_only=True) as v:
        assert await read_all(v, f) == b"content"
        erofs = errno.EROFS
        await expect(erofs, v.create(ROOT_INO, b"n", 0o644, W, UID, GID))
        await expect(erofs, v.mkdir(ROOT_INO, b"n", 0o755, UID, GID))
        await expect(erofs, v.mknod(ROOT_INO, b"n", stat.S_IFIFO | 0o644, 0, UID, GID))
        await expect(erofs, v.symlink(ROOT_INO, b"n", b"t", UID, GID))
        await expect(erofs, v.unlink(d, b"f"))
        await expect(erofs, v.rmdir(ROOT_INO, b"d"))
        await expect(erofs, v.rename(d, b"f", d, b"g"))
        await expect(erofs, v.link(f, d, b"g"))
        await expect(erofs, v.setattr(f, size=0))
        await expect(erofs, v.setattr(f, mode=0o600))
        await expect(erofs, v.setxattr(f, b"user.y", b"2"))
        await expect(erofs, v.removexattr(f, b"user.x"))
        await expect(erofs, v.open(f, W))
        await expect(erofs, v.open(f, RW | os.O_TRUNC))
        fh = await v.open(f, R)
        await expect(erofs, v.write(fh, 0, b"x"))
        await v.release(fh)
        await v.fsync()
        await v.forget([(f, 100)])
        assert f in v.meta.inodes
    after = dict(volume_store.counts)  # type: ignore[attr-defined]
    assert after.get("put", 0) == before.get("put", 0)
    assert after.get("put_if_absent", 0) == before.get("put_if_absent", 0)


# -- directories and statfs ---------------------------------------------------------------------


async def test_readdir_offsets_and_entries_removed_meanwhile(volume_store: ObjectStore) -> None:
    async with session(volume_store) as v:
        for k in range(5):
            await mkfile(v, ROOT_INO, b"f%d" % k)
        fh = await v.opendir(ROOT_INO)
        entries = await v.readdir(fh, 0)
        assert [e.name for e in entries] == [b"f%d" % k for k in range(5)]
        assert [e.next_index for e in entries] == [1, 2, 3, 4, 5]
        assert [e.name for e in await v.readdir(fh, 3)] == [b"f3", b"f4"]
        await v.unlink(ROOT_INO, b"f4")
        await forget_all(v)
        assert [e.name for e in await v.readdir(fh, 3)] == [b"f3"]
        await v.releasedir(fh)
        await expect(errno.EBADF, v.readdir(fh, 0))
        await expect(errno.ENOTDIR, v.opendir(await ino_of(v, "f0")))


async def test_readdir_serves_names_as_they_are_now_not_as_the_pass_began(
    volume_store: ObjectStore,
) -> None:
    """Regression: a pass served the names of its listing as they were when it began.
    The kernel makes a dentry of every readdirplus entry, so a name renamed away
    meanwhile came back pointing at the renamed inode (open(name, "w") then truncated
    it). Offsets stay those of the listing."""
    async with session(volume_store) as v:
        for k in range(6):
            await mkfile(v, ROOT_INO, b"f%d" % k, b"%d" % k)
        fh = await v.opendir(ROOT_INO)
        assert [e.name for e in await v.readdir(fh, 0, 2)] == [b"f0", b"f1"]
        await v.rename(ROOT_INO, b"f2", ROOT_INO, b"g2", 0)  # renamed away
        await v.rename(ROOT_INO, b"f5", ROOT_INO, b"f4", 0)  # f4 is now f5's inode
        await v.unlink(ROOT_INO, b"f3")
        rest = await v.readdir(fh, 2)
        assert [e.name for e in rest] == [b"f4"]
        assert rest[0].attr.ino == await ino_of(v, "f4")
        assert rest[0].next_index == 5
        await v.releasedir(fh)


async def test_a_directory_opened_again_resumes_at_an_offset_an_earlier_handle_gave(
    volume_store: ObjectStore,
) -> None:
    """Regression: a handle whose first readdir did not start at offset 0 read nothing:
    only a pass from 0 took the listing. A program that kept a position (telldir, or
    a d_off), closed the directory and opened it again to resume there, as ext4's
    cookies allow, was told the directory ended (10,002 entries: 20 read, 0 resumed)."""
    async with session(volume_store) as v:
        for k in range(6):
            await mkfile(v, ROOT_INO, b"f%d" % k)
        fh = await v.opendir(ROOT_INO)
        offset = (await v.readdir(fh, 0, 2))[-1].next_index
        await v.releasedir(fh)
        again = await v.opendir(ROOT_INO)
        assert [e.name for e in await v.readdir(again, offset)] == [b"f2", b"f3", b"f4", b"f5"]
        await v.releasedir(again)
        await forget_all(v)


async def test_open_listings_of_an_unchanged_directory_share_one_copy_of_its_names(
    volume_store: ObjectStore,
) -> None:
    """Regression: every pass of readdir kept a sorted copy of all the directory's names
    while its handle stayed open: 500 handles on a directory of 200,000 entries, each
    with one page read, held 770 MB of the daemon's memory (ext4 holds nothing). Passes
    that begin while the directory is unchanged now share one listing."""
    async with session(volume_store) as v:
        d = await mkdir(v, ROOT_INO, b"d")
        for k in range(5000):
            await v.mknod(d, b"f%05d" % k, stat.S_IFREG | 0o644, 0, UID, GID)
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            handles = [await v.opendir(d) for _ in range(100)]
            for fh in handles:
                assert [e.name for e in await v.readdir(fh, 0, 2)] == [b"f00000", b"f00001"]
            held = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert held < 10 * 5000 * 8  # ten listings' worth at most (one each took 100)
        await v.mknod(d, b"a-new-name", stat.S_IFREG | 0o644, 0, UID, GID)
        await v.unlink(d, b"f00000")
        fresh = await v.opendir(d)  # a pass that begins after a change sees it
        assert [e.name for e in await v.readdir(fresh, 0, 2)] == [b"a-new-name", b"f00001"]
        # A pass that began before goes on with its own listing, names looked up again.
        assert [e.name for e in await v.readdir(handles[0], 0 + 2, 1)] == [b"f00002"]
        for fh in [*handles, fresh]:
            await v.releasedir(fh)
        await forget_all(v)


async def test_statfs(volume_store: ObjectStore) -> None:
    async with session(volume_store) as v:
        await mkfile(v, ROOT_INO, b"f", os.urandom(100_000))
        await v.fsync()
        st = await v.statfs()
        assert st.name_max == 255
        assert st.blocks - st.blocks_free >= 100_000 // st.block_size
