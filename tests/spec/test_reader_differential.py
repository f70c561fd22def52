"""The clean-room reader as an oracle of the engine, on random histories.

tests/spec/test_reader.py compares the reader with one volume grown through
FUSE; here hypothesis drives the engine itself (no FUSE, so examples are
cheap) on a local store through random histories: writes of every size and
kind at random offsets (inside a chunk, at the end, far past it), truncation
both ways, names created, linked, renamed (over others, across directories,
exchanged) and removed, files written while unlinked but open, xattrs, modes,
owners and times (clamped extremes too), commits, snapshots, clean remounts
and a rekey. At every commit point the store, read by tests/spec/reader.py
from the bytes alone, must hold exactly what the engine shows through its
API (lookup, readdir, getattr, read, readlink, listxattr and getxattr), and
the reader's whole replayed state (inodes no name reaches, extent rows, the
chunk table, the writer and next_ino) must equal the engine's.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from sealfs.errors import FsError
from sealfs.meta.model import ROOT_INO, Inode
from sealfs.store.local import LocalStore
from sealfs.volume.engine import RENAME_EXCHANGE, RENAME_NOREPLACE, Volume
from sealfs.volume.loader import create_volume
from tests.conftest import PASSPHRASE, RECOVERY_KEY, cheap_kdf, mounted
from tests.spec import reader
from tests.volume.test_engine import GID, UID, R, W, install_cached_unlock
from tests.volume.test_rekey import start_rekey

MiB = 1 << 20
LIMIT = 24 * MiB  # no file grows past this: the reader builds each file in memory
NAMES = [b"a", b"b", b"c", "\u00e9t\u00e9".encode(), b"not-utf8-\xff"]
XATTR_NAMES = [b"user.a", b"user.b", b"trusted.t", b"security.s"]
TIMES = [0, -1, -1_500_000_000_123, 1 << 40, (1 << 64) - 1, -(1 << 63), (1 << 64) + 5, -(1 << 70)]
# Engine options: commits only when the history asks (so each example runs the same
# way every time), and early flushes of big writes between them.
OPTIONS: dict[str, Any] = {
    "commit_interval": 3600.0,
    "flush_threshold": 1 * MiB,
    "max_buffered": 8 * MiB,
}

PICK = st.integers(0, 1 << 16)
SIZE = st.one_of(
    st.sampled_from([0, 1, 100, 4095, 4096, 65_536, 262_144]),
    st.integers(0, 300_000),
    st.integers(0, 3 * MiB),
)
WHERE = st.sampled_from(["start", "inside", "end", "past"])
CONTENT = st.sampled_from(["random", "text", "zeros", "repeat"])

WRITE = st.one_of(
    st.tuples(
        st.just("write"),
        PICK,
        WHERE,
        PICK,
        st.integers(1, 16 * MiB),
        SIZE,
        CONTENT,
        st.integers(0, 7),
    ),
    st.tuples(
        st.just("write"),
        PICK,
        st.just("inside"),
        PICK,
        st.just(0),
        st.integers(1, 5000),
        CONTENT,
        st.integers(0, 7),
    ),
)
OPS = st.one_of(
    WRITE,
    WRITE,
    st.tuples(st.just("create"), PICK, st.sampled_from(NAMES), st.integers(0, 0o7777)),
    st.tuples(
        st.just("truncate"),
        PICK,
        st.sampled_from(["down", "up", "zero"]),
        PICK,
        st.integers(1, 8 * MiB),
    ),
    st.tuples(st.just("unlink"), PICK),
    st.tuples(st.just("rmdir"), PICK),
    st.tuples(
        st.just("rename"),
        PICK,
        PICK,
        st.sampled_from(NAMES),
        st.sampled_from([0, 0, 0, RENAME_NOREPLACE, RENAME_EXCHANGE]),
    ),
    st.tuples(st.just("link"), PICK, PICK, st.sampled_from(NAMES)),
    st.tuples(
        st.just("symlink"),
        PICK,
        st.sampled_from(NAMES),
        st.sampled_from([b"a", b"../b/c", b"/abs/\xff", b"t" * 4095]),
    ),
    st.tuples(st.just("mkdir"), PICK, st.sampled_from(NAMES), st.integers(0, 0o7777)),
    st.tuples(
        st.just("mknod"),
        PICK,
        st.sampled_from(NAMES),
        st.sampled_from(
            [
                stat.S_IFIFO | 0o640,
                stat.S_IFCHR | 0o600,
                stat.S_IFBLK | 0o660,
                stat.S_IFSOCK | 0o755,
            ]
        ),
        st.sampled_from([0, os.makedev(1, 3), os.makedev(259, 1 << 19)]),
    ),
    st.tuples(
        st.just("setxattr"),
        PICK,
        st.sampled_from(XATTR_NAMES),
        st.one_of(st.binary(max_size=40), st.sampled_from([b"\0" * 4000, b"v" * 65536])),
    ),
    st.tuples(st.just("removexattr"), PICK, st.sampled_from(XATTR_NAMES)),
    st.tuples(st.just("chmod"), PICK, st.integers(0, 0o7777)),
    st.tuples(
        st.just("chown"),
        PICK,
        st.sampled_from([0, 1234, 65534, (1 << 32) - 2]),
        st.sampled_from([0, 5678, (1 << 32) - 2]),
    ),
    st.tuples(
        st.just("utimens"),
        PICK,
        st.one_of(st.sampled_from(TIMES), st.integers()),
        st.one_of(st.sampled_from(TIMES), st.integers()),
    ),
    st.tuples(st.just("hold"), PICK),  # open a file and keep it open
    st.tuples(st.just("write_held"), PICK, PICK, SIZE, st.integers(0, 7)),
    st.tuples(st.just("release_held")),
    st.tuples(st.just("forget")),  # the kernel drops every reference
    st.tuples(st.just("fsync")),
    st.tuples(st.just("snapshot")),
    st.tuples(st.just("open_trunc"), PICK),
    st.tuples(st.just("append"), PICK, SIZE, CONTENT, st.integers(0, 7)),
    st.tuples(st.just("reopen")),  # a clean unmount, then a mount
    st.tuples(st.just("crash")),  # the session abandoned without its last commit
    st.tuples(st.just("rekey")),
    st.tuples(st.just("rekey_wait")),  # let a running rekey finish
)
HISTORY = st.lists(OPS, min_size=6, max_size=40)
SESSION_ENDS = ("reopen", "crash")


class Crash(Exception):
    """Raised inside a session to abandon it as a killed process would."""


def content(kind: str, size: int, seed: int) -> bytes:
    if kind == "zeros":
        return bytes(size)
    if kind == "text":
        line = b"line %d of a compressible file\n" % seed
        return (line * (size // len(line) + 1))[:size]
    if kind == "repeat":  # the same bytes every time: chunks shared between files
        return random.Random(1234).randbytes(size)
    return random.Random(seed).randbytes(size)


# -- the reader's view ------------------------------------------------------------------------


class Oracle:
    """Reads a store with tests/spec/reader.py, unlocking each header once."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._headers: dict[bytes, reader.Header] = {}

    def read(self) -> tuple[reader.Volume, reader.State]:
        data = (self.path / "sealfs.vol").read_bytes()
        if data not in self._headers:
            secret = reader.passphrase_bytes(PASSPHRASE, from_file=False)
            self._headers[data] = reader.read_header(data, passphrase=secret)
        header = self._headers[data]
        ours = reader.Reader(self.path, header)
        state, snapshot, segments = ours.state()
        tree = ours.tree(state)
        volume = reader.Volume(
            header.volume_id, header.data_epoch, header.retired_epoch, state.generation,
            snapshot, segments, tree, ours.opened,
        )  # fmt: skip
        return volume, state


