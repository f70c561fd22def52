"""The crash oracle with writers side by side, and with crashes in mid-mount snapshots.

tests/spec/test_crash_oracle.py runs one workload. Here several run at once, each
its own process making names of its own (a prefix) in the root directory they
share, so directory entries interleave while each writer's names depend on its
own ops alone. After the kill the clean-room reader's tree, cut into each writer's
names, must be for each writer the model after some prefix of its journal, and
those prefixes must together be one cut of the volume (README, Durability: "sealfs
commits the whole volume at once"; fsync commits "every earlier operation on the
volume"). The journals time every call with CLOCK_MONOTONIC, which one host's
processes share, so:

- an op of one writer that had returned before a barrier (fsync, O_DSYNC write,
  with --sync-on-close a close) of another began must be in the state if that
  barrier returned;
- if an op of one writer is in the state (even cut short), every op of another
  writer that had returned before it began must be too: no commit takes a later
  op and leaves out an earlier one.

Each writer's prefixes are found alone (as the one-writer oracle finds them); the
least prefixes meeting both rules are then found by raising lower bounds until
none moves, which finds a solution if there is one, since each rule only ever asks
for more ops of a writer as the others' prefixes grow.

A mounted volume writes a snapshot once the log since the last one grows past
SNAPSHOT_EVERY_OPS records, far more than a test makes; the snapshot test lowers
it in the daemon alone (a sitecustomize module on its PYTHONPATH, as
tests/fuse/test_crash.py injects bugs), and makes the daemon kill itself at a
chosen step of a snapshot: compacting, sealed, its object created, an old one's
deletion. Its other rounds kill the daemon from outside just after a snapshot
appeared. The test asserts that its crashes did land so, and that the reader
started from a snapshot written under the running mount. Its recovery mounts write
a snapshot at every unmount (SNAPSHOT_AT_CLOSE_OPS lowered too), so the kill during
an unmount that the one-writer oracle makes may land in one.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.mounts import VolumeEnv, force_unmount
from tests.prereq import require
from tests.spec import crash_model
from tests.spec.crash_model import Journal, Model
from tests.spec.reader import Node, read_volume
from tests.spec.test_crash_oracle import (
    COMMIT_INTERVALS,
    REPO,
    Verdict,
    _seeds,
    check_sealfs_agrees,
    describe,
    judge,
)

pytestmark = [pytest.mark.fuse, pytest.mark.slow]

# SEALFS_ORACLE_WRITER_SEEDS="1 2 3 ..." and _SNAPSHOT_SEEDS search further (with
# SEALFS_ORACLE_ROUNDS rounds each).
ROUNDS = int(os.environ.get("SEALFS_ORACLE_ROUNDS", "2"))
WRITER_SEEDS = _seeds("SEALFS_ORACLE_WRITER_SEEDS", [11])
SNAPSHOT_SEEDS = _seeds("SEALFS_ORACLE_SNAPSHOT_SEEDS", [21])
# Records in the log since the last snapshot that make a mounted volume write one, in
# the snapshot test (sealfs: 50,000): a snapshot every few commits.
SNAPSHOT_EVERY_OPS = 150
# How long a round waits for its daemon to die at its chosen step of a snapshot
# before the test fails: a guard against a hang, far above the second or two it takes
# and below pytest's timeout (pyproject.toml), so that the failure says what it is.
DEATH_GUARD = 60.0

# The daemon's side of the snapshot test: snapshots due early (and at every unmount),
# and a SIGKILL of its own process at the DIE_AT-th step of a snapshot (0: never),
# after writing which one to MARK (outside the mount, fsynced).
SNAPSHOTS_SOON = """
import os, signal, threading
from sealfs.store.local import LocalStore
from sealfs.volume import committer

committer.SNAPSHOT_EVERY_OPS = int(os.environ["ORACLE_SNAPSHOT_EVERY_OPS"])
committer.SNAPSHOT_AT_CLOSE_OPS = 1
DIE_AT, MARK = int(os.environ["ORACLE_DIE_AT"]), os.environ["ORACLE_MARK"]
steps, lock = [0], threading.Lock()

