"""Random operation sequences against a reference model, with remounts and crashes.

One trio loop runs in a background thread for the whole test case and hosts the
Volume (whose `running()` context must stay in one task); the state machine's
rules call into it with trio.from_thread. A crash abandons the Volume without
its final commit; the state loaded afterwards must equal the model as it was
after some operation since the last successful fsync (commits are atomic cuts
between operations, and background commits may have happened at any of them).
"""

from __future__ import annotations

import copy
import errno
import random
import stat
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest
import trio
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from sealfs.errors import FsError, StoreError
from sealfs.keys.kdf import Argon2Params
from sealfs.meta.model import ROOT_INO
from sealfs.store.faults import FaultyStore
from sealfs.store.memory import MemoryStore
from sealfs.volume.engine import RENAME_EXCHANGE, RENAME_NOREPLACE, Volume
from sealfs.volume.loader import create_volume
from tests.conftest import PASSPHRASE, RECOVERY_KEY, mounted
from tests.volume.test_engine import (
    GID,
    UID,
    W,
    assert_replay_equals_live,
    install_cached_unlock,
)

T = TypeVar("T")
NAMES = [b"a", b"b", b"c"]
SIZES = [1, 100, 4096, 70_000, 200_000]
MODES = [0o600, 0o644, 0o755]
PICK = st.integers(0, 1000)


class Crash(Exception):
    """Raised inside a mounted volume to abandon it as a killed process would."""


# -- a trio loop in a thread ---------------------------------------------------------------


class Runner:
    def __init__(self) -> None:
        self._ready = threading.Event()
        self._thread = threading.Thread(target=trio.run, args=(self._main,), daemon=True)
        self._thread.start()
        assert self._ready.wait(10)

    async def _main(self) -> None:
        self.token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            self._ready.set()
            await self._stop.wait()
            nursery.cancel_scope.cancel()

    def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        return trio.from_thread.run(fn, *args, trio_token=self.token)

    def close(self) -> None:
        trio.from_thread.run_sync(self._stop.set, trio_token=self.token)
        self._thread.join(30)


class Host:
    """One mounted Volume living in a task of the runner's nursery."""

    def __init__(self, runner: Runner, store: Any, options: dict[str, Any]) -> None:
        self.crash = False
        self.error: BaseException | None = None
        self.volume: Volume = runner.run(self._start, runner, store, options)

    async def _start(self, runner: Runner, store: Any, options: dict[str, Any]) -> Volume:
        self._stop, self._done = trio.Event(), trio.Event()
        return await runner.nursery.start(self._host, store, options)  # type: ignore[no-any-return]

    async def _host(
        self, store: Any, options: dict[str, Any], task_status: trio.TaskStatus[Volume]
    ) -> None:
        started = False
        try:
            async with mounted(store, **options) as volume:
                task_status.started(volume)
                started = True
                await self._stop.wait()
                if self.crash:
                    raise Crash  # noqa: TRY301
        except* Crash:
            pass
        except* Exception as group:
            if not started:
                raise  # the mount itself failed: nursery.start() raises it
            self.error = group
        finally:
            self._done.set()

    async def finish(self, crash: bool) -> None:
        self.crash = crash
        self._stop.set()
        await self._done.wait()
        if self.error is not None:
            raise self.error


# -- the reference model ---------------------------------------------------------------------


@dataclass
class Node:
    kind: str  # "file", "dir", "symlink"
    mode: int
    data: bytearray = field(default_factory=bytearray)
    entries: dict[bytes, int] = field(default_factory=dict)
    parent: int = 0
    target: bytes = b""
    xattrs: dict[bytes, bytes] = field(default_factory=dict)