# -- the engine's view ------------------------------------------------------------------------


async def engine_tree(v: Volume) -> dict[str, reader.Node]:
    """Every path reachable from the root, through the engine's API, in the reader's terms."""
    out: dict[str, reader.Node] = {}
    stack: list[tuple[str, int]] = [("/", ROOT_INO)]
    while stack:
        path, ino = stack.pop()
        attr = await v.getattr(ino)
        xattrs = {name: await v.getxattr(ino, name) for name in await v.listxattr(ino)}
        target = await v.readlink(ino) if stat.S_ISLNK(attr.mode) else b""
        data = None
        if stat.S_ISREG(attr.mode):
            fh = await v.open(ino, R)
            try:
                data = bytes(await v.read(fh, 0, attr.size + 1))
            finally:
                await v.release(fh)
        out[path] = reader.Node(
            attr.ino, attr.mode, attr.uid, attr.gid, attr.nlink, attr.size, attr.atime_ns,
            attr.mtime_ns, attr.ctime_ns, attr.rdev, target, xattrs, data,
        )  # fmt: skip
        if stat.S_ISDIR(attr.mode):
            fh = await v.opendir(ino)
            try:
                entries = await v.readdir(fh, 0)
            finally:
                await v.releasedir(fh)
            for entry in entries:
                looked_up = await v.lookup(ino, entry.name)
                await v.forget([(looked_up.ino, 1)])
                assert looked_up == entry.attr, (path, entry.name)
                stack.append((path.rstrip("/") + "/" + os.fsdecode(entry.name), looked_up.ino))
    return out


