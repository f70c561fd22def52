"""A file exerciser in the manner of fsx: random I/O on one file of a real mount,
every read checked against a model of what the file must hold.

Each path the kernel serves a file by is taken at random: write(2) at any
offset (holes included), O_APPEND, O_DIRECT reads and writes that bypass the
page cache, shared mappings, truncation up and down, fsync and fdatasync,
dropping the page cache so that reads reach the daemon, reopening, unmounting
and, in crash mode, SIGKILL of the daemon. Written bytes are random, repeated
(compressible) or copied from elsewhere in the file (deduplicated chunks), so
the chunker, compressor and chunk table are crossed as well.

After a kill the file must hold one of the states since the last sync: the
durability promise, for one file. For that every write stays one FUSE request
(at most 64 KiB) and every mapped write is synced at once (msync), so each
operation is all or nothing in the daemon.

Run it longer than the tests do with
`python -m tests.fuse.file_exerciser DIR --seed N --ops N` (`--help` for the rest).
"""

from __future__ import annotations

import argparse
import collections
import mmap
import os
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from tests.fuse.exercising import Operations, Recent, run_at_random
from tests.mounts import VolumeEnv, reached, scratch_volume, sealfs, wait_until

KiB = 1 << 10
DIRECT_ALIGN = 4 * KiB  # O_DIRECT offsets, lengths and buffers
ONE_REQUEST = 64 * KiB  # a write no larger than this is one FUSE WRITE


class Mismatch(AssertionError):
    """The file held other bytes than the model says it must."""


