"""VolumeMachine widened: store faults armed at any point, background commits, early
flushes under a small buffer limit, reads through faults, and crashes at any store write.

Faults stay armed across operations (writes that flush early, the commit loop, reads)
until a rule clears them; a "freeze" makes the store die at its n-th write from now (as
a killed process's store stops changing), after which only a crash may follow.

CI runs a few seconds of it. Longer runs: SEALFS_FUZZ_EXAMPLES and SEALFS_FUZZ_STEPS
(e.g. 400 and 100, with pytest's --timeout=0), SEALFS_FUZZ_LOCAL=1 for a local store
in a temporary directory, SEALFS_FUZZ_HANG for the seconds after which a call counts
as hung.
"""

from __future__ import annotations

import copy
import errno
import os
import random
import tempfile
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest
import trio
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from sealfs.errors import (
    FormatError,
    IntegrityError,
    StoreError,
    StoreUnavailableError,
)
from sealfs.keys.kdf import Argon2Params
from sealfs.meta.model import ROOT_INO
from sealfs.store.faults import FaultyStore
from sealfs.store.local import LocalStore
from sealfs.store.memory import MemoryStore
from sealfs.store.retry import RetryingStore
from tests.conftest import WrappedStore
from tests.volume.test_engine import GID, UID, W, assert_replay_equals_live
from tests.volume.test_stateful import (
    PICK,
    TEMPLATE,
    Host,
    Node,
    VolumeMachine,
    observe,
    run_machine,
)

T = TypeVar("T")
LOCAL = os.environ.get("SEALFS_FUZZ_LOCAL") == "1"
HANG = float(os.environ.get("SEALFS_FUZZ_HANG", "20"))
WRITE_METHODS = ("put", "put_if_absent", "put_if_match", "delete")