def inode_view(inode: Inode | reader.Inode) -> tuple[Any, ...]:
    extents = None
    if inode.extents is not None:
        extents = [
            (e[0], e[1], e[2], e[3])
            if isinstance(e, tuple)
            else (e.start, e.length, e.chunk, e.chunk_offset)
            for e in inode.extents
        ]
    return (
        inode.ino, inode.mode, inode.uid, inode.gid, inode.nlink, inode.size, inode.atime_ns,
        inode.mtime_ns, inode.ctime_ns, inode.rdev, inode.parent, inode.target,
        dict(inode.xattrs), extents, None if inode.entries is None else dict(inode.entries),
    )  # fmt: skip


async def compare(oracle: Oracle, v: Volume) -> None:
    """Everything the reader finds in the store equals what the engine shows."""
    ours, state = oracle.read()
    theirs = await engine_tree(v)
    assert sorted(ours.tree) == sorted(theirs)
    for path, node in theirs.items():
        assert ours.tree[path] == node, path
    assert ours.generation == v.commits.generation
    assert ours.volume_id == v.loaded.volume_id
    assert ours.data_epoch == v.loaded.keys.epoch
    held = {ours.data_epoch} | ({ours.retired_epoch} - {None})
    assert set(ours.opened.values()) <= held
    if ours.snapshot is not None:
        assert ours.segments == list(range(ours.snapshot + 1, ours.generation + 1))
    # The whole replayed state, not only what a name reaches.
    meta = v.meta
    assert sorted(state.inodes) == sorted(meta.inodes)
    for ino, inode in meta.inodes.items():
        assert inode_view(state.inodes[ino]) == inode_view(inode), ino
    assert state.next_ino == meta.next_ino
    assert state.chunks == {
        cid: (info.plain_size, info.stored_size, info.features, info.base)
        for cid, info in meta.chunks.items()
    }
    writer = meta.writer
    assert writer is not None and state.writer == [
        writer.host,
        writer.pid,
        writer.mount_id,
        writer.since_ns,
        writer.released,
    ]


# -- the engine driven by a history -----------------------------------------------------------