def step(what):
    with lock:
        steps[0] += 1
        if steps[0] != DIE_AT:
            return
        fd = os.open(MARK, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.write(fd, what.encode())
        os.fsync(fd)
        os.kill(os.getpid(), signal.SIGKILL)

compact = committer._compact_unscanned

def compacting(*args):
    step("compacting")
    out = compact(*args)
    step(f"sealed s/{out[0]:016d}")
    return out

committer._compact_unscanned = compacting
put_if_absent, delete = LocalStore.put_if_absent, LocalStore.delete

def put(self, name, data):
    put_if_absent(self, name, data)
    if name.startswith("s/"):
        step(f"created {name}")

def deleting(self, name):
    if name.startswith("s/"):
        step(f"deleting {name}")
    delete(self, name)
    if name.startswith("s/"):
        step(f"deleted {name}")

LocalStore.put_if_absent, LocalStore.delete = put, deleting
"""


@dataclass
class Writer:
    """One workload process of a round, and what the rounds before left of its tree."""

    prefix: str
    history: list[dict[str, Any]]
    proc: subprocess.Popen[str] | None = None
    journal: Journal | None = None


def start_writer(
    env: VolumeEnv, writer: Writer, seed: int, name: str, *, fsyncs: int, stream: int
) -> None:
    """Start writer's workload in the shared root, from the tree its history made."""
    base = env.root / f"base-{name}.json"
    base.write_text(json.dumps(writer.history))
    pythonpath = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.spec.crash_model", str(env.mnt),
         str(env.root / f"journal-{name}"), str(seed), "1000000", str(fsyncs), str(stream),
         str(base) if writer.history else "-", writer.prefix],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
        env={**os.environ, "PYTHONPATH": pythonpath},
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line == "started\n", line + (proc.stderr.read() if proc.stderr else "")
    writer.proc = proc


def crash_writers(
    env: VolumeEnv, writers: list[Writer], name: str, on_close: bool, *, wait: float
) -> bool:
    """Let the daemon die on its own within wait seconds, else SIGKILL it; then let
    every workload stop at its first failed call, clear the dead mount, and read the
    journals. Returns whether the daemon died on its own."""
    deadline = time.monotonic() + wait
    while env.daemon_pids() and time.monotonic() < deadline:
        time.sleep(0.01)
    on_its_own = not env.daemon_pids()
    for pid in env.daemon_pids():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    outcomes = []
    for writer in writers:
        assert writer.proc is not None
        try:
            out, err = writer.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            writer.proc.kill()
            out, err = writer.proc.communicate(timeout=20)
        outcomes.append((writer.proc.returncode, out, err))
    deadline = time.monotonic() + 30
    while env.daemon_pids() and time.monotonic() < deadline:
        time.sleep(0.02)
    force_unmount(str(env.mnt))
    env._disarm_watchdog()
    for i, (writer, (code, out, err)) in enumerate(zip(writers, outcomes, strict=True)):
        journal = crash_model.read_journal(str(env.root / f"journal-{name}-{i}"), on_close)
        if code == -signal.SIGBUS:  # it touched its mapping of a file after the daemon died
            assert not journal.errors and journal.ops[-1].get("mmap"), "a SIGBUS outside a map"
            journal.errors = [(errno.ENOTCONN, "SIGBUS")]
        else:
            assert code == 0, err
            assert "stopped" in out, f"{writer.prefix}: the workload did not stop: {out!r} {err}"
        assert len(journal.errors) == 1, journal.errors
        dead = {errno.ECONNABORTED, errno.ENOTCONN, errno.EIO}
        assert journal.errors[0][0] in dead, f"the live mount failed an op: {journal.errors}"
        writer.journal = journal
    return on_its_own


def own_tree(tree: dict[str, Node], prefix: str) -> dict[str, Node]:
    """The paths under the names a writer made in the root."""
    return {p: n for p, n in tree.items() if p != "/" and p[1:].startswith(prefix)}


@dataclass
class Choice:
    """A prefix of one writer's ops that the reader's tree matched."""

    done: int  # ops[:done] are in the state
    touched: int  # ops[:touched] took effect, the last one perhaps cut short
    cut: int | None  # where that last write was cut, if it was


def choices(verdict: Verdict) -> list[Choice]:
    out = [Choice(k, k, None) for k in verdict.prefixes]
    if verdict.cut is not None:
        k, offset = verdict.cut
        out.append(Choice(k, k + 1, offset))
    return sorted(out, key=lambda c: (c.done, c.touched))


def returned_before(writer: Writer, moment: int) -> int:
    """How many of writer's ops (its history's included) had returned before moment."""
    assert writer.journal is not None
    return len(writer.history) + bisect.bisect_left(writer.journal.ended, moment)


