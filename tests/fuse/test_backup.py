"""Backups of a live store, taken with the README's own two rsync commands.

The README promises that copying l/ and s/ first, then the rest, gives a
complete copy of a store that a mount is writing: the copy mounts, every
file reads, and it holds at least every commit made before the copy began.
The commands are read from the README, so the test checks what operators run.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sealfs.cli.exitcodes import DAMAGED
from tests.cli.test_bad_input import fingerprint, one_line
from tests.mounts import VolumeEnv
from tests.prereq import require

pytestmark = [pytest.mark.fuse, pytest.mark.slow]

README = Path(__file__).resolve().parents[2] / "README.md"

# The workload, run as `python -c WRITER DIR`: forever, checkpoint i goes to
# ckpt-<i % 4>.json (tmp, fsync, rename, fsync of the directory) and line i
# to log.jsonl (append, fsync); then it prints "committed i".
WRITER = r"""
import hashlib, json, os, random, sys

root = sys.argv[1]
log = open(os.path.join(root, "log.jsonl"), "a")
dirfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
i = 0
while True:
    i += 1
    rng = random.Random(i)
    data = rng.randbytes(rng.randrange(1_000, 1_500_000)).hex()
    doc = json.dumps({"i": i, "data": data, "sha256": hashlib.sha256(data.encode()).hexdigest()})
    tmp = os.path.join(root, "ckpt.tmp")
    with open(tmp, "w") as f:
        f.write(doc)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, os.path.join(root, f"ckpt-{i % 4}.json"))
    os.fsync(dirfd)
    log.write(json.dumps({"i": i}) + "\n")
    log.flush()
    os.fsync(log.fileno())
    print("committed", i, flush=True)
"""


def readme_backup_commands() -> list[str]:
    """The shell commands of the README's backup block (they copy store/ to backup/)."""
    text = README.read_text()
    section = text[text.index("## Backups and restores") :]
    block = re.search(r"```sh\n(.*?)```", section, re.DOTALL)
    assert block is not None, "README's backup section lost its command block"
    commands = [line for line in block.group(1).splitlines() if line.strip()]
    assert all("store/ backup/" in c for c in commands), commands
    return commands


class Writer:
    """The WRITER process, and the last commit it has reported."""

    def __init__(self, directory: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(directory)],
            stdout=subprocess.PIPE,
            text=True,
        )
        self.committed = 0

    def wait_for(self, count: int) -> int:
        """Wait until `count` more commits are reported; return the last one."""
        assert self.proc.stdout is not None
        target = self.committed + count
        while self.committed < target:
            line = self.proc.stdout.readline()
            assert line, f"the writer died (exit {self.proc.wait()})"
            self.committed = int(line.split()[1])
        return self.committed

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def test_the_readme_backup_of_a_live_store_is_complete(
    volume_env: VolumeEnv, tmp_path: Path
) -> None:
    require(shutil.which("rsync") is not None, "rsync is needed (scripts/setup installs it)")
    original = volume_env
    original.mount()
    data = original.mnt / "agent"
    data.mkdir()
    writer = Writer(data)
    try:
        before = writer.wait_for(5)  # committed before the copy began
        for command in readme_backup_commands():
            done = subprocess.run(
                command, shell=True, cwd=original.root, capture_output=True, text=True, check=False
            )
            # 24: a snapshot the mount deleted vanished (README: the copy is complete)
            assert done.returncode in (0, 24), done.stderr
            writer.wait_for(2)  # the mount commits between and after the two copies
    finally:
        writer.stop()
    last = writer.committed
    original.umount()

    copy = VolumeEnv(tmp_path / "copy")
    (original.root / "backup").rename(copy.store)
    copy.mount("--read-only")
    try:
        latest = {}
        for path in sorted((copy.mnt / "agent").glob("ckpt-*.json")):
            doc = json.loads(path.read_bytes())  # reads every chunk: EIO fails the test
            assert hashlib.sha256(doc["data"].encode()).hexdigest() == doc["sha256"], path
            assert path.name == f"ckpt-{doc['i'] % 4}.json"
            latest[doc["i"] % 4] = doc["i"]
        lines = [json.loads(line)["i"] for line in (copy.mnt / "agent/log.jsonl").open()]
        copy.umount()
    finally:
        copy.cleanup()  # only after a failure: the body unmounted it
    assert lines == list(range(1, len(lines) + 1))  # a prefix of the log, no gap
    assert before <= len(lines) <= last
    # The copy is one cut of the writer's operations: each checkpoint holds its newest
    # version up to the log's last line, or up to the next (renamed before its line).
    n = len(lines)
    assert latest in ({i % 4: i for i in range(k - 3, k + 1)} for k in (n, n + 1)), (n, latest)


def test_the_readme_restore_brings_back_the_copy_s_generation(volume_env: VolumeEnv) -> None:
    require(shutil.which("rsync") is not None, "rsync is needed (scripts/setup installs it)")
    restore = re.search(
        r"To restore, unmount, then `([^`]+)`, and mount\s+once with `([^`]+)`",
        README.read_text(),
    )
    assert restore is not None, "README lost its restore command"
    env = volume_env
    env.mount()
    (env.mnt / "kept.txt").write_text("version 1")
    env.umount()
    for command in readme_backup_commands():
        subprocess.run(command, shell=True, cwd=env.root, check=True)
    copied = env.store_status()["generation"]
    env.mount()
    (env.mnt / "kept.txt").write_text("version 2")
    (env.mnt / "later.txt").write_text("written after the backup")
    env.umount()
    assert env.store_status()["generation"] > copied
    subprocess.run(restore.group(1), shell=True, cwd=env.root, check=True)
    assert env.store_status()["generation"] == copied
    restored = fingerprint(env.store)
    refused = env.mount(check=False)  # this host saw the newer generation
    assert "rolled back or restored" in one_line(refused, DAMAGED)
    assert restore.group(2) in refused.stderr
    assert fingerprint(env.store) == restored  # nothing written, the writer not claimed
    env.mount(restore.group(2))
    assert sorted(p.name for p in env.mnt.iterdir()) == ["kept.txt"]
    assert (env.mnt / "kept.txt").read_text() == "version 1"
    env.umount()
    env.mount()  # accepted once: the restored generation is the one this host knows now
    env.umount()