class Driver:
    def __init__(self, store: LocalStore, oracle: Oracle) -> None:
        self.store = store
        self.oracle = oracle
        self.held: list[int] = []
        self.commits = 0

    @staticmethod
    def pick(choices: list[Any], k: int) -> Any:
        return choices[k % len(choices)] if choices else None

    @staticmethod
    def inodes(v: Volume, *kinds: int) -> list[int]:
        return sorted(i for i, n in v.meta.inodes.items() if stat.S_IFMT(n.mode) in kinds)

    def dirs(self, v: Volume) -> list[int]:
        return self.inodes(v, stat.S_IFDIR)

    @staticmethod
    def entries(v: Volume) -> list[tuple[int, bytes]]:
        return sorted(
            (ino, name)
            for ino, n in v.meta.inodes.items()
            if n.entries is not None
            for name in n.entries
        )

    async def commit(self, v: Volume) -> None:
        await v.fsync()
        self.commits += 1
        await compare(self.oracle, v)

    async def write(self, v: Volume, fh: int, offset: int, data: bytes) -> None:
        offset = min(offset, LIMIT - len(data))
        await v.write(fh, max(offset, 0), data)

    async def apply(self, v: Volume, op: tuple[Any, ...]) -> None:
        name = op[0]
        event(name)
        # Refused as POSIX says (EEXIST, ENOTEMPTY, ...): that is the engine tests' matter.
        with contextlib.suppress(FsError):
            await getattr(self, "op_" + name)(v, *op[1:])

    async def op_create(self, v: Volume, k: int, name: bytes, mode: int) -> None:
        fh, _ = await v.create(self.pick(self.dirs(v), k), name, mode, W, UID, GID)
        await v.release(fh)

    async def op_write(
        self, v: Volume, k: int, where: str, k2: int, gap: int, size: int, kind: str, seed: int
    ) -> None:
        ino = self.pick(self.inodes(v, stat.S_IFREG), k)
        if ino is None:
            return
        now = v.inode(ino).size
        offset = {"start": 0, "inside": k2 % (now + 1), "end": now, "past": now + gap}[where]
        fh = await v.open(ino, W)
        try:
            await self.write(v, fh, offset, content(kind, size, seed))
        finally:
            await v.release(fh)

    async def op_truncate(self, v: Volume, k: int, how: str, k2: int, grow: int) -> None:
        ino = self.pick(self.inodes(v, stat.S_IFREG), k)
        if ino is None:
            return
        now = v.inode(ino).size
        size = {"down": k2 % (now + 1), "up": min(now + grow, LIMIT), "zero": 0}[how]
        await v.setattr(ino, size=size)

    async def op_unlink(self, v: Volume, k: int) -> None:
        picked = self.pick(self.entries(v), k)
        if picked is not None:
            await v.unlink(*picked)

    async def op_rmdir(self, v: Volume, k: int) -> None:
        picked = self.pick(self.entries(v), k)
        if picked is not None:
            await v.rmdir(*picked)

    async def op_rename(self, v: Volume, k: int, k2: int, new: bytes, flags: int) -> None:
        picked = self.pick(self.entries(v), k)
        if picked is not None:
            parent, name = picked
            await v.rename(parent, name, self.pick(self.dirs(v), k2), new, flags)

    async def op_link(self, v: Volume, k: int, k2: int, name: bytes) -> None:
        ino = self.pick(self.inodes(v, stat.S_IFREG, stat.S_IFLNK, stat.S_IFIFO), k)
        if ino is not None:
            await v.link(ino, self.pick(self.dirs(v), k2), name)

    async def op_symlink(self, v: Volume, k: int, name: bytes, target: bytes) -> None:
        await v.symlink(self.pick(self.dirs(v), k), name, target, UID, GID)

    async def op_mkdir(self, v: Volume, k: int, name: bytes, mode: int) -> None:
        await v.mkdir(self.pick(self.dirs(v), k), name, mode, UID, GID)

    async def op_mknod(self, v: Volume, k: int, name: bytes, mode: int, rdev: int) -> None:
        await v.mknod(self.pick(self.dirs(v), k), name, mode, rdev, UID, GID)

    async def op_setxattr(self, v: Volume, k: int, name: bytes, value: bytes) -> None:
        await v.setxattr(self.pick(sorted(v.meta.inodes), k), name, value)

    async def op_removexattr(self, v: Volume, k: int, name: bytes) -> None:
        await v.removexattr(self.pick(sorted(v.meta.inodes), k), name)

    async def op_chmod(self, v: Volume, k: int, mode: int) -> None:
        await v.setattr(self.pick(sorted(v.meta.inodes), k), mode=mode)

    async def op_chown(self, v: Volume, k: int, uid: int, gid: int) -> None:
        await v.setattr(self.pick(sorted(v.meta.inodes), k), uid=uid, gid=gid)

    async def op_utimens(self, v: Volume, k: int, atime: int, mtime: int) -> None:
        await v.setattr(self.pick(sorted(v.meta.inodes), k), atime_ns=atime, mtime_ns=mtime)

    async def op_hold(self, v: Volume, k: int) -> None:
        ino = self.pick(self.inodes(v, stat.S_IFREG), k)
        if ino is not None:
            self.held.append(await v.open(ino, os.O_RDWR))

    async def op_write_held(self, v: Volume, k: int, k2: int, size: int, seed: int) -> None:
        """A write through a handle kept open, perhaps of a file no name reaches now."""
        fh = self.pick(self.held, k)
        if fh is not None:
            ino = v._handle(fh).ino
            await self.write(v, fh, k2 % (v.inode(ino).size + 1), content("random", size, seed))

    async def op_release_held(self, v: Volume) -> None:
        for fh in self.held:
            await v.release(fh)
        self.held.clear()

    async def op_forget(self, v: Volume) -> None:
        await v.forget(list(v._lookups.items()))

    async def op_open_trunc(self, v: Volume, k: int) -> None:
        ino = self.pick(self.inodes(v, stat.S_IFREG), k)
        if ino is not None:
            await v.release(await v.open(ino, W | os.O_TRUNC))

    async def op_append(self, v: Volume, k: int, size: int, kind: str, seed: int) -> None:
        ino = self.pick(self.inodes(v, stat.S_IFREG), k)
        if ino is None or v.inode(ino).size + size > LIMIT:
            return
        fh = await v.open(ino, W | os.O_APPEND)
        try:
            await v.write(fh, 0, content(kind, size, seed))
        finally:
            await v.release(fh)

    async def op_rekey_wait(self, v: Volume) -> None:
        if v.rekey is not None:
            with trio.fail_after(120):
                await v.rekey.ended.wait()
            assert v.rekey.progress.error is None, v.rekey.progress.error
        await self.commit(v)
        if v.rekey is not None and v.rekey.progress.finished:
            # Every object the reader needs was re-sealed, and the old key is gone.
            ours, _ = self.oracle.read()
            assert ours.retired_epoch is None
            assert set(ours.opened.values()) == {ours.data_epoch}

    async def op_fsync(self, v: Volume) -> None:
        await self.commit(v)

    async def op_snapshot(self, v: Volume) -> None:
        await v.fsync()
        await v.commits.snapshot()
        await self.commit(v)

    async def op_rekey(self, v: Volume) -> None:
        if v.loaded.keys.retired_epoch is None:  # a rekey during a rekey is refused
            await v.fsync()
            master = await trio.to_thread.run_sync(start_rekey, self.store)
            await v.adopt_rekey(master)
        await self.commit(v)

    async def prologue(self, v: Volume) -> None:
        """Something for the history to work on: files big and small, a directory."""
        for op in [
            ("create", 0, b"a", 0o644),
            ("write", 0, "start", 0, 0, 2 * MiB + 12345, "random", 1),
            ("mkdir", 0, b"d", 0o755),
            ("create", 1, b"b", 0o600),
            ("write", 1, "start", 0, 0, 300_000, "text", 2),
        ]:
            await self.apply(v, op)

    async def run(self, history: list[tuple[Any, ...]]) -> None:
        todo = list(history)
        async with mounted(self.store, **OPTIONS) as v:
            await self.prologue(v)
        while True:
            try:
                async with mounted(self.store, **OPTIONS) as v:
                    await compare(self.oracle, v)  # what the last session left, replayed
                    while todo and todo[0][0] not in SESSION_ENDS:
                        await self.apply(v, todo.pop(0))
                    if todo and todo[0][0] == "crash":
                        self.held.clear()
                        raise Crash  # noqa: TRY301
                    await self.op_release_held(v)
                    await self.commit(v)
            except* Crash:
                pass
            if not todo:
                break
            event(todo.pop(0)[0])
        # After the last unmount: a read-only engine over the store, as a fresh mount sees it.
        async with mounted(self.store, read_only=True) as v:
            await compare(self.oracle, v)