class Freezer(WrappedStore):
    """Forwards to inner until armed with n: the n-th write from then on (and every
    later one) finds the store dead, as a killed writer's store stops changing. The
    n-th write itself may land first (land=True), as a request the dying process sent."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self._lock = threading.Lock()
        self.countdown: int | None = None
        self.land = False
        self.dead = False

    def arm(self, n: int, land: bool) -> None:
        with self._lock:
            self.countdown, self.land, self.dead = n, land, False

    def disarm(self) -> None:
        with self._lock:
            self.countdown, self.dead = None, False

    def _write(self, call: Callable[[], None]) -> None:
        with self._lock:
            if self.dead:
                raise StoreUnavailableError("frozen store (the writer is dead)")
            if self.countdown is not None:
                self.countdown -= 1
                if self.countdown <= 0:
                    self.dead = True
                    if self.land:
                        call()
                    raise StoreUnavailableError("frozen store (the writer died here)")
            call()

    def put(self, name: str, data: bytes, *, replace: bool = True) -> None:
        self._write(lambda: self.inner.put(name, data, replace=replace))

    def put_if_absent(self, name: str, data: bytes) -> None:
        self._write(lambda: self.inner.put_if_absent(name, data))

    def put_if_match(self, name: str, data: bytes, etag: str) -> None:
        self._write(lambda: self.inner.put_if_match(name, data, etag))

    def delete(self, name: str) -> None:
        self._write(lambda: self.inner.delete(name))

    def sync(self) -> None:
        with self._lock:
            if self.dead:
                raise StoreUnavailableError("frozen store (the writer is dead)")
        self.inner.sync()


READ_ERRORS = (StoreError, IntegrityError, FormatError)
WRITE_ERRNOS = (errno.ENOSPC, errno.EIO)


class FaultMachine(VolumeMachine):
    def __init__(self) -> None:
        super().__init__()
        inner: Any
        if LOCAL:
            # The local store, where put, rename and fsync ordering are real.
            self.tmp = tempfile.TemporaryDirectory(prefix="sealfs-fault-")
            inner = LocalStore(Path(self.tmp.name) / "store")
            inner.root.mkdir()
            for name, data in TEMPLATE.items():
                inner.put(name, data)
            inner.sync()
        else:
            inner = MemoryStore()
            inner._objects = dict(TEMPLATE)
        self.freezer = Freezer(inner)
        self.store = FaultyStore(self.freezer, seed=1)
        # As a mount wraps its store: transient faults are retried (a few times, at once),
        # then become StoreUnavailableError.
        self.engine_store = RetryingStore(
            self.store, attempts=3, deadline=None, sleep=lambda _: None, base_delay=0.0
        )
        self.armed = False

    @initialize(
        interval=st.sampled_from([0.002, 0.005]),
        threshold=st.sampled_from([64 * 1024, 256 * 1024]),
        limit=st.sampled_from([300 * 1024, 1 << 20]),
    )
    def start(self, interval: float, threshold: int, limit: int) -> None:
        self.options = {
            "commit_interval": interval,
            "flush_threshold": threshold,
            "max_buffered": limit,
        }
        self.host = Host(self.runner, self.engine_store, self.options)
        for name in (b"a", b"b"):
            fh, attr = self.call(self.v.create, ROOT_INO, name, 0o644, W, UID, GID)
            self.call(self.v.release, fh)
            self.model.nodes[attr.ino] = Node("file", 0o100644)
            self.model.nodes[ROOT_INO].entries[name] = attr.ino
            self.changed()

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """As VolumeMachine.call, but a call that hangs fails the test (a writer blocked
        for good, a commit that never ends) instead of the whole run."""

        async def guarded() -> T:
            with trio.fail_after(HANG):
                return await fn(*args)

        return self.runner.run(guarded)

    @contextmanager
    def faults_off(self) -> Iterator[None]:
        """Look at the engine without faults (the invariants' reads must not fail)."""
        with self.store._lock:
            saved = self.store.rules
            self.store.rules = []
        try:
            yield
        finally:
            with self.store._lock:
                self.store.rules = saved + self.store.rules

    @property
    def healthy(self) -> bool:
        return not self.armed and self.freezer.countdown is None

    # -- writes tolerate the documented errors while the store fails ----------------------

    def written(self, ino: int, offset: int, payload: bytes, err: int | None) -> None:
        """A write refused while the store fails wrote nothing (it is refused before
        anything is buffered), and only with the documented errnos."""
        if err is None:
            super().written(ino, offset, payload, None)
            return
        assert err in WRITE_ERRNOS, errno.errorcode[err]
        assert not self.healthy or self.v._flush_errno is not None

    @rule(
        k=PICK,
        pause=st.integers(0, 12),
        seed=st.integers(0, 1000),
        dest=st.sampled_from([b"a", b"b", b"c"]),
    )
    def write_then_rename(self, k: int, pause: int, seed: int, dest: bytes) -> None:
        """A big write, then the file is renamed over another name while it flushes."""
        picked = self.pick_file_entry(k)
        if picked is None:
            return
        parent, name, ino = picked
        payload = random.Random(seed).randbytes(200_000)
        self.written(ino, 0, payload, self.call(self.write_or_errno, ino, 0, payload))

        async def later() -> None:
            for _ in range(pause):
                await trio.sleep(0)

        self.call(later)
        rerr = self.model.rename(parent, name, parent, dest, 0)
        self.expect(rerr, self.v.rename, parent, name, parent, dest, 0)
        if rerr is None:
            self.changed()

    # -- faults --------------------------------------------------------------------------

    @rule(
        method=st.sampled_from(["put", "put_if_absent", "sync", "get", "*"]),
        prefix=st.sampled_from(["", "c/", "l/"]),
        fault=st.sampled_from(
            ["transient", "transient_after", "unavailable", "nospace", "failed", "corrupt"]
        ),
        times=st.sampled_from([1, 2, 5, None]),
    )
    def arm_fault(self, method: str, prefix: str, fault: Any, times: int | None) -> None:
        if fault == "corrupt":
            # One damaged read at a time: more, in a row, of a landed segment whose create's
            # reply was lost are taken for another writer's segment (a fence, by design).
            method, times = "get", 1
            if any(r.fault == "corrupt" and r.times != 0 for r in self.store.rules):
                return
        if method == "sync":
            prefix = ""
        self.store.add_rule(method, prefix, fault, times=times)
        self.armed = True

    def settle(self) -> None:
        """Wait for the commit in flight, if any: it may have met a fault just removed.

        sync() passes on the StoreUnavailableError of a commit already running when it
        was called (by design: waiting for one more would double the store timeout),
        so an fsync right after the faults are cleared failed with a fault that the
        background commit had met before the clear (seen about once in 40 runs)."""

        async def commit_in_flight_done() -> None:
            async with self.v.commits._lock:
                pass

        self.call(commit_in_flight_done)

    @rule()
    def clear_faults(self) -> None:
        """The store recovers: the next fsync must succeed and make everything durable."""
        self.store.clear()
        self.armed = False
        if self.freezer.countdown is not None:
            return  # the writer is dead already: only a crash follows
        self.settle()
        self.call(self.v.fsync)
        self.durable = [copy.deepcopy(self.model)]
        self.assert_nothing_buffered()

    @precondition(lambda self: self.freezer.countdown is None)
    @rule(n=st.integers(1, 12), land=st.booleans())
    def freeze_at(self, n: int, land: bool) -> None:
        self.freezer.arm(n, land)

    @rule(ms=st.sampled_from([1, 5, 20]))
    def sleep(self, ms: int) -> None:
        """Let the commit loop and early-flush retries run."""
        self.call(trio.sleep, ms / 1000)

    @rule(k=PICK, offset=st.integers(0, 300_000), size=st.sampled_from([1, 4096, 200_000]))
    def read(self, k: int, offset: int, size: int) -> None:
        """Reads through faults: the model's bytes, or an error; never other bytes."""
        ino = self.pick_kind(k, "file")
        if ino is None:
            return

        async def go() -> bytes | BaseException:
            fh = await self.v.open(ino, os.O_RDONLY)
            try:
                return bytes(await self.v.read(fh, offset, size))
            except READ_ERRORS as exc:
                return exc
            finally:
                await self.v.release(fh)

        got = self.call(go)
        if isinstance(got, BaseException):
            assert self.armed, got
            return
        assert got == bytes(self.model.nodes[ino].data[offset : offset + size])

    def assert_nothing_buffered(self) -> None:
        async def count() -> int:
            return self.v.files.buffered_bytes

        assert self.call(count) == 0

    @rule(
        fault=st.sampled_from([None, None, "transient", "transient_after", "unavailable"]),
        method=st.sampled_from(["put_if_absent", "put", "sync"]),
    )
    def fsync(self, fault: Any, method: str) -> None:
        armed = None
        if fault is not None:
            armed = self.store.fail_next(method, "l/" if method == "put_if_absent" else "", fault)
        try:
            self.call(self.v.fsync)
        except StoreError:
            assert fault is not None or not self.healthy
        else:
            self.durable = [copy.deepcopy(self.model)]
        finally:
            if armed is not None:
                with self.store._lock:
                    self.store.rules = [r for r in self.store.rules if r is not armed]
                self.settle()

    @rule(crash=st.booleans())
    def restart(self, crash: bool) -> None:
        if not crash:
            if self.freezer.countdown is not None:
                crash = True  # a dead writer cannot unmount cleanly
            else:
                self.store.clear()
                self.armed = False
        assert self.host is not None
        if crash:
            self.call(self.host.finish, True)
            self.store.clear()
            self.armed = False
            self.freezer.disarm()
            self.host = Host(self.runner, self.engine_store, self.options)
            seen = self.call(observe, self.v)
            for candidate in reversed(self.durable):
                if candidate.view() == seen:
                    self.model = copy.deepcopy(candidate)
                    break
            else:
                raise AssertionError(f"after a crash the volume shows {seen}")
            self.durable = [copy.deepcopy(self.model)]
        else:
            self.call(self.host.finish, False)
            assert_replay_equals_live(self.freezer.inner, self.host.volume)
            self.host = Host(self.runner, self.engine_store, self.options)
            seen = self.call(observe, self.v)
            assert seen == self.model.view(), f"after a remount the volume shows {seen}"
            self.durable = [copy.deepcopy(self.model)]

    def teardown(self) -> None:
        self.store.clear()
        if self.freezer.countdown is not None and self.host is not None:
            self.freezer.disarm()
            try:
                self.runner.run(self.host.finish, True)
            finally:
                self.host = None
        try:
            super().teardown()
        finally:
            if LOCAL:
                self.tmp.cleanup()

    @invariant()
    def not_fenced(self) -> None:
        """No other writer exists: whatever the store did, the writer must not fence itself."""
        if self.host is not None:
            stopped = self.v.commits.stopped
            assert stopped is None, (stopped, self.store.injected[-8:])

    @invariant()
    def engine_matches_model(self) -> None:
        if self.host is not None:
            with self.faults_off():
                seen = self.call(observe, self.v)
            assert seen == self.model.view()


def test_random_operations_with_store_faults(
    monkeypatch: pytest.MonkeyPatch, kdf_params: Argon2Params
) -> None:
    run_machine(
        FaultMachine,
        monkeypatch,
        kdf_params,
        examples=int(os.environ.get("SEALFS_FUZZ_EXAMPLES", "40")),
        steps=int(os.environ.get("SEALFS_FUZZ_STEPS", "30")),
    )