def one_cut(
    writers: list[Writer], verdicts: list[Verdict], trees: list[dict[str, Node]], where: str
) -> list[Choice]:
    """The least prefix of each writer that its tree (of trees) matches and that together
    make one cut of the volume, the barriers' and real time's order kept (see the module's
    docstring)."""
    options = [choices(v) for v in verdicts]
    need: list[tuple[int, str]] = []
    for writer in writers:
        assert writer.journal is not None
        bound = (len(writer.history) + writer.journal.barrier, "its own")
        for other in writers:
            if other is not writer and other.journal is not None and other.journal.synced:
                ops = returned_before(writer, max(other.journal.synced))
                bound = max(bound, (ops, f"one of {other.prefix}"))
        need.append(bound)
    picked: list[Choice | None] = [None] * len(writers)

    def raise_to(w: int, bound: int, why: str) -> bool:
        """Pick writer w's least matching prefix of at least bound ops; whether it moved."""
        current = picked[w]
        if current is not None and current.done >= bound:
            return False
        fit = [c for c in options[w] if c.done >= bound]
        if not fit:
            ops = [*writers[w].history, *(writers[w].journal.ops if writers[w].journal else [])]
            closest = verdicts[w].closest
            raise AssertionError(
                f"{where}: writer {writers[w].prefix}: {why}; it needs the state after at least"
                f" {bound} of its ops, the reader's tree matches only"
                f" {[(c.done, c.cut) for c in options[w]]}\n" + describe(trees[w], ops, *closest)
            )
        picked[w] = fit[0]
        return True

    for w, (bound, whose) in enumerate(need):
        raise_to(w, bound, f"committed ops lost (a barrier, {whose}, returned after they did)")
    moved = True
    while moved:
        moved = False
        for w, writer in enumerate(writers):
            chosen = picked[w]
            assert chosen is not None and writer.journal is not None
            last = chosen.touched - 1 - len(writer.history)
            if last < 0:
                continue
            began = writer.journal.began[last]
            for v, other in enumerate(writers):
                if v != w:
                    why = (f"its op {returned_before(other, began) - 1} had returned before op"
                           f" {chosen.touched - 1} of {writer.prefix}, which the state holds,"
                           " began")  # fmt: skip
                    moved |= raise_to(v, returned_before(other, began), why)
    return [c for c in picked if c is not None]