class Model:
    def __init__(self) -> None:
        self.nodes: dict[int, Node] = {ROOT_INO: Node("dir", stat.S_IFDIR | 0o755)}
        self.nodes[ROOT_INO].parent = ROOT_INO

    def dirs(self) -> list[int]:
        return sorted(ino for ino, n in self.nodes.items() if n.kind == "dir")

    def entries(self) -> list[tuple[int, bytes]]:
        return sorted((d, name) for d in self.dirs() for name in self.nodes[d].entries)

    def names_of(self, ino: int) -> int:
        return sum(list(n.entries.values()).count(ino) for n in self.nodes.values() if n.entries)

    def drop_if_unlinked(self, ino: int) -> None:
        if ino != ROOT_INO and self.names_of(ino) == 0:
            del self.nodes[ino]

    def inside(self, dir_ino: int, target: int) -> bool:
        """Whether target is dir_ino or lies below it."""
        ino = target
        while True:
            if ino == dir_ino:
                return True
            if ino == ROOT_INO:
                return False
            ino = self.nodes[ino].parent

    def rename(self, sp: int, sn: bytes, dp: int, dn: bytes, flags: int) -> int | None:
        """Apply a rename to the model; return the errno the engine must give, or None."""
        src_dir, dst_dir = self.nodes[sp], self.nodes[dp]
        src = src_dir.entries.get(sn)
        if src is None:
            return errno.ENOENT
        dst = dst_dir.entries.get(dn)
        if flags & RENAME_NOREPLACE and dst is not None:
            return errno.EEXIST
        if flags & RENAME_EXCHANGE:
            if dst is None:
                return errno.ENOENT
            if self.nodes[src].kind == "dir" and self.inside(src, dp):
                return errno.EINVAL
            if self.nodes[dst].kind == "dir" and self.inside(dst, sp):
                return errno.EINVAL
            src_dir.entries[sn], dst_dir.entries[dn] = dst, src
            if self.nodes[src].kind == "dir":
                self.nodes[src].parent = dp
            if self.nodes[dst].kind == "dir":
                self.nodes[dst].parent = sp
            return None
        src_is_dir = self.nodes[src].kind == "dir"
        if src_is_dir and self.inside(src, dp):
            return errno.EINVAL
        if dst == src:
            return None
        if dst is not None:
            victim = self.nodes[dst]
            if src_is_dir and victim.kind != "dir":
                return errno.ENOTDIR
            if not src_is_dir and victim.kind == "dir":
                return errno.EISDIR
            if victim.entries:
                return errno.ENOTEMPTY
        del src_dir.entries[sn]
        dst_dir.entries[dn] = src
        if src_is_dir:
            self.nodes[src].parent = dp
        if dst is not None:
            self.drop_if_unlinked(dst)
        return None

    def view(self) -> dict[int, tuple[Any, ...]]:
        out = {}
        for ino, n in self.nodes.items():
            if n.kind == "dir":
                subdirs = sum(1 for c in n.entries.values() if self.nodes[c].kind == "dir")
                nlink = 2 + subdirs
            else:
                nlink = self.names_of(ino)
            body: Any = {
                "file": bytes(n.data),
                "dir": dict(n.entries),
                "symlink": n.target,
            }[n.kind]
            out[ino] = (n.kind, n.mode, nlink, dict(n.xattrs), body)
        return out


async def observe(volume: Volume) -> dict[int, tuple[Any, ...]]:
    """The same view as Model.view, read from the engine: every node reachable from root."""
    out: dict[int, tuple[Any, ...]] = {}
    todo = [ROOT_INO]
    while todo:
        ino = todo.pop()
        if ino in out:
            continue
        inode = volume.meta.inodes[ino]
        if inode.entries is not None:
            kind, body = "dir", dict(inode.entries)
            todo.extend(inode.entries.values())
        elif stat.S_ISLNK(inode.mode):
            kind, body = "symlink", inode.target
        else:
            kind, body = "file", await volume.files.read(inode, 0, inode.size)
            assert len(body) == inode.size
        out[ino] = (kind, inode.mode, inode.nlink, dict(inode.xattrs), body)
    return out


# -- the state machine -------------------------------------------------------------------------

TEMPLATE: dict[str, bytes] = {}


class VolumeMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        inner = MemoryStore()
        inner._objects = dict(TEMPLATE)
        self.store = FaultyStore(inner)
        self.runner = Runner()
        self.model = Model()
        self.durable: list[Model] = [copy.deepcopy(self.model)]
        self.host: Host | None = None
        self.options: dict[str, Any] = {}

    @initialize(interval=st.sampled_from([0.005, 3600.0]))
    def start(self, interval: float) -> None:
        self.options = {
            "commit_interval": interval,
            "flush_threshold": 256 * 1024,
            "max_buffered": 1 << 20,
        }
        self.host = Host(self.runner, self.store, self.options)
        for name in (b"a", b"b"):
            fh, attr = self.call(self.v.create, ROOT_INO, name, 0o644, W, UID, GID)
            self.call(self.v.release, fh)
            self.model.nodes[attr.ino] = Node("file", stat.S_IFREG | 0o644)
            self.model.nodes[ROOT_INO].entries[name] = attr.ino
            self.changed()

    def teardown(self) -> None:
        try:
            if self.host is not None:
                self.runner.run(self.host.finish, False)
        finally:
            self.runner.close()

    @property
    def v(self) -> Volume:
        assert self.host is not None
        return self.host.volume

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        return self.runner.run(fn, *args)

    def expect(self, err: int | None, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        try:
            result = self.call(fn, *args)
        except FsError as exc:
            assert exc.errno == err, (errno.errorcode[exc.errno], err and errno.errorcode[err])
            return None
        assert err is None, f"expected {errno.errorcode[err]}"
        return result

    def changed(self) -> None:
        """A change took effect: a crash from now on may show this state too."""
        self.durable.append(copy.deepcopy(self.model))

    # Every rule draws the same values whatever the model holds (picks are indices taken
    # modulo the current choices): after a crash the model depends on timing, and
    # hypothesis must not see data generation change with it.

    def pick_dir(self, k: int) -> int:
        dirs = self.model.dirs()
        return dirs[k % len(dirs)]

    def pick_kind(self, k: int, *kinds: str) -> int | None:
        inos = sorted(i for i, n in self.model.nodes.items() if n.kind in kinds)
        return inos[k % len(inos)] if inos else None

    def pick_entry(self, k: int) -> tuple[int, bytes] | None:
        entries = self.model.entries()
        return entries[k % len(entries)] if entries else None

    def pick_file_entry(self, k: int) -> tuple[int, bytes, int] | None:
        """(parent, name, inode) of a name of a regular file, if the pick lands on one."""
        picked = self.pick_entry(k)
        if picked is None:
            return None
        parent, name = picked
        ino = self.model.nodes[parent].entries[name]
        return (parent, name, ino) if self.model.nodes[ino].kind == "file" else None

    def add(self, parent: int, name: bytes, ino: int, node: Node) -> None:
        self.model.nodes[ino] = node
        self.model.nodes[parent].entries[name] = ino
        self.changed()

    # -- rules ---------------------------------------------------------------------------------

    @rule(k=PICK, name=st.sampled_from(NAMES), mode=st.sampled_from(MODES))
    def create(self, k: int, name: bytes, mode: int) -> None:
        parent = self.pick_dir(k)
        err = errno.EEXIST if name in self.model.nodes[parent].entries else None
        result = self.expect(err, self.v.create, parent, name, mode, W, UID, GID)
        if result is not None:
            fh, attr = result
            self.call(self.v.release, fh)
            self.add(parent, name, attr.ino, Node("file", stat.S_IFREG | mode))

    @rule(k=PICK, name=st.sampled_from(NAMES))
    def mkdir(self, k: int, name: bytes) -> None:
        parent = self.pick_dir(k)
        err = errno.EEXIST if name in self.model.nodes[parent].entries else None
        attr = self.expect(err, self.v.mkdir, parent, name, 0o755, UID, GID)
        if attr is not None:
            self.add(parent, name, attr.ino, Node("dir", stat.S_IFDIR | 0o755, parent=parent))

    @rule(k=PICK, name=st.sampled_from(NAMES), dest=st.sampled_from([b"x", b"../y"]))
    def symlink(self, k: int, name: bytes, dest: bytes) -> None:
        parent = self.pick_dir(k)
        err = errno.EEXIST if name in self.model.nodes[parent].entries else None
        attr = self.expect(err, self.v.symlink, parent, name, dest, UID, GID)
        if attr is not None:
            self.add(parent, name, attr.ino, Node("symlink", stat.S_IFLNK | 0o777, target=dest))

    async def write_or_errno(self, ino: int, offset: int, payload: bytes) -> int | None:
        """Write through a new handle; the errno if the write was refused."""
        fh = await self.v.open(ino, W)
        try:
            await self.v.write(fh, offset, payload)
        except FsError as exc:
            return exc.errno
        finally:
            await self.v.release(fh)
        return None

    def written(self, ino: int, offset: int, payload: bytes, err: int | None) -> None:
        """Put a write into the model. Here the store never fails a write."""
        assert err is None, errno.errorcode[err]
        buf = self.model.nodes[ino].data
        if offset > len(buf):
            buf.extend(bytes(offset - len(buf)))
        buf[offset : offset + len(payload)] = payload
        self.changed()

    def write(self, k: int, offset: int, size: int, seed: int) -> None:
        ino = self.pick_kind(k, "file")
        if ino is None:
            return
        payload = random.Random(seed).randbytes(size)
        self.written(ino, offset, payload, self.call(self.write_or_errno, ino, offset, payload))

    @rule(k=PICK, offset=st.integers(0, 2000), seed=st.integers(0, 1000))
    def write_small(self, k: int, offset: int, seed: int) -> None:
        self.write(k, offset, 100, seed)

    @rule(
        k=PICK,
        offset=st.integers(0, 400_000),
        size=st.sampled_from(SIZES),
        seed=st.integers(0, 1000),
    )
    def write_any(self, k: int, offset: int, size: int, seed: int) -> None:
        self.write(k, offset, size, seed)

    @rule(k=PICK, size=st.sampled_from(SIZES), seed=st.integers(0, 1000))
    def append(self, k: int, size: int, seed: int) -> None:
        """Continue a file where it ends, as a streaming writer does across commits (whose
        forced cuts the next flush re-chunks)."""
        ino = self.pick_kind(k, "file")
        if ino is not None:
            self.write(k, len(self.model.nodes[ino].data), size, seed)

    @rule(k=PICK, size=st.integers(0, 500_000))
    def truncate(self, k: int, size: int) -> None:
        ino = self.pick_kind(k, "file")
        if ino is None:
            return

        async def go() -> None:
            await self.v.setattr(ino, size=size)

        self.call(go)
        buf = self.model.nodes[ino].data
        if size < len(buf):
            del buf[size:]
        else:
            buf.extend(bytes(size - len(buf)))
        self.changed()

    @rule(k=PICK, mode=st.sampled_from(MODES))
    def chmod(self, k: int, mode: int) -> None:
        ino = self.pick_kind(k, "file", "dir")
        assert ino is not None

        async def go() -> None:
            await self.v.setattr(ino, mode=mode)

        self.call(go)
        node = self.model.nodes[ino]
        node.mode = stat.S_IFMT(node.mode) | mode
        self.changed()

    @rule(k=PICK)
    def unlink(self, k: int) -> None:
        picked = self.pick_entry(k)
        if picked is None:
            return
        parent, name = picked
        ino = self.model.nodes[parent].entries[name]
        is_dir = self.model.nodes[ino].kind == "dir"
        self.expect(errno.EISDIR if is_dir else None, self.v.unlink, parent, name)
        if not is_dir:
            del self.model.nodes[parent].entries[name]
            self.model.drop_if_unlinked(ino)
            self.changed()

    @rule(k=PICK)
    def rmdir(self, k: int) -> None:
        picked = self.pick_entry(k)
        if picked is None:
            return
        parent, name = picked
        node = self.model.nodes[self.model.nodes[parent].entries[name]]
        err = errno.ENOTDIR if node.kind != "dir" else errno.ENOTEMPTY if node.entries else None
        self.expect(err, self.v.rmdir, parent, name)
        if err is None:
            del self.model.nodes[self.model.nodes[parent].entries.pop(name)]
            self.changed()

    @rule(k=PICK, k2=PICK, new_name=st.sampled_from(NAMES), flags=st.sampled_from([0, 0, 1, 2]))
    def rename(self, k: int, k2: int, new_name: bytes, flags: int) -> None:
        picked = self.pick_entry(k)
        if picked is None:
            return
        parent, name = picked
        new_parent = self.pick_dir(k2)
        err = self.model.rename(parent, name, new_parent, new_name, flags)
        self.expect(err, self.v.rename, parent, name, new_parent, new_name, flags)
        if err is None:
            self.changed()

    @rule(k=PICK, k2=PICK, name=st.sampled_from(NAMES))
    def link(self, k: int, k2: int, name: bytes) -> None:
        ino = self.pick_kind(k, "file", "symlink")
        if ino is None:
            return
        parent = self.pick_dir(k2)
        err = errno.EEXIST if name in self.model.nodes[parent].entries else None
        if self.expect(err, self.v.link, ino, parent, name):
            self.model.nodes[parent].entries[name] = ino
            self.changed()

    @rule(
        k=PICK,
        name=st.sampled_from([b"user.a", b"user.b"]),
        value=st.binary(max_size=20),
        remove=st.booleans(),
    )
    def xattr(self, k: int, name: bytes, value: bytes, remove: bool) -> None:
        ino = self.pick_kind(k, "file", "dir", "symlink")
        assert ino is not None
        node = self.model.nodes[ino]
        if remove:
            err = None if name in node.xattrs else errno.ENODATA
            self.expect(err, self.v.removexattr, ino, name)
            if err is None:
                del node.xattrs[name]
                self.changed()
        else:
            self.call(self.v.setxattr, ino, name, value)
            node.xattrs[name] = value
            self.changed()

    @rule(k=PICK, pause=st.integers(0, 12), seed=st.integers(0, 1000))
    def write_then_delete(self, k: int, pause: int, seed: int) -> None:
        """A big write, then the name goes while its early flush may be running."""
        picked = self.pick_file_entry(k)
        if picked is None:
            return
        parent, name, ino = picked
        payload = random.Random(seed).randbytes(300_000)

        async def go() -> int | None:
            err = await self.write_or_errno(ino, 0, payload)
            for _ in range(pause):
                await trio.sleep(0)
            await self.v.unlink(parent, name)
            await self.v.forget(list(self.v._lookups.items()))
            return err

        self.written(ino, 0, payload, self.call(go))
        del self.model.nodes[parent].entries[name]
        self.model.drop_if_unlinked(ino)
        self.changed()

    @rule()
    def forget_everything(self) -> None:
        """The kernel drops its references: unlinked inodes are deleted now."""
        self.call(self.v.forget, list(self.v._lookups.items()))

    @rule(
        fault=st.sampled_from([None, None, "transient", "transient_after", "unavailable"]),
        method=st.sampled_from(["put_if_absent", "put", "sync"]),
    )
    def fsync(self, fault: Any, method: str) -> None:
        if fault is not None:
            self.store.fail_next(method, "l/" if method == "put_if_absent" else "", fault)
        try:
            self.call(self.v.fsync)
        except StoreError:
            assert (
                fault is not None
            )  # not durable, maybe committed: a crash may show any state since
        else:
            self.durable = [copy.deepcopy(self.model)]
        finally:
            self.store.clear()

    @rule(crash=st.booleans())
    def restart(self, crash: bool) -> None:
        """Unmount cleanly (the model is unchanged) or crash (a state since the last fsync)."""
        assert self.host is not None
        self.call(self.host.finish, crash)
        if not crash:
            assert_replay_equals_live(self.store.inner, self.host.volume)
        self.host = Host(self.runner, self.store, self.options)
        seen = self.call(observe, self.v)
        candidates = self.durable if crash else [self.model]
        for candidate in reversed(candidates):
            if candidate.view() == seen:
                self.model = copy.deepcopy(candidate)
                break
        else:
            raise AssertionError(
                f"after {'a crash' if crash else 'a remount'} the volume shows {seen}"
            )
        self.durable = [copy.deepcopy(self.model)]

    @invariant()
    def engine_matches_model(self) -> None:
        if self.host is not None:
            assert self.call(observe, self.v) == self.model.view()

    @invariant()
    def buffered_bytes_add_up(self) -> None:
        async def count() -> tuple[int, int]:
            files = self.v.files
            held = sum(
                fb.dirty.nbytes + (fb.flushing.nbytes if fb.flushing else 0)
                for fb in files.files.values()
            )
            return files.buffered_bytes, held

        if self.host is not None:
            counted, held = self.call(count)
            assert counted == held

    @invariant()
    def dirty_index_matches_buffers(self) -> None:
        async def both() -> tuple[set[int], set[int]]:
            files = self.v.files
            return set(files.dirty_inodes()), {i for i, fb in files.files.items() if fb.dirty}

        if self.host is not None:
            indexed, scanned = self.call(both)
            assert indexed == scanned


def run_machine(
    machine: type[VolumeMachine],
    monkeypatch: pytest.MonkeyPatch,
    kdf_params: Argon2Params,
    *,
    examples: int,
    steps: int,
) -> None:
    """Run a machine over copies of one fresh volume (one key derivation for all)."""
    install_cached_unlock(monkeypatch)
    template = MemoryStore()
    create_volume(template, PASSPHRASE, kdf_params, RECOVERY_KEY)
    TEMPLATE.clear()
    TEMPLATE.update(template._objects)
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=examples,
            stateful_step_count=steps,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        ),
    )


def test_random_operations_against_a_model(
    monkeypatch: pytest.MonkeyPatch, kdf_params: Argon2Params
) -> None:
    run_machine(VolumeMachine, monkeypatch, kdf_params, examples=50, steps=30)