# -- the test ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new volume, made once (one key derivation): each example runs on a copy of it."""
    path = tmp_path_factory.mktemp("differential") / "template"
    create_volume(LocalStore(path), PASSPHRASE, cheap_kdf(), RECOVERY_KEY)
    return path


def check_history(template: Path, base: Path, history: list[tuple[Any, ...]]) -> None:
    with tempfile.TemporaryDirectory(dir=base) as scratch:
        path = Path(scratch) / "store"
        shutil.copytree(template, path)
        driver = Driver(LocalStore(path), Oracle(path))
        trio.run(driver.run, history)


# Fixed seed: CI runs the same histories every time (and a failure replays as it was).
DIFFERENTIAL = settings(
    max_examples=80,
    derandomize=True,
    database=None,
    deadline=None,
    phases=[Phase.explicit, Phase.generate, Phase.shrink],  # explain replays thousands
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)


@pytest.fixture
def cached_unlock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once per test, not per example: each example would wrap the last one's wrapper."""
    install_cached_unlock(monkeypatch)


@DIFFERENTIAL
@given(history=HISTORY)
def test_the_reader_reads_what_the_engine_committed(
    cached_unlock: None, template: Path, history: list[tuple[Any, ...]]
) -> None:
    check_history(template, template.parent, history)
