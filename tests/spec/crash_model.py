"""A POSIX model of a random file workload, and the workload itself.

The crash oracle (tests/spec/test_crash_oracle.py) needs to know what the tree
looked like after every prefix of the operations a workload made through a
mount. The workload runs in its own process (so that killing the daemon cannot
kill it), picks each operation from this model of the tree, writes the operation
to a journal outside the mount before making it and its completion after, and
stops at its first error. The test replays the journal through the same model.

The model knows nothing of sealfs: it is plain POSIX semantics of the calls the
workload makes (one kernel request each, except that the kernel may cut a long
write into several), so a bug shared by sealfs' writer and its replay cannot hide
in it. Every record carries the CLOCK_MONOTONIC time around its call, which one
host's processes share, so the journals of workloads running side by side order
their ops in real time (tests/spec/test_crash_oracle_writers.py). Run as `python -m
tests.spec.crash_model MOUNT JOURNAL SEED OPS FSYNC_WEIGHT STREAM_WEIGHT [BASE|-
[PREFIX]]`.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import mmap
import os
import posixpath
import random
import stat
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

PAGE = 4096
MAX_FILE = 6 << 20  # a file may grow past a few chunks, no further
# A name of 255 bytes (NAME_MAX) too, and one of non-ASCII UTF-8.
NAMES = [f"f{i}" for i in range(10)] + ["d0", "d1", "d2", "n" * 255, "é-ß-€"]
# trusted.* needs CAP_SYS_ADMIN: the workload runs as root where FUSE tests run.
XATTRS = [b"user.a", b"user.b", b"user.c"] + ([b"trusted.t"] if os.geteuid() == 0 else [])
FILE_PERMS = [0o644, 0o600, 0o640, 0o755, 0o700]
DIR_PERMS = [0o755, 0o700, 0o750]


def payload(seed: int, length: int) -> bytes:
    """The bytes a write op carries: the journal holds only the seed and length."""
    return random.Random(seed).randbytes(length)


@dataclass
class MNode:
    """One inode of the model: a regular file ("f"), a directory ("d") or a symlink."""

    kind: str
    perm: int
    data: bytearray = field(default_factory=bytearray)
    target: bytes = b""
    xattrs: dict[bytes, bytes] = field(default_factory=dict)
    mtime_ns: int | None = None  # known only after utime, until the next change
    _digest: bytes | None = None

    def digest(self) -> bytes:
        """SHA-256 of the data, cached: prefixes are compared one op after another."""
        if self._digest is None:
            self._digest = hashlib.sha256(self.data).digest()
        return self._digest

    def changed_data(self) -> None:
        self._digest = None
        self.mtime_ns = None


# What one path looks like, in terms both the model and the reader can produce:
# (kind, permission bits, size, sha256 of data, symlink target, user xattrs, nlink of a
# file, mtime if known, the paths sharing its inode).
Entry = tuple[str, int, int, bytes, bytes, frozenset[tuple[bytes, bytes]], int, int | None,
              tuple[str, ...]]  # fmt: skip


def write_into(data: bytes | bytearray, off: int, buf: bytes) -> bytearray:
    """data with buf written at off (a hole of zeros first if off is past the end)."""
    out = bytearray(data)
    if off > len(out):
        out.extend(bytes(off - len(out)))
    out[off : off + len(buf)] = buf
    return out


class Model:
    """The tree as a map of absolute paths (root excluded) to inode numbers; every name
    the workload makes starts with prefix, so that workloads sharing a directory each
    have names of their own."""

    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix
        self.paths: dict[str, int] = {}
        self.nodes: dict[int, MNode] = {}
        self.next_id = 1
        self.fds: dict[int, int] = {}  # the workload's open descriptors: slot -> inode

    # -- queries --------------------------------------------------------------------

    def node(self, path: str) -> MNode:
        return self.nodes[self.paths[path]]

    def of_kind(self, kind: str) -> list[str]:
        return sorted(p for p, i in self.paths.items() if self.nodes[i].kind == kind)

    def dirs(self) -> list[str]:
        return ["/", *self.of_kind("d")]

    def children(self, directory: str) -> list[str]:
        return [p for p in self.paths if posixpath.dirname(p) == directory]

    def nlink(self, ino: int) -> int:
        return sum(1 for i in self.paths.values() if i == ino)

    def fingerprint(self) -> dict[str, Entry]:
        """Every path as the Entry the reader's tree is compared with."""
        groups: dict[int, list[str]] = {}
        for path, ino in self.paths.items():
            groups.setdefault(ino, []).append(path)
        out: dict[str, Entry] = {}
        for path, ino in self.paths.items():
            n = self.nodes[ino]
            is_file = n.kind == "f"
            out[path] = (
                n.kind, n.perm, len(n.data) if is_file else len(n.target) if n.kind == "l" else 0,
                n.digest() if is_file else b"", n.target, frozenset(n.xattrs.items()),
                len(groups[ino]) if is_file else 0, n.mtime_ns,
                tuple(sorted(groups[ino])) if is_file else (),
            )  # fmt: skip
        return out

    # -- changes --------------------------------------------------------------------

    def _touch_parent(self, path: str) -> None:
        parent = posixpath.dirname(path)
        if parent != "/":
            self.node(parent).mtime_ns = None

    def _new(self, path: str, node: MNode) -> None:
        self.nodes[self.next_id] = node
        self.paths[path] = self.next_id
        self.next_id += 1
        self._touch_parent(path)

    def _drop(self, path: str) -> None:
        ino = self.paths.pop(path)
        self._forget(ino)
        self._touch_parent(path)

    def _forget(self, ino: int) -> None:
        """Drop an inode no name and no open descriptor holds."""
        if ino not in self.paths.values() and ino not in self.fds.values():
            del self.nodes[ino]

    def written(self, op: dict[str, Any]) -> int:
        """The inode a write op writes."""
        return self.fds[op["fd"]] if op["op"] == "fdwrite" else self.paths[op["path"]]

    def apply(self, op: dict[str, Any], cut: int | None = None) -> None:
        """Apply one journal op; cut (or the op's own "cut"), for a write, stops its data
        at that file offset (a write the kernel split and the crash cut short)."""
        kind = op["op"]
        path = op.get("path", "")
        if kind == "create":
            self._new(path, MNode("f", op["perm"]))
        elif kind in ("write", "append", "fdwrite"):
            node = self.nodes[self.written(op)]
            off = op["off"]
            if kind == "append":
                assert off == len(node.data), (op, len(node.data))
            buf = payload(op["seed"], op["len"])
            cut = op.get("cut", cut)
            if cut is not None:
                buf = buf[: cut - off]
            node.data = write_into(node.data, off, buf)
            node.changed_data()
        elif kind in ("truncate", "ftruncate", "otrunc"):
            node = self.nodes[self.fds[op["fd"]]] if kind == "ftruncate" else self.node(path)
            size = op.get("size", 0)
            node.data = node.data[:size] + bytes(max(0, size - len(node.data)))
            node.changed_data()
        elif kind == "rename":
            src, dst = op["src"], op["dst"]
            ino = self.paths[src]
            if dst in self.paths:
                self._drop(dst)
            moved = {p: i for p, i in self.paths.items() if p == src or p.startswith(src + "/")}
            for p in moved:
                del self.paths[p]
            for p, i in moved.items():
                self.paths[dst + p[len(src) :]] = i
            assert self.paths[dst] == ino
            self._touch_parent(src)
            self._touch_parent(dst)
        elif kind == "exchange":
            src, dst = op["src"], op["dst"]

            def swapped(p: str) -> str:
                for a, b in ((src, dst), (dst, src)):
                    if p == a or p.startswith(a + "/"):
                        return str(b) + p[len(a) :]
                return p

            self.paths = {swapped(p): i for p, i in self.paths.items()}
            for name in (src, dst):
                self._touch_parent(name)
        elif kind in ("unlink", "rmdir"):
            self._drop(path)
        elif kind == "mkdir":
            self._new(path, MNode("d", op["perm"]))
        elif kind == "mkfifo":
            self._new(path, MNode("p", op["perm"]))
        elif kind == "symlink":
            self._new(path, MNode("l", 0o777, target=op["target"].encode()))
        elif kind == "link":
            self.paths[op["dst"]] = self.paths[op["src"]]
            self._touch_parent(op["dst"])
        elif kind == "setxattr":
            self.node(path).xattrs[op["name"].encode()] = bytes.fromhex(op["value"])
        elif kind == "removexattr":
            del self.node(path).xattrs[op["name"].encode()]
        elif kind == "chmod":
            self.node(path).perm = op["perm"]
        elif kind == "utime":
            self.node(path).mtime_ns = op["mtime"]
        elif kind == "open":
            self.fds[op["fd"]] = self.paths[path]
        elif kind == "close":
            self._forget(self.fds.pop(op["fd"]))
        elif kind in ("fsync", "fdsync"):
            pass
        else:
            raise AssertionError(f"unknown op {op}")

    # -- the workload's choices -----------------------------------------------------

    def _fresh(self, rng: random.Random) -> str | None:
        """A path that does not exist, in a directory that does (depth at most 3)."""
        for _ in range(20):
            parent = rng.choice(self.dirs())
            if parent.count("/") >= 3:
                continue
            path = posixpath.join(parent, (self.prefix + rng.choice(NAMES))[:255])
            if path not in self.paths:
                return path
        return None

    def choose(self, rng: random.Random, fsyncs: int = 8, stream: int = 0) -> dict[str, Any] | None:
        """One op that is valid in the current tree, or None if the pick did not fit;
        fsyncs weighs fsync among the ops (and O_DSYNC writes with it), stream appends of
        8 MiB to /big (up to 72 MiB: enough buffered for sealfs to flush early)."""
        files, dirs = self.of_kind("f"), self.of_kind("d")
        kind = rng.choices(
            ["create", "write", "append", "truncate", "rename", "unlink", "mkdir", "rmdir",
             "symlink", "link", "setxattr", "removexattr", "chmod", "utime", "fsync", "open",
             "fdwrite", "ftruncate", "close", "stream", "mmap"],
            [8, 22, 10, 6, 9, 5, 4, 2, 3, 3, 4, 2, 3, 3, fsyncs, 2, 6, 1, 1, stream, 3],
        )[0]  # fmt: skip
        if kind == "mmap":
            # A store through a shared mapping, then msync(MS_SYNC): an fsync, so a
            # barrier. Within one page, which the kernel writes back whole.
            sized = [f for f in files if self.node(f).data]
            if not sized:
                return None
            mapped = rng.choice(sized)
            off = rng.randrange(len(self.node(mapped).data))
            room = min(len(self.node(mapped).data) - off, PAGE - off % PAGE)
            return {"op": "write", "path": mapped, "off": off, "seed": rng.randrange(1 << 30),
                    "len": rng.randrange(1, room + 1), "mmap": True}  # fmt: skip
        if kind == "stream":
            big = f"/{self.prefix}big"
            if big not in self.paths:
                return {"op": "create", "path": big, "perm": 0o644}
            if self.node(big).kind != "f":
                return None
            size = len(self.node(big).data)
            if size > 64 << 20:
                return {"op": "truncate", "path": big, "size": 0}
            return {"op": "append", "path": big, "off": size, "seed": rng.randrange(1 << 30),
                    "len": 8 << 20, "sync": False}  # fmt: skip
        if kind == "open" and files and len(self.fds) < 3:
            slot = min(set(range(3)) - set(self.fds))
            return {"op": kind, "path": rng.choice(files), "fd": slot}
        if kind in ("fdwrite", "ftruncate", "close") and self.fds:
            slot = rng.choice(sorted(self.fds))
            size = len(self.nodes[self.fds[slot]].data)
            if kind == "close":
                return {"op": kind, "fd": slot}
            if kind == "ftruncate":
                return {"op": kind, "fd": slot, "size": rng.randrange(0, size + 100_000)}
            if rng.random() < 0.05 * fsyncs:
                return {"op": "fdsync", "fd": slot}
            off = rng.choice([size, rng.randrange(0, size + 1)])
            length = rng.randrange(1, 300_000)
            if off + length > MAX_FILE:
                return {"op": "ftruncate", "fd": slot, "size": 0}
            return {"op": kind, "fd": slot, "off": off, "seed": rng.randrange(1 << 30),
                    "len": length}  # fmt: skip
        path: str | None
        dst: str | None
        if kind == "create" and rng.random() < 0.1:
            path = self._fresh(rng)
            return {"op": "mkfifo", "path": path, "perm": 0o640} if path else None
        if kind in ("create", "mkdir", "symlink"):
            path = self._fresh(rng)
            if path is None:
                return None
            if kind == "create":
                return {"op": kind, "path": path, "perm": rng.choice(FILE_PERMS)}
            if kind == "mkdir":
                return {"op": kind, "path": path, "perm": rng.choice(DIR_PERMS)}
            return {"op": kind, "path": path, "target": rng.choice(["f1", "../d0/f2", "x" * 90])}
        if kind in ("write", "append", "truncate") and files:
            path = rng.choice(files)
            size = len(self.node(path).data)
            if kind == "truncate" and rng.random() < 0.25:
                return {"op": "otrunc", "path": path}  # open(O_TRUNC): the daemon truncates
            if kind == "truncate":
                new = rng.choice([0, size // 2, size + rng.randrange(1, 300_000), rng.randrange(
                    0, MAX_FILE // 2)])  # fmt: skip
                return {"op": kind, "path": path, "size": min(new, MAX_FILE)}
            big = rng.random() < 0.12
            length = rng.randrange(1 << 20, 4 << 20) if big else rng.randrange(1, 40_000)
            if kind == "append":
                off = size
            else:
                off = rng.choice([0, rng.randrange(0, size + 1), size + rng.randrange(0, 200_000)])
                off = rng.choice([off, off - off % PAGE])
            if off + length > MAX_FILE:
                return {"op": "truncate", "path": path, "size": rng.randrange(0, 1 << 20)}
            sync = kind == "write" and rng.random() < 0.01 * fsyncs  # an O_DSYNC write: a barrier
            return {"op": kind, "path": path, "off": off, "seed": rng.randrange(1 << 30),
                    "len": length, "sync": sync}  # fmt: skip
        if kind == "rename" and len(self.paths) > 1 and rng.random() < 0.2:
            src, dst = rng.sample(sorted(self.paths), 2)  # RENAME_EXCHANGE
            if dst.startswith(src + "/") or src.startswith(dst + "/"):
                return None
            if self.paths[src] == self.paths[dst]:
                return None  # two names of one inode: the kernel does nothing
            return {"op": "exchange", "src": src, "dst": dst}
        if kind == "rename" and self.paths:
            src = rng.choice(sorted(self.paths))
            if self.node(src).kind == "d":
                empty = [d for d in dirs if not self.children(d) and d != src]
                dst = rng.choice(empty) if empty and rng.random() < 0.3 else self._fresh(rng)
                if dst is None or dst.startswith(src + "/"):
                    return None  # (over an empty directory, or to a new name)
            elif rng.random() < 0.5 and len(files) > 1:
                dst = rng.choice(files)  # over an existing file
                if self.paths[dst] == self.paths[src]:
                    return None  # two names of one inode: rename does nothing
            else:
                dst = self._fresh(rng)
                if dst is None:
                    return None
            return {"op": kind, "src": src, "dst": dst}
        if kind == "unlink":
            victims = files + self.of_kind("l") + self.of_kind("p")
            return {"op": kind, "path": rng.choice(victims)} if victims else None
        if kind == "rmdir":
            empty = [d for d in dirs if not self.children(d)]
            return {"op": kind, "path": rng.choice(empty)} if empty else None
        if kind == "link" and files:
            dst = self._fresh(rng)
            return {"op": kind, "src": rng.choice(files), "dst": dst} if dst else None
        targets = files + dirs
        if kind in ("setxattr", "removexattr", "chmod", "utime", "fsync") and targets:
            path = rng.choice(targets)
            node = self.node(path)
            if kind == "setxattr":
                size = rng.choice([0, rng.randrange(1, 100), rng.randrange(100, 20_000)])
                value = rng.randbytes(size).hex()
                return {"op": kind, "path": path, "name": rng.choice(XATTRS).decode(),
                        "value": value}  # fmt: skip
            if kind == "removexattr":
                names = sorted(node.xattrs)
                return (
                    {"op": kind, "path": path, "name": rng.choice(names).decode()}
                    if names
                    else None
                )
            if kind == "chmod":
                perms = FILE_PERMS if node.kind == "f" else DIR_PERMS
                return {"op": kind, "path": path, "perm": rng.choice(perms)}
            if kind == "utime":
                base = 1_600_000_000_000_000_000
                return {"op": kind, "path": path, "atime": base + rng.randrange(1 << 50),
                        "mtime": base + rng.randrange(1 << 50)}  # fmt: skip
            return {"op": kind, "path": path, "dir": node.kind == "d"}
        return None


def short(n: int, buf: bytes) -> None:
    """A write cut short is how the kernel reports an error after some of its pages (the
    daemon died under it): the workload stops there, as at any error."""
    if n != len(buf):
        raise OSError(errno.EIO, f"short write: {n} of {len(buf)} bytes")


def perform(mnt: str, op: dict[str, Any], fds: dict[int, int]) -> None:
    """Make op through the mount, as one system call that changes the tree (fds: the
    descriptors the workload holds open across ops, by slot)."""
    kind = op["op"]

    def at(key: str) -> str:
        return mnt + str(op[key])

    if kind == "create":
        os.close(os.open(at("path"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, op["perm"]))
    elif kind == "write" and op.get("mmap"):
        fd = os.open(at("path"), os.O_RDWR)
        try:
            start = op["off"] - op["off"] % mmap.PAGESIZE
            with mmap.mmap(fd, op["off"] + op["len"] - start, offset=start) as m:
                m[op["off"] - start :] = payload(op["seed"], op["len"])
                m.flush()  # msync(MS_SYNC)
        finally:
            os.close(fd)
    elif kind in ("write", "append"):
        flags = os.O_WRONLY | (os.O_APPEND if kind == "append" else 0)
        flags |= os.O_DSYNC if op.get("sync") else 0
        fd = os.open(at("path"), flags)
        try:
            buf = payload(op["seed"], op["len"])
            n = os.write(fd, buf) if kind == "append" else os.pwrite(fd, buf, op["off"])
            short(n, buf)
        finally:
            os.close(fd)
    elif kind == "truncate":
        os.truncate(at("path"), op["size"])
    elif kind == "otrunc":
        os.close(os.open(at("path"), os.O_WRONLY | os.O_TRUNC))
    elif kind == "open":
        fds[op["fd"]] = os.open(at("path"), os.O_RDWR)
    elif kind == "fdwrite":
        buf = payload(op["seed"], op["len"])
        n = os.pwrite(fds[op["fd"]], buf, op["off"])
        short(n, buf)
    elif kind == "ftruncate":
        os.ftruncate(fds[op["fd"]], op["size"])
    elif kind == "fdsync":
        os.fsync(fds[op["fd"]])
    elif kind == "close":
        os.close(fds.pop(op["fd"]))
    elif kind == "rename":
        os.rename(at("src"), at("dst"))
    elif kind == "exchange":
        libc = ctypes.CDLL(None, use_errno=True)
        at_fdcwd, rename_exchange = -100, 2
        if libc.renameat2(at_fdcwd, os.fsencode(at("src")), at_fdcwd, os.fsencode(at("dst")),
                          rename_exchange) != 0:  # fmt: skip
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
    elif kind == "unlink":
        os.unlink(at("path"))
    elif kind == "rmdir":
        os.rmdir(at("path"))
    elif kind == "mkdir":
        os.mkdir(at("path"), op["perm"])
    elif kind == "mkfifo":
        os.mkfifo(at("path"), op["perm"])
    elif kind == "symlink":
        os.symlink(op["target"], at("path"))
    elif kind == "link":
        os.link(at("src"), at("dst"))
    elif kind == "setxattr":
        os.setxattr(at("path"), op["name"], bytes.fromhex(op["value"]))
    elif kind == "removexattr":
        os.removexattr(at("path"), op["name"])
    elif kind == "chmod":
        os.chmod(at("path"), op["perm"])
    elif kind == "utime":
        os.utime(at("path"), ns=(op["atime"], op["mtime"]))
    elif kind == "fsync":
        fd = os.open(at("path"), os.O_RDONLY | (os.O_DIRECTORY if op["dir"] else 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    else:
        raise AssertionError(f"unknown op {op}")


# Ops that close a descriptor opened for writing: with --sync-on-close, barriers.
CLOSES_WRITABLE = ("create", "write", "append", "close", "otrunc")


def is_barrier(op: dict[str, Any], sync_on_close: bool = False) -> bool:
    """Whether op's completion promises every earlier op (and itself) committed: fsync
    of any file or directory, a write to a file opened O_DSYNC, and with --sync-on-close
    the close of a descriptor opened for writing (README, Durability)."""
    if sync_on_close and op["op"] in CLOSES_WRITABLE:
        return True
    return op["op"] in ("fsync", "fdsync") or bool(op.get("sync") or op.get("mmap"))


@dataclass
class Journal:
    """What one workload's journal says, its times in CLOCK_MONOTONIC nanoseconds."""

    ops: list[dict[str, Any]]  # every op begun, in order
    barrier: int  # how many ops the last completed barrier covers
    errors: list[tuple[int, str]]  # the errors the workload met
    began: list[int]  # per op begun: a time before its call
    ended: list[int]  # per op that returned: a time after
    synced: list[int]  # per barrier that returned (the Syncer's too): a time before its call


def read_journal(path: str, sync_on_close: bool = False) -> Journal:
    """The journal a workload wrote at path."""
    journal = Journal([], 0, [], [], [], [])
    with open(path) as f:
        for line in f:
            if not line.endswith("\n"):
                break  # the workload outlives the daemon, so this never happens
            rec = json.loads(line)
            if "begin" in rec:
                assert rec["i"] == len(journal.ops)
                journal.ops.append(rec["begin"])
                journal.began.append(rec["t"])
            elif "end" in rec:
                assert rec["i"] == len(journal.ended)
                journal.ended.append(rec["t"])
                if is_barrier(journal.ops[rec["i"]], sync_on_close):
                    journal.barrier = rec["i"] + 1
                    journal.synced.append(journal.began[rec["i"]])
            elif "covers" in rec:
                journal.barrier = max(journal.barrier, rec["covers"])
                journal.synced.append(rec["t"])
            elif "error" in rec:
                journal.errors.append((rec["errno"], rec["error"]))
    return journal


class Syncer(threading.Thread):
    """fsync of the root directory, again and again, beside the ops: each one that
    returns covers every op that had completed when it began (README: fsync of any
    file or directory commits every earlier operation on the volume), so concurrent
    fsyncs, sharing commits with the ops' own, are judged as barriers too."""

    def __init__(self, mnt: str, seed: int, progress: list[int], log: Any) -> None:
        super().__init__(daemon=True)
        self.mnt, self.rng, self.progress, self.log = mnt, random.Random(-seed), progress, log
        self.stopping = threading.Event()

    def run(self) -> None:
        fd = os.open(self.mnt, os.O_RDONLY | os.O_DIRECTORY)
        try:
            while not self.stopping.is_set():
                covered = self.progress[0]
                began = time.monotonic_ns()
                try:
                    os.fsync(fd)
                except OSError:
                    return  # the daemon died: the ops' thread stops at its own error
                self.log({"covers": covered, "t": began}, sync=True)
                self.stopping.wait(self.rng.uniform(0.0, 0.03))
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)


def run(
    mnt: str,
    journal: str,
    seed: int,
    count: int,
    fsyncs: int,
    stream: int,
    base: str | None,
    prefix: str = "",
) -> None:
    """Make count random ops; stop at the first error (the daemon was killed). base
    names a JSON file of the ops that made the tree the workload starts from (the
    state an earlier crash left), if it is not empty. With few fsyncs among the ops, a
    Syncer thread fsyncs beside them. Every name made starts with prefix."""
    os.umask(0)
    rng = random.Random(seed)
    model = Model(prefix)
    if base is None:
        ours = [name for name in os.listdir(mnt) if name.startswith(prefix)]
        assert not ours, "the workload starts from an empty volume"
    else:
        with open(base) as f:
            for op in json.load(f):
                model.apply(op)
    lock = threading.Lock()
    with open(journal, "w") as j:

        def log(record: dict[str, Any], sync: bool = False) -> None:
            with lock:
                j.write(json.dumps(record) + "\n")
                j.flush()
                if sync:
                    os.fsync(j.fileno())

        print("started", flush=True)
        progress = [0]  # ops completed: what an fsync begun now covers
        syncer = Syncer(mnt, seed, progress, log) if fsyncs < 4 else None
        if syncer:
            syncer.start()
        fds: dict[int, int] = {}
        try:
            while progress[0] < count:
                done = progress[0]
                op = model.choose(rng, fsyncs, stream)
                if op is None:
                    continue
                log({"i": done, "begin": op, "t": time.monotonic_ns()})
                try:
                    perform(mnt, op, fds)
                except OSError as exc:
                    log({"i": done, "error": f"{exc!r}", "errno": exc.errno}, sync=True)
                    print("stopped", flush=True)
                    return
                returned = time.monotonic_ns()
                model.apply(op)
                log({"i": done, "end": True, "t": returned}, sync=is_barrier(op))
                progress[0] = done + 1
        finally:
            if syncer:
                syncer.stopping.set()
                syncer.join()
    print("done", flush=True)


def kind_of(mode: int) -> str:
    """The model's name of a file type: file, directory, symlink, FIFO."""
    kinds = {stat.S_IFREG: "f", stat.S_IFDIR: "d", stat.S_IFLNK: "l", stat.S_IFIFO: "p"}
    return kinds.get(stat.S_IFMT(mode), "?")


if __name__ == "__main__":
    mnt_, journal_, seed_, count_, fsyncs_, stream_ = sys.argv[1:7]
    base_ = sys.argv[7] if len(sys.argv) > 7 and sys.argv[7] != "-" else None
    run(mnt_, journal_, int(seed_), int(count_), int(fsyncs_), int(stream_), base_,
        sys.argv[8] if len(sys.argv) > 8 else "")  # fmt: skip