@dataclass
class Exerciser:
    """Random operations on env.mnt/name, checked against a bytearray model."""

    env: VolumeEnv
    rng: random.Random
    max_size: int = 1 << 20
    crash: bool = False
    mount_options: tuple[str, ...] = ()
    base: int = 0  # where the exercised bytes start: a hole before them (past 4 GiB, say)
    follower: Path | None = None  # a read-only mount of the volume, checked after fsyncs
    follower_fd: int | None = None
    rekeys: bool = False  # start rekeys of the mounted volume now and then
    name: str = "exercised"
    model: bytearray = field(default_factory=bytearray)
    since_sync: list[bytes] = field(default_factory=list)  # states a crash may leave
    history: Recent = field(default_factory=Recent)
    fds: dict[str, int] = field(default_factory=dict)
    counts: collections.Counter[str] = field(default_factory=collections.Counter)

    @property
    def path(self) -> Path:
        return self.env.mnt / self.name

    def run(self, ops: int) -> None:
        self.path.write_bytes(b"")
        self._open_all()
        os.ftruncate(self.fds["rw"], self.base)
        os.fsync(self.fds["rw"])  # the file's creation, so that a crash cannot undo it
        self.since_sync = [bytes(self.model)]
        try:
            run_at_random(self.rng, self._operations(), ops, self.counts)
            self._close_all()
            self._check_whole_file("at the end")
        finally:
            self._close_all()
            if self.follower_fd is not None:
                os.close(self.follower_fd)

    def _operations(self) -> Operations:
        ops: Operations = {
            "write": (20, self.write),
            "append": (6, self.append),
            "read": (20, self.read),
            "direct read": (5, self.direct_read),
            "direct write": (5, self.direct_write),
            "truncate": (5, self.truncate),
            "mapped write": (5, self.mapped_write),
            "mapped read": (4, self.mapped_read),
            "fsync": (4, self.fsync),
            "drop cache": (4, self.drop_cache),
            "reopen": (3, self.reopen),
            "remount": (1, self.remount),
        }
        if self.crash:
            ops["kill"] = (1, self.kill)
        if self.rekeys:
            ops["rekey"] = (1, self.rekey)
        return ops

    # -- the operations ------------------------------------------------------------

    def write(self) -> None:
        offset = self.rng.randrange(0, max(1, min(len(self.model) + 64 * KiB, self.max_size)))
        data = self._data(self._length(self.max_size - offset))
        if not data:
            return
        self._note(f"pwrite {offset}+{len(data)}")
        assert os.pwrite(self.fds["rw"], data, self.base + offset) == len(data)
        self._apply(offset, data)

    def append(self) -> None:
        data = self._data(self._length(self.max_size - len(self.model)))
        if not data:
            return
        self._note(f"append {len(self.model)}+{len(data)}")
        assert os.write(self.fds["append"], data) == len(data)
        self._apply(len(self.model), data)

    def read(self) -> None:
        offset, length = self._range()
        self._note(f"pread {offset}+{length}")
        fd = self.fds[self.rng.choice(["ro", "rw"])]
        self._expect(os.pread(fd, length, self.base + offset), offset, length)

    def direct_read(self) -> None:
        offset = self.rng.randrange(0, len(self.model) + DIRECT_ALIGN, DIRECT_ALIGN)
        length = self.rng.randrange(DIRECT_ALIGN, 33 * DIRECT_ALIGN, DIRECT_ALIGN)
        self._note(f"direct pread {offset}+{length}")
        with mmap.mmap(-1, length) as buffer:  # page-aligned, as O_DIRECT wants
            got = os.preadv(self.fds["direct"], [buffer], self.base + offset)
            self._expect(buffer[:got], offset, length)

    def direct_write(self) -> None:
        room = self.max_size - DIRECT_ALIGN
        offset = self.rng.randrange(0, max(1, min(len(self.model) + DIRECT_ALIGN, room)))
        offset -= offset % DIRECT_ALIGN
        length = self.rng.randrange(DIRECT_ALIGN, ONE_REQUEST + 1, DIRECT_ALIGN)
        length = min(length, self.max_size - offset)
        data = self._data(length)
        self._note(f"direct pwrite {offset}+{length}")
        with mmap.mmap(-1, length) as buffer:
            buffer[:] = data
            assert os.pwritev(self.fds["direct"], [buffer], self.base + offset) == length
        self._apply(offset, data)

    def truncate(self) -> None:
        size = self.rng.choice(
            [0, self.rng.randrange(0, self.max_size + 1), len(self.model) // 2, len(self.model) + 1]
        )
        size = min(size, self.max_size)
        self._note(f"ftruncate {size}")
        os.ftruncate(self.fds["rw"], self.base + size)
        if size < len(self.model):
            del self.model[size:]
        else:
            self.model.extend(bytes(size - len(self.model)))
        self._changed()

    def mapped_write(self) -> None:
        if not self.model:
            return
        offset, length = self._range(within=True)
        data = self._data(length)
        synced = self.crash or self.rng.random() < 0.5
        self._note(f"mapped write {offset}+{length}{' msync' if synced else ''}")
        with mmap.mmap(self.fds["rw"], len(self.model), offset=self.base) as mapping:
            mapping[offset : offset + length] = data
            if synced:
                mapping.flush()
        self._apply(offset, data)
        if synced:
            self._synced()

    def mapped_read(self) -> None:
        if not self.model:
            return
        offset, length = self._range(within=True)
        self._note(f"mapped read {offset}+{length}")
        with mmap.mmap(
            self.fds["ro"], len(self.model), prot=mmap.PROT_READ, offset=self.base
        ) as mapping:
            self._expect(mapping[offset : offset + length], offset, length)

    def fsync(self) -> None:
        which = self.rng.choice(["rw", "append", "direct"])
        data_only = self.rng.random() < 0.5
        self._note(f"{'fdatasync' if data_only else 'fsync'} {which}")
        (os.fdatasync if data_only else os.fsync)(self.fds[which])
        self._synced()
        if self.follower is not None:
            self._check_follower(self.follower)

    def _check_follower(self, follower: Path) -> None:
        """Once it has replayed the generation fsync committed, the read-only mount shows
        the file as it is."""
        wait_until(partial(reached, follower, self.env.status()["generation"]), 15)
        if self._exercised_bytes(follower / self.name) != self.model:
            raise Mismatch("the read-only mount shows other bytes\n" + str(self.history))
        if self.follower_fd is None:  # held open across replays, so its pages stay cached
            self.follower_fd = os.open(follower / self.name, os.O_RDONLY)
        held = os.pread(self.follower_fd, len(self.model) + 1, self.base)
        if held != self.model:
            raise Mismatch(
                "a descriptor held on the read-only mount reads other bytes\n" + str(self.history)
            )

    def drop_cache(self) -> None:
        """Drop the clean cached pages, so the next reads come from the daemon."""
        self._note("drop cache")
        os.posix_fadvise(self.fds["ro"], 0, 0, os.POSIX_FADV_DONTNEED)

    def reopen(self) -> None:
        which = self.rng.choice(sorted(self.fds))
        self._note(f"reopen {which}")
        os.close(self.fds.pop(which))
        self._open(which)

    def rekey(self) -> None:
        """Start a rekey of the mounted volume: the daemon re-seals every object in the
        background while the operations go on (and kills, remounts, follower checks)."""
        self._note("rekey --no-wait")
        started = sealfs(
            "rekey", str(self.env.store), "--passphrase-file", str(self.env.passfile),
            "--recovery-key-file", str(self.env.recovery_file), "--no-wait",
        )  # fmt: skip
        if started.returncode != 0:
            raise Mismatch(f"the rekey did not start: {started.stderr}" + str(self.history))

    def remount(self) -> None:
        self._note("remount")
        self._close_all()
        self.env.umount()
        self.env.mount(*self.mount_options)
        self._synced()
        self._check_whole_file("after a remount")
        self._open_all()

    def kill(self) -> None:
        self._note("kill -9, mount")
        self._close_all()
        self.env.kill()
        self.env.mount(*self.mount_options)
        got = self._exercised_bytes()
        if got not in self.since_sync:
            raise Mismatch(self._explain(got, "after a crash, not a state since the last sync"))
        self.model = bytearray(got)
        self._synced()
        self._open_all()

    # -- helpers -------------------------------------------------------------------

    def _length(self, room: int) -> int:
        """Mostly small writes, some up to one request's worth."""
        limit = min(room, ONE_REQUEST)
        if limit <= 0:
            return 0
        return min(
            limit,
            int(self.rng.choice([1, 7, 100, 4 * KiB, 16 * KiB, ONE_REQUEST]) * self.rng.random())
            + 1,
        )

    def _data(self, length: int) -> bytes:
        kind = self.rng.random()
        if kind < 0.4:
            return self.rng.randbytes(length)
        if kind < 0.7:  # compressible
            unit = self.rng.randbytes(self.rng.randrange(1, 64))
            return (unit * (length // len(unit) + 1))[:length]
        if kind < 0.8:
            return bytes(length)
        if len(self.model) > length:  # a copy of bytes already in the file: dedup
            start = self.rng.randrange(0, len(self.model) - length)
            return bytes(self.model[start : start + length])
        return self.rng.randbytes(length)

    def _range(self, *, within: bool = False) -> tuple[int, int]:
        """A range to read, sometimes past the end of the file unless within."""
        size = len(self.model)
        end = size if within else size + 8 * KiB
        offset = self.rng.randrange(0, max(1, end))
        length = self.rng.randrange(1, 128 * KiB)
        if within:
            length = max(1, min(length, size - offset))
        return offset, length

    def _apply(self, offset: int, data: bytes) -> None:
        if offset > len(self.model):
            self.model.extend(bytes(offset - len(self.model)))
        self.model[offset : offset + len(data)] = data
        self._changed()

    def _changed(self) -> None:
        self.since_sync.append(bytes(self.model))

    def _synced(self) -> None:
        self.since_sync = [bytes(self.model)]

    def _expect(self, got: bytes, offset: int, length: int) -> None:
        """got is what a read of length bytes at offset returned: the model's bytes there,
        as many as the file holds."""
        want = bytes(self.model[offset : offset + length])
        if got == want:
            return
        if len(got) != len(want):
            problem = f"{len(got)} bytes read at {offset}+{length}, want {len(want)}"
        else:
            at = offset + next(i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
            problem = f"wrong byte at {at} (read at {offset}+{length})"
        raise Mismatch(problem + "\n" + str(self.history))

    def _exercised_bytes(self, path: Path | None = None) -> bytes:
        """The file's bytes from base on, once the hole before them is checked."""
        with open(path or self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < self.base:
                raise Mismatch(
                    f"size {size}, below the hole of {self.base} bytes\n" + str(self.history)
                )
            if self.base and os.pread(f.fileno(), 4 * KiB, self.base - 4 * KiB) != bytes(4 * KiB):
                raise Mismatch(
                    "the hole before the exercised bytes holds data\n" + str(self.history)
                )
            f.seek(self.base)
            return f.read()

    def _check_whole_file(self, when: str) -> None:
        got = self._exercised_bytes()
        if got != self.model:
            raise Mismatch(self._explain(got, when))

    def _explain(self, got: bytes, when: str) -> str:
        if len(got) != len(self.model):
            return f"{when}: size {len(got)}, want {len(self.model)}\n" + str(self.history)
        at = next(i for i, (a, b) in enumerate(zip(got, self.model, strict=True)) if a != b)
        return f"{when}: first wrong byte at {at}\n" + str(self.history)

    def _note(self, text: str) -> None:
        self.history.note(f"{text} (size {len(self.model)})")

    def _open(self, which: str) -> None:
        flags = {
            "rw": os.O_RDWR,
            "append": os.O_WRONLY | os.O_APPEND,
            "ro": os.O_RDONLY,
            "direct": os.O_RDWR | os.O_DIRECT,
        }[which]
        self.fds[which] = os.open(self.path, flags)

    def _open_all(self) -> None:
        for which in ("rw", "append", "ro", "direct"):
            self._open(which)

    def _close_all(self) -> None:
        while self.fds:
            os.close(self.fds.popitem()[1])


def exercise_stripes(
    env: VolumeEnv, seed: int, ops: int, writers: int = 4, stripe: int = 256 * KiB
) -> None:
    """Writers on threads of their own, each writing and reading back its own stripe of
    one file through its own descriptor, while another thread syncs and drops the page
    cache: requests for one file reach the daemon side by side. After an unmount and a
    mount the file must hold every stripe's last bytes."""
    path = env.mnt / "striped"
    path.write_bytes(bytes(writers * stripe))
    stripes = [bytearray(stripe) for _ in range(writers)]
    failures: list[BaseException] = []
    done = threading.Event()

    def write_stripe(number: int) -> None:
        rng, model, start = random.Random(seed * 100 + number), stripes[number], number * stripe
        fd = os.open(path, os.O_RDWR)
        try:
            for _ in range(ops):
                offset = rng.randrange(0, stripe)
                if rng.random() < 0.6:
                    data = rng.randbytes(rng.randrange(1, min(stripe - offset, 32 * KiB) + 1))
                    assert os.pwrite(fd, data, start + offset) == len(data)
                    model[offset : offset + len(data)] = data
                else:
                    length = rng.randrange(1, stripe - offset + 1)
                    got = os.pread(fd, length, start + offset)
                    assert got == model[offset : offset + length], f"stripe {number} at {offset}"
        finally:
            os.close(fd)

    def sync_and_drop() -> None:
        rng = random.Random(seed)
        fd = os.open(path, os.O_RDONLY)
        try:
            while not done.wait(rng.random() / 50):
                if rng.random() < 0.5:
                    os.fsync(fd)
                else:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    def guarded(work: Callable[..., None], *args: int) -> threading.Thread:
        def run() -> None:
            try:
                work(*args)
            except BaseException as e:  # raised again on the test's thread
                failures.append(e)

        return threading.Thread(target=run)

    threads = [guarded(write_stripe, n) for n in range(writers)]
    syncer = guarded(sync_and_drop)
    for thread in [*threads, syncer]:
        thread.start()
    for thread in threads:
        thread.join()
    done.set()
    syncer.join()
    if failures:
        raise failures[0]
    env.umount()
    env.mount()
    if path.read_bytes() != b"".join(stripes):
        raise Mismatch("after a remount, the striped file lost some writer's last bytes")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="an empty directory for the store and mount")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--ops", type=int, default=5000)
    parser.add_argument("--crash", action="store_true", help="kill the daemon now and then")
    parser.add_argument("--commit-interval", default="0.05")
    parser.add_argument("--max-size", type=int, default=1 << 20, help="bytes the file may grow to")
    parser.add_argument("--base", type=int, default=0, help="a hole this long before them")
    parser.add_argument("--follower", action="store_true", help="check a read-only mount too")
    parser.add_argument("--rekeys", action="store_true", help="rekey the volume now and then")
    args = parser.parse_args()
    options = ("--commit-interval", args.commit_interval)
    with scratch_volume(args.root, options, follower=args.follower) as (env, follower):
        rng = random.Random(args.seed)
        exerciser = Exerciser(
            env, rng, args.max_size, args.crash, options, args.base, follower, rekeys=args.rekeys
        )
        exerciser.run(args.ops)
    print(f"seed {args.seed}: {args.ops} operations checked: {dict(exerciser.counts)}")


if __name__ == "__main__":
    main()