def check_writers(
    env: VolumeEnv,
    seed: int,
    count: int,
    log: list[str],
    *,
    inject: Path | None = None,
    snapshot_rounds: bool = False,
) -> int:
    """One seed: rounds of mount, count workloads, a crash, judging by the reader and
    the checks of sealfs' own mounts. With inject (a directory holding SNAPSHOTS_SOON
    as sitecustomize.py), the daemon snapshots often; with snapshot_rounds, even rounds
    let the daemon kill itself at a chosen step of a snapshot and odd rounds kill it
    just after a snapshot appeared. Returns how many rounds' reader started from a
    snapshot the crashed mount wrote."""
    rng = random.Random(seed)
    passphrase = env.passfile.read_bytes()
    writers = [Writer(f"w{i}-", []) for i in range(count)]
    from_new_snapshot = 0
    on_close = seed % 5 == 4
    for rnd in range(ROUNDS):
        name = f"{seed}-{rnd}"
        mark = env.root / f"died-{name}"
        die_at = rng.randrange(1, 16) if snapshot_rounds and rnd % 2 == 0 else 0
        mount_env = dict(os.environ)
        if inject is not None:
            mount_env.update(ORACLE_DIE_AT=str(die_at), ORACLE_MARK=str(mark),
                             ORACLE_SNAPSHOT_EVERY_OPS=str(SNAPSHOT_EVERY_OPS),
                             PYTHONPATH=os.pathsep.join([str(inject), str(REPO)]))  # fmt: skip
        env.mount("--commit-interval", COMMIT_INTERVALS[seed % 3],
                  *(["--sync-on-close"] if on_close else []), env=mount_env)  # fmt: skip
        snapshots_before = sorted(os.listdir(env.store / "s")) if (env.store / "s").exists() else []
        for i, writer in enumerate(writers):
            # Writers differ: one fsyncs often, the next rarely (and fsyncs from a thread
            # beside its ops); one streams a large file where seed % 3 == 2.
            start_writer(env, writer, seed * 1000 + rnd * 10 + i, f"{name}-{i}",
                         fsyncs=8 if (seed + i) % 2 == 0 else 1,
                         stream=6 if i == 0 and seed % 3 == 2 else 0)  # fmt: skip
        if die_at:
            wait = DEATH_GUARD
        elif snapshot_rounds:
            wait = after_a_new_snapshot(env, snapshots_before, rng)
        else:
            wait = rng.uniform(0.3, 2.0)
        died = crash_writers(env, writers, name, on_close, wait=wait)
        if die_at:
            assert died and mark.exists(), f"seed {seed} round {rnd}: no snapshot step {die_at}"

        before = read_volume(env.store, passphrase=passphrase)
        how = mark.read_text() if mark.exists() else "killed from outside"
        where = (f"seed {seed} round {rnd}: generation {before.generation}, snapshot"
                 f" {before.snapshot}, {how}")  # fmt: skip
        if before.snapshot is not None and f"{before.snapshot:016d}" not in snapshots_before:
            from_new_snapshot += 1
        roots = {p.split("/")[1] for p in before.tree if p != "/"}
        assert all(r.startswith(tuple(w.prefix for w in writers)) for r in roots), roots
        verdicts, trees = [], []
        for writer in writers:
            assert writer.journal is not None
            ops, start = [*writer.history, *writer.journal.ops], len(writer.history)
            own = own_tree(before.tree, writer.prefix)
            trees.append(own)
            verdict = judge(own, ops, start)
            if not verdict.prefixes and verdict.cut is None:
                raise AssertionError(
                    f"{where}: writer {writer.prefix}: the reader's tree is no prefix of its"
                    " journal\n" + describe(own, ops, *verdict.closest)
                )
            verdicts.append(verdict)
        cut = one_cut(writers, verdicts, trees, where)
        log.append(f"{where}: prefixes " + ", ".join(
            f"{w.prefix}{c.done}/{len(w.history) + len(w.journal.ops) if w.journal else 0}"
            for w, c in zip(writers, cut, strict=True)))  # fmt: skip
        for writer, chosen in zip(writers, cut, strict=True):
            assert writer.journal is not None
            ops = [*writer.history, *writer.journal.ops]
            history = ops[: chosen.done]
            if chosen.cut is not None:
                history.append({**ops[chosen.done], "cut": chosen.cut})
            # The workload's descriptors died with it: the next round starts with none.
            held = Model(writer.prefix)
            for op in history:
                held.apply(op)
            writer.history = history + [{"op": "close", "fd": s} for s in sorted(held.fds)]
        # With inject, the unmount killed midway writes a snapshot too, the kill may land
        # in it.
        recovery_env = {**mount_env, "ORACLE_DIE_AT": "0"} if inject else None
        check_sealfs_agrees(env, before, where, rng, [], env.store, mount_env=recovery_env)
    return from_new_snapshot


def after_a_new_snapshot(env: VolumeEnv, before: list[str], rng: random.Random) -> float:
    """Wait (up to DEATH_GUARD) until the mount has written a snapshot; return how long
    to wait more before the kill: a moment, so that it lands just after that one or in
    the next."""
    deadline = time.monotonic() + DEATH_GUARD
    while time.monotonic() < deadline:
        if (env.store / "s").exists() and set(os.listdir(env.store / "s")) - set(before):
            break
        time.sleep(0.01)
    return rng.uniform(0.0, 0.3)


@pytest.mark.parametrize("seed", WRITER_SEEDS)
def test_concurrent_writers_leave_one_cut_the_clean_room_reader_sees(
    volume_env: VolumeEnv, seed: int
) -> None:
    require(os.path.exists("/dev/fuse"), "FUSE is needed")
    log: list[str] = []
    check_writers(volume_env, seed, 3, log)
    print("\n".join(log))


@pytest.mark.parametrize("seed", SNAPSHOT_SEEDS)
def test_a_crash_in_a_mid_mount_snapshot_leaves_one_cut_the_clean_room_reader_sees(
    volume_env: VolumeEnv, tmp_path: Path, seed: int
) -> None:
    require(os.path.exists("/dev/fuse"), "FUSE is needed")
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(SNAPSHOTS_SOON)
    log: list[str] = []
    from_new = check_writers(volume_env, seed, 2, log, inject=inject, snapshot_rounds=True)
    print("\n".join(log))
    assert from_new >= 1, "the reader never started from a snapshot the crashed mount wrote"
