"""A namespace exerciser: random operations on a small tree, done on a mount and on a
plain directory side by side, the plain one (the machine's own file system) being
the reference.

The operations: creates, writes, truncations, mkdir and rmdir, unlinks,
symlinks, hard links, renames (plain, NOREPLACE, EXCHANGE), chmod, times to the
nanosecond, FIFOs, xattrs, and writes through a file held open while it is
renamed or unlinked; names include the longest allowed, one byte more, and
one that is no UTF-8. Every operation must end the same way on both: the same
result, or the same errno. Now and then the two trees are compared whole:
names, types, modes, sizes, contents, symlink targets, link counts, xattrs and
which names are hard links of one file. The mount is unmounted and mounted
again now and then, and in crash mode its daemon is killed: the tree must then
be one of the trees since the last fsync (the durability promise: a prefix of
the operations, everything before an acknowledged fsync included), and the
reference is copied back from it.

Run it longer than the tests do with
`python -m tests.fuse.tree_exerciser DIR --seed N --ops N` (`--help` for the rest).
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import errno
import hashlib
import os
import random
import shutil
import stat
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from tests.fuse.exercising import Operations, Recent, run_at_random
from tests.mounts import VolumeEnv, reached, scratch_volume, wait_until

# Names: short ones, the longest allowed, one byte too long, and one with a newline, a
# multibyte character and a byte that is no UTF-8 (the surrogate escape of 0xff).
NAMES = ("a", "b", "c", "d", "n" * 255, "o" * 256, "\udcff\n\u00e9")
XATTR_NAMES = ("user.a", "user.b")  # few, so that sets and removals meet
DEPTH = 3  # a/b/c at most
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
AT_FDCWD = -100

_libc = ctypes.CDLL(None, use_errno=True)
_libc.renameat2.argtypes = [
    ctypes.c_int,
    ctypes.c_char_p,
    ctypes.c_int,
    ctypes.c_char_p,
    ctypes.c_uint,
]

Outcome = tuple[str, object]  # ("ok", result) or ("error", errno name)
Tree = tuple[tuple[object, ...], ...]


class Divergence(AssertionError):
    """The mount and the reference directory ended an operation differently."""


def renameat2(src: str, dst: str, flags: int) -> None:
    if _libc.renameat2(AT_FDCWD, os.fsencode(src), AT_FDCWD, os.fsencode(dst), flags) != 0:
        number = ctypes.get_errno()
        raise OSError(number, os.strerror(number))


def describe(root: Path) -> Tree:
    """Everything the comparison covers, with hard links told apart by the order in
    which their inode is first met (inode numbers differ between the trees). An entry
    the caller may not look at (below a directory it may not search) is described as
    such: run by a user other than root, the exerciser meets those."""
    inodes: dict[int, int] = {}
    entries: list[tuple[object, ...]] = []
    for directory, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(dirs + files):
            path = Path(directory, name)
            relative = str(path.relative_to(root))
            try:
                entries.append((relative, *_described(path, inodes)))
            except PermissionError:
                entries.append((relative, "EACCES"))
    return tuple(entries)


def _described(path: Path, inodes: dict[int, int]) -> tuple[object, ...]:
    st = os.lstat(path)
    kind = stat.S_IFMT(st.st_mode)
    entry: tuple[object, ...] = (kind, stat.S_IMODE(st.st_mode), st.st_nlink)
    if stat.S_ISREG(kind):
        link = inodes.setdefault(st.st_ino, len(inodes))
        entry += (st.st_size, hashlib.sha256(path.read_bytes()).hexdigest()[:16], link)
    if stat.S_ISLNK(kind):
        return (*entry, os.readlink(path))
    return entry + tuple(sorted((x, os.getxattr(path, x)) for x in os.listxattr(path)))


@dataclass
class TreeExerciser:
    env: VolumeEnv
    reference: Path
    rng: random.Random
    crash: bool = False
    mount_options: tuple[str, ...] = ()
    follower: Path | None = None  # a read-only mount of the volume, checked after fsyncs
    since_sync: list[Tree] = field(default_factory=list)
    history: Recent = field(default_factory=Recent)
    counts: collections.Counter[str] = field(default_factory=collections.Counter)
    held: dict[Path, int] = field(default_factory=dict)  # a file kept open, root by root
    subtree: str = "tree"  # the directory of the mount exercised
    alone: bool = True  # False: others work beside it, so no remounts and no kills

    @property
    def roots(self) -> tuple[Path, Path]:
        return self.env.mnt / self.subtree, self.reference

    def run(self, ops: int) -> None:
        for root in self.roots:
            root.mkdir()
        self._fsync_tree()
        self.since_sync = [describe(self.reference)]
        try:
            run_at_random(self.rng, self._operations(), ops, self.counts)
        finally:
            self._close_held()  # a failure must not leave the mount busy
        self.compare("at the end")

    def _operations(self) -> Operations:
        ops: Operations = {
            "create": (10, self.create),
            "write": (8, self.write),
            "truncate": (3, self.truncate),
            "mkdir": (5, self.mkdir),
            "rmdir": (4, self.rmdir),
            "unlink": (6, self.unlink),
            "symlink": (4, self.symlink),
            "link": (5, self.link),
            "rename": (12, self.rename),
            "chmod": (3, self.chmod),
            "utime": (2, self.utime),
            "mkfifo": (1, self.mkfifo),
            "setxattr": (3, self.setxattr),
            "removexattr": (2, self.removexattr),
            "hold open": (2, self.hold_open),
            "use held": (4, self.use_held),
            "read": (6, self.read),
            "listdir": (4, self.listdir),
            "fsync": (3, self.fsync),
            "compare": (3, lambda: self.compare("after a comparison")),
        }
        if self.alone:
            ops["remount"] = (1, self.remount)
        if self.alone and self.crash:
            ops["kill"] = (1, self.kill)
        return ops

    # -- operations, each done on both trees ------------------------------------------

    def create(self) -> None:
        """Create a file and write it through the same descriptor: two steps, since a
        crash may leave the file created and still empty."""
        path, data = self._path("new"), self.rng.randbytes(self.rng.randrange(0, 3000))
        fds: dict[Path, int] = {}

        def create(root: Path) -> None:
            fds[root] = os.open(root / path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)

        def write_and_close(root: Path) -> object:
            fd = fds.pop(root)
            try:
                return os.write(fd, data)
            finally:
                os.close(fd)

        if self._both(f"create {path}", create):
            self._both(f"write {len(data)} B to the new {path}", write_and_close)

    def write(self) -> None:
        path, data = self._path("file"), self.rng.randbytes(self.rng.randrange(1, 2000))
        append = self.rng.random() < 0.5
        offset = self.rng.randrange(0, 4000)

        def write(root: Path) -> object:
            flags = os.O_WRONLY | os.O_NONBLOCK | (os.O_APPEND if append else 0)
            fd = os.open(root / path, flags)  # a FIFO without a reader: ENXIO
            try:
                return os.write(fd, data) if append else os.pwrite(fd, data, offset)
            finally:
                os.close(fd)

        where = "append" if append else f"at {offset}"
        self._both(f"write {path} {len(data)} B {where}", write)

    def truncate(self) -> None:
        path, size = self._path("file"), self.rng.randrange(0, 5000)
        self._both(f"truncate {path} {size}", lambda root: os.truncate(root / path, size))

    def mkdir(self) -> None:
        path = self._path("new")
        self._both(f"mkdir {path}", lambda root: os.mkdir(root / path, 0o750))

    def rmdir(self) -> None:
        path = self._path("dir")
        self._both(f"rmdir {path}", lambda root: os.rmdir(root / path))

    def unlink(self) -> None:
        path = self._path("other")
        self._both(f"unlink {path}", lambda root: os.unlink(root / path))

    def symlink(self) -> None:
        path, target = (
            self._path("new"),
            self.rng.choice([self._path(), "../" + self._path(), "/nowhere"]),
        )
        self._both(f"symlink {path} -> {target}", lambda root: os.symlink(target, root / path))

    def link(self) -> None:
        src, dst = self._path("other"), self._path("new")
        self._both(
            f"link {src} {dst}", lambda root: os.link(root / src, root / dst, follow_symlinks=False)
        )

    def rename(self) -> None:
        src, dst = self._path(), self._path(self.rng.choice(["any", "new"]))
        flags = self.rng.choice([0, 0, RENAME_NOREPLACE, RENAME_EXCHANGE])
        self._both(
            f"rename {src} {dst} flags {flags}",
            lambda root: renameat2(str(root / src), str(root / dst), flags),
        )

    def chmod(self) -> None:
        path, mode = self._path(), self.rng.choice([0o600, 0o644, 0o755, 0o700, 0o4755])
        self._both(
            f"chmod {path} {mode:o}",
            lambda root: os.chmod(root / path, mode),
        )

    def read(self) -> None:
        path = self._path("file")

        def read(root: Path) -> object:
            fd = os.open(root / path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO must not block
            try:
                return hashlib.sha256(os.read(fd, 1 << 20)).hexdigest()
            finally:
                os.close(fd)

        self._both(f"read {path}", read)

    def listdir(self) -> None:
        path = self.rng.choice(["", *self._existing_dirs()])
        self._both(f"listdir {path}", lambda root: sorted(os.listdir(root / path)))

    def fsync(self) -> None:
        """fsync one file or directory: on the mount it commits every operation before."""
        openable = [
            path for path, mode in self._entries() if _fits(mode, "dir") or _fits(mode, "file")
        ]
        path = self.rng.choice(["", *openable])  # no symlink, no FIFO (its open would wait)

        def fsync(root: Path) -> object:
            fd = os.open(root / path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            return None

        if not self._both(f"fsync {path or '.'}", fsync):
            return
        self.since_sync = [describe(self.reference)]
        if self.follower is not None:
            self._check_follower(self.follower)

    def _check_follower(self, follower: Path) -> None:
        """Once it has replayed the generation fsync committed, the read-only mount shows
        the tree as it is."""
        wait_until(partial(reached, follower, self.env.status()["generation"]), 15)
        got, want = describe(follower / self.subtree), describe(self.reference)
        if got != want:
            differ = sorted(set(got) ^ set(want), key=str)[:6]
            raise Divergence(f"the read-only mount differs in {differ}\n" + str(self.history))

    def utime(self) -> None:
        """Times to the nanosecond, read back at once (later operations move them)."""
        path = self._path()
        times = (self.rng.randrange(0, 2**33) * 10**9 + self.rng.randrange(10**9),) * 2

        def utime(root: Path) -> object:
            os.utime(root / path, ns=times, follow_symlinks=False)
            st = os.lstat(root / path)
            return st.st_atime_ns, st.st_mtime_ns

        self._both(f"utime {path} {times[0]}", utime)

    def mkfifo(self) -> None:
        path = self._path("new")
        self._both(f"mkfifo {path}", lambda root: os.mkfifo(root / path, 0o640))

    def setxattr(self) -> None:
        path, name = self._xattr_path(), self.rng.choice(XATTR_NAMES)
        value = self.rng.randbytes(self.rng.randrange(0, 100))
        flags = self.rng.choice([0, os.XATTR_CREATE, os.XATTR_REPLACE])
        self._both(
            f"setxattr {path} {name} ({len(value)} B, flags {flags})",
            lambda root: os.setxattr(root / path, name, value, flags, follow_symlinks=False),
        )

    def removexattr(self) -> None:
        path, name = self._xattr_path(), self.rng.choice(XATTR_NAMES)
        self._both(
            f"removexattr {path} {name}",
            lambda root: os.removexattr(root / path, name, follow_symlinks=False),
        )

    def hold_open(self) -> None:
        """Keep a file open while later operations rename or unlink it."""
        self._close_held()
        path = self._path("file")

        def hold(root: Path) -> None:
            self.held[root] = os.open(root / path, os.O_RDWR)

        if not self._both(f"hold {path} open", hold):
            self.held.clear()

    def use_held(self) -> None:
        """Write through the held descriptor and read the whole file back through it:
        an unlinked file stays readable and writable until closed."""
        if not self.held:
            return
        offset, data = self.rng.randrange(0, 3000), self.rng.randbytes(self.rng.randrange(1, 500))

        def use(root: Path) -> object:
            fd = self.held[root]
            os.pwrite(fd, data, offset)
            return hashlib.sha256(os.pread(fd, 1 << 20, 0)).hexdigest()

        self._both(f"write {len(data)} B at {offset} through the held descriptor", use)

    def _close_held(self) -> None:
        for fd in self.held.values():
            os.close(fd)
        self.held.clear()

    def remount(self) -> None:
        self._note("remount")
        self._close_held()
        self.env.umount()
        self.env.mount(*self.mount_options)
        self.since_sync = [describe(self.reference)]
        self.compare("after a remount")

    def kill(self) -> None:
        """Kill the daemon; the mount's tree must be one since the last fsync, and the
        reference goes back to it."""
        self._note("kill -9, mount")
        self._close_held()
        self.env.kill()
        self.env.mount(*self.mount_options)
        mount_root, reference = self.roots
        got = describe(mount_root)
        if got not in self.since_sync:
            closest = min(self.since_sync, key=lambda tree: len(set(tree) ^ set(got)))
            at = self.since_sync.index(closest)
            raise Divergence(
                f"after a crash, a tree that was never there since the last fsync; closest is"
                f" the one after {at} of the {len(self.since_sync) - 1} operations since,"
                f" which had {sorted(set(closest) - set(got), key=str)} where the mount has"
                f" {sorted(set(got) - set(closest), key=str)}\n" + str(self.history)
            )
        shutil.rmtree(reference)
        subprocess.run(["cp", "-a", str(mount_root), str(reference)], check=True)
        self.since_sync = [got]
        self.compare("after copying the reference back")

    # -- helpers ----------------------------------------------------------------------

    def _path(self, kind: str = "any") -> str:
        """Mostly a path fit for the operation: an entry of the kind asked for ("file",
        "dir", "other" for anything but a directory, "any"), or a "new" name in a
        directory that exists. One time in ten anything at all, to get the errors."""
        if self.rng.random() < 0.1:
            depth = self.rng.randrange(1, DEPTH + 1)
            return "/".join(self.rng.choice(NAMES) for _ in range(depth))
        if kind != "new":
            fit = [path for path, mode in self._entries() if _fits(mode, kind)]
            if fit:
                return self.rng.choice(fit)
        parents = [d for d in self._existing_dirs() if d.count("/") + 1 < DEPTH]
        parent = self.rng.choice(["", *parents])
        return f"{parent}/{self.rng.choice(NAMES)}" if parent else self.rng.choice(NAMES)

    def _xattr_path(self) -> str:
        """Half the time an entry that has xattrs already, so that creates, replaces and
        removals meet names that exist."""
        having = [str(entry[0]) for entry in describe(self.reference) if _has_xattrs(entry)]
        return self.rng.choice(having) if having and self.rng.random() < 0.5 else self._path()

    def _entries(self) -> list[tuple[str, int]]:
        """(path, lstat mode) of every entry of the reference tree."""
        described = describe(self.reference)
        return [(str(entry[0]), entry[1]) for entry in described if isinstance(entry[1], int)]

    def _existing(self) -> list[str]:
        return [path for path, _ in self._entries()]

    def _existing_dirs(self) -> list[str]:
        return [path for path, mode in self._entries() if stat.S_ISDIR(mode)]

    def _both(self, text: str, operation: Callable[[Path], object]) -> bool:
        """Do operation on both trees; whether it succeeded (on both, or else on neither)."""
        self._note(text)
        mount_root, reference = self.roots
        want, got = _outcome(operation, reference), _outcome(operation, mount_root)
        if got != want:
            raise Divergence(
                f"{text}: the mount gave {got}, the reference {want}\n" + str(self.history)
            )
        self.counts["succeeded" if got[0] == "ok" else "failed alike"] += 1
        if got[0] == "error":
            self.counts[str(got[1])] += 1  # which errnos were met, for the printed counts
        self.since_sync.append(describe(reference))
        return got[0] == "ok"

    def _fsync_tree(self) -> None:
        fd = os.open(self.roots[0], os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def compare(self, when: str) -> None:
        mount_root, reference = self.roots
        got, want = describe(mount_root), describe(reference)
        if got != want:
            differ = sorted(set(got) ^ set(want), key=str)[:6]
            raise Divergence(f"{when}: trees differ in {differ}\n" + str(self.history))

    def _note(self, text: str) -> None:
        self.history.note(text)


def exercise_side_by_side(env: VolumeEnv, seed: int, ops: int, exercisers: int = 4) -> None:
    """Exercisers on threads of their own, each in its own directory of the mount with a
    reference of its own: namespace requests reach the daemon side by side. Each tree
    must still end as its reference did, before and after a remount."""
    group = [
        TreeExerciser(
            env,
            env.root / f"reference-{seed}-{n}",
            random.Random(seed * 100 + n),
            subtree=f"tree-{seed}-{n}",
            alone=False,
        )
        for n in range(exercisers)
    ]
    failures: list[BaseException] = []

    def run(exerciser: TreeExerciser) -> None:
        try:
            exerciser.run(ops)
        except BaseException as e:  # raised again on the caller's thread
            failures.append(e)

    threads = [threading.Thread(target=run, args=(exerciser,)) for exerciser in group]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]
    env.umount()
    env.mount()
    for exerciser in group:
        exerciser.compare("after a remount")


def _has_xattrs(entry: tuple[object, ...]) -> bool:
    """Whether a described entry ends with (name, value) pairs."""
    return isinstance(entry[-1], tuple)


def _fits(mode: int, kind: str) -> bool:
    if kind == "file":
        return stat.S_ISREG(mode)
    if kind == "dir":
        return stat.S_ISDIR(mode)
    if kind == "other":
        return not stat.S_ISDIR(mode)
    return True


def _outcome(operation: Callable[[Path], object], root: Path) -> Outcome:
    try:
        return ("ok", operation(root))
    except OSError as e:
        return ("error", errno.errorcode.get(e.errno or 0, str(e.errno)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "root", type=Path, help="an empty directory for the store, mount and reference"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--ops", type=int, default=3000)
    parser.add_argument("--crash", action="store_true", help="kill the daemon now and then")
    parser.add_argument("--commit-interval", default="0.05")
    parser.add_argument("--follower", action="store_true", help="check a read-only mount too")
    args = parser.parse_args()
    options = ("--commit-interval", args.commit_interval)
    with scratch_volume(args.root, options, follower=args.follower) as (env, follower):
        rng, reference = random.Random(args.seed), args.root / "reference"
        exerciser = TreeExerciser(env, reference, rng, args.crash, options, follower)
        exerciser.run(args.ops)
    print(f"seed {args.seed}: {args.ops} operations compared: {dict(exerciser.counts)}")


if __name__ == "__main__":
    main()
