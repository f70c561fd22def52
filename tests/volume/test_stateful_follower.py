"""VolumeMachine with a read-only mount of the same store beside the writer, used as the
kernel uses it: names looked up, files held open across the commits it follows, pages
read at any offset, references dropped in any order.

After the writer's fsync and the reader's catch-up, the reader shows the writer's tree.
At any time, a page read through a held handle is a slice of a version that file had
after some operation: never ESTALE or EIO because the writer replaced, shrank or
deleted it, never bytes (zeros) no version held. Once the kernel lets go of
everything, the reader keeps no deleted inode nor pre-shrink copy.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule

from sealfs.keys.kdf import Argon2Params
from sealfs.meta.model import ROOT_INO
from sealfs.volume.engine import Volume
from tests.volume.test_stateful import PICK, Host, VolumeMachine, observe, run_machine

PAGE = 4096
KERNEL_READ = 128 * 1024  # the largest READ the kernel sends at the default read-ahead


class FollowedVolumeMachine(VolumeMachine):
    def __init__(self) -> None:
        super().__init__()
        self.reader_host: Host | None = None
        self.held: list[tuple[int, int]] = []  # (fh, ino) the reader's kernel holds open
        self.versions: dict[int, set[bytes]] = {}  # every content each file has had

    @initialize(interval=st.sampled_from([0.005, 3600.0]))
    def start(self, interval: float) -> None:
        super().start(interval)
        self.reader_host = Host(
            self.runner, self.store, {"read_only": True, "commit_interval": 3600.0}
        )

    def teardown(self) -> None:
        try:
            if self.reader_host is not None:
                self.runner.run(self.reader_host.finish, False)
        finally:
            super().teardown()

    @property
    def r(self) -> Volume:
        assert self.reader_host is not None
        return self.reader_host.volume

    def changed(self) -> None:
        super().changed()
        for ino, node in self.model.nodes.items():
            if node.kind == "file":
                self.versions.setdefault(ino, set()).add(bytes(node.data))

    def _reader_files(self) -> list[tuple[int, bytes, int]]:
        """(parent, name, inode) of each name of a regular file the reader shows."""
        inodes = self.r.meta.inodes
        return sorted(
            (d, name, ino)
            for d, directory in inodes.items()
            if directory.entries is not None
            for name, ino in directory.entries.items()
            if inodes[ino].is_reg
        )

    def _check_page(self, fh: int, ino: int, page: int) -> None:
        """A page read through a held handle is a slice of some version of the file."""
        offset = page * PAGE
        got = bytes(self.call(self.r.read, fh, offset, PAGE))
        if not any(v[offset : offset + PAGE] == got for v in self.versions.get(ino, ())):
            raise AssertionError(f"inode {ino} page {page}: {len(got)} bytes no version held")

    # -- the reader's kernel -------------------------------------------------------------

    @rule(
        action=st.sampled_from(["open", "read", "read", "close"]), k=PICK, page=st.integers(0, 130)
    )
    def reader_kernel(self, action: str, k: int, page: int) -> None:
        """One rule for the reader's kernel: one rule per action left them to a few
        steps in a thousand among the writer's rules."""
        {"open": self._open, "read": self._read_held, "close": self._close}[action](k, page)

    def _open(self, k: int, page: int) -> None:
        """A name looked up and opened: the kernel holds both until release and forget."""
        files = self._reader_files()
        if not files:
            return
        parent, name, ino = files[k % len(files)]
        assert self.call(self.r.lookup, parent, name).ino == ino
        self.held.append((self.call(self.r.open, ino, os.O_RDONLY), ino))

    def _read_held(self, k: int, page: int) -> None:
        if self.held:
            fh, ino = self.held[k % len(self.held)]
            self.call(self.r.getattr, ino)  # the kernel asks; a replaced inode must answer
            self._check_page(fh, ino, page)

    def _close(self, k: int, page: int) -> None:
        if self.held:
            fh, ino = self.held.pop(k % len(self.held))
            self.call(self.r.release, fh)
            self.call(self.r.forget, [(ino, 1)])

    @rule(hold=st.booleans(), k=PICK, page=st.integers(0, 130))
    def follow(self, hold: bool, k: int, page: int) -> None:
        """The writer commits; the reader catches up and shows the writer's tree, each
        file read by name as the kernel reads it (pages up to the end's page); then
        maybe holds one more file, as a reader that goes on with the new version."""
        self.store.clear()
        self.call(self.v.fsync)
        self.durable = [copy.deepcopy(self.model)]
        follower = self.r.follower
        assert follower is not None
        self.call(follower.catch_up)
        assert follower.stopped is None, follower.stopped
        assert self.call(observe, self.r) == self.model.view()
        for parent, name, ino in self._reader_files():
            self._read_by_name(parent, name, ino)
        for fh, ino in self.held:
            self._check_page(fh, ino, 0)
            self._check_page(fh, ino, page)
        if hold:
            self._open(k, page)

    def _read_by_name(self, parent: int, name: bytes, ino: int) -> None:
        async def read() -> bytes:
            size = (await self.r.lookup(parent, name)).size
            fh = await self.r.open(ino, os.O_RDONLY)
            try:
                end = -(-size // PAGE) * PAGE
                pieces = [
                    bytes(await self.r.read(fh, offset, min(KERNEL_READ, end - offset)))
                    for offset in range(0, end, KERNEL_READ)
                ]
            finally:
                await self.r.release(fh)
                await self.r.forget([(ino, 1)])
            return b"".join(pieces)[:size]

        assert self.call(read) == bytes(self.model.nodes[ino].data), f"inode {ino} by name"

    @invariant()
    def reader_keeps_nothing_the_kernel_let_go(self) -> None:
        if self.reader_host is None or self.held:
            return
        kept: Any = (set(self.r._detached), set(self.r._before_shrink))
        assert kept == (set(), set()), f"kept for nobody: {kept}"
        assert ROOT_INO in self.r.meta.inodes


def test_a_follower_used_as_the_kernel_uses_it_matches_the_writer(
    monkeypatch: pytest.MonkeyPatch, kdf_params: Argon2Params
) -> None:
    run_machine(FollowedVolumeMachine, monkeypatch, kdf_params, examples=40, steps=40)
