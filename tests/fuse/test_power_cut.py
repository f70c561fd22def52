"""Power cuts under a live mount: the store's disk loses what it had not flushed.

The crash tests SIGKILL the daemon, and the kernel's page cache survives them: they
never show what a power cut does. Here the store, the cache directory and the host's
record of the generations it saw ($XDG_STATE_HOME) all live on an ext4 file system
whose power is cut (FS_IOC_SHUTDOWN without a journal flush: whatever was not flushed
is lost), under a mounted volume. Every fsync acknowledged before the cut must be
intact afterwards, the rest a prefix of what was written, and the volume must mount
again as it is, with no manual step (not refused as rolled back, no torn cache object
read).
"""

from __future__ import annotations

import errno
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import CrashableDisk, crashable_ext4
from tests.mounts import VolumeEnv

pytestmark = pytest.mark.fuse


@pytest.fixture
def disk_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[VolumeEnv, CrashableDisk]]:
    """A volume whose store, cache directory and state directory are on a crashable
    disk (the mountpoint and the daemon's log are not: they must outlive a cut)."""
    with crashable_ext4(tmp_path / "ext4", 256 << 20) as disk:
        monkeypatch.setenv("XDG_STATE_HOME", str(disk.path / "state"))
        env = VolumeEnv(tmp_path)
        env.store = disk.path / "store"
        env.init()
        try:
            yield env, disk
        finally:
            leaked = env.cleanup()  # before the disk goes: the daemon holds no file there
        assert not leaked, "the test left a mount or a daemon behind"


def cache_args(disk: CrashableDisk) -> list[str]:
    return ["--cache-dir", str(disk.path / "cache")]


def checkpoint(directory: Path, i: int) -> bytes:
    """Write checkpoint i the way agents do (temp file, fsync, rename, fsync the
    directory), then append its number to a journal with fsync; its bytes."""
    data = checkpoint_bytes(i)
    tmp = directory / "ckpt.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, directory / "ckpt")
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    with open(directory / "journal", "a") as f:
        f.write(f"{i}\n")
        f.flush()
        os.fsync(f.fileno())
    return data


def unsynced(i: int) -> bytes:
    return random.Random(-i).randbytes(1 + i * 4099 % 300_000)


def check_after_cut(directory: Path, acked: int, where: str) -> None:
    """Checkpoint acked (or a later one) whole, the journal a prefix of 1..N holding
    1..acked, and every file written without fsync absent or a prefix of its bytes."""
    journal = (directory / "journal").read_text()
    numbers = journal.split("\n")
    assert numbers[-1] == "", f"{where}: the journal ends in a partial line"
    assert numbers[:-1] == [str(i) for i in range(1, len(numbers))], f"{where}: {journal!r}"
    last = len(numbers) - 1
    assert last >= acked, f"{where}: the journal lost acknowledged lines ({last} < {acked})"
    ckpt = (directory / "ckpt").read_bytes()
    versions = [i for i in range(acked, last + 2) if ckpt == checkpoint_bytes(i)]
    assert versions, f"{where}: ckpt is no checkpoint from {acked} on ({len(ckpt)} bytes)"
    for name in os.listdir(directory):
        if name.startswith("unsynced-"):
            data = (directory / name).read_bytes()
            full = unsynced(int(name.removeprefix("unsynced-")))
            assert data == full[: len(data)], f"{where}: {name} is not a prefix of its bytes"


def checkpoint_bytes(i: int) -> bytes:
    return random.Random(i).randbytes(1000 + i * 70_001 % 400_000)


def remount_after_cut(env: VolumeEnv, disk: CrashableDisk) -> None:
    """What a host does after a power cut: the daemon is gone, the disk comes back
    (its journal replayed), the volume is mounted again, as it is."""
    env.kill()
    disk.remount()
    result = env.mount(*cache_args(disk), check=False)
    assert result.returncode == 0, f"mount refused after a power cut: {result.stderr}"
    assert "warning" not in result.stderr.lower(), result.stderr


BIG_WRITER = r"""
import os, random, sys
data = random.Random(int(sys.argv[2])).randbytes(64 << 20)
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
print("started", flush=True)
for o in range(0, len(data), 1 << 20):
    os.write(fd, data[o : o + (1 << 20)])
os.fsync(fd)
print("synced", flush=True)
"""


def test_a_power_cut_under_a_mount_keeps_every_fsync(
    disk_env: tuple[VolumeEnv, CrashableDisk],
) -> None:
    """Three cut points, each on the volume as the last one left it: right after an
    acknowledged checkpoint with unsynced files behind it, with a large write in flight
    (commits running), and right after a checkpoint while a background commit carries
    unsynced files. Each time the volume mounts again at once and holds every
    acknowledged checkpoint."""
    env, disk = disk_env
    env.mount(*cache_args(disk))
    acked: dict[Path, int] = {}
    for rnd in range(3):
        where = f"cut {rnd}"
        directory = env.mnt / f"round-{rnd}"
        directory.mkdir()
        for i in range(1, 4):
            checkpoint(directory, i)
            acked[directory] = i
            (directory / f"unsynced-{i}").write_bytes(unsynced(i))
        proc = None
        if rnd == 1:  # a large write in flight, cut while its chunks go to the store
            big = directory / "big"
            proc = subprocess.Popen(
                [sys.executable, "-c", BIG_WRITER, str(big), str(rnd)],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            )  # fmt: skip
            assert proc.stdout is not None and proc.stdout.readline() == "started\n"
            time.sleep(0.3)
        elif rnd == 2:
            time.sleep(0.9)  # about when the background commit takes the unsynced files
        disk.cut()
        out = proc.communicate(timeout=60)[0] if proc is not None else ""
        remount_after_cut(env, disk)
        for old, count in acked.items():  # earlier rounds too: cuts must not undo them
            check_after_cut(old, count, f"{where}, checking {old.name}")
        if proc is not None:
            big = directory / "big"
            data = big.read_bytes() if big.exists() else b""
            full = random.Random(rnd).randbytes(64 << 20)
            if "synced" in out:  # its fsync succeeded (before the cut, or after it)
                assert data == full, f"{where}: the big write was acknowledged, then lost"
            assert data == full[: len(data)], f"{where}: the big file is not a prefix"
    env.umount()


def test_an_fsync_after_the_store_disk_came_back_fails_if_it_lost_chunks(
    disk_env: tuple[VolumeEnv, CrashableDisk],
) -> None:
    """The store's disk loses power while the daemon lives, and comes back (mounted
    again at the same place) before the next commit. A large file's chunks were sealed
    early and written to the store, not yet synced: the cut lost them, and their bytes
    are in no buffer any more. Regression: the next fsync committed a generation naming
    them and reported success; after a remount the file read EIO."""
    env, disk = disk_env
    env.mount("--commit-interval", "3600", *cache_args(disk))  # only fsyncs commit
    checkpoint(env.mnt, 1)
    data = random.Random(2).randbytes(48 << 20)
    fd = os.open(env.mnt / "big", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.write(fd, data[: 40 << 20])  # past the early-flush threshold (32 MiB)
        deadline = time.monotonic() + 30
        while env.status()["buffered_bytes"] > 24 << 20:
            assert time.monotonic() < deadline, "no early flush within 30 s"
            time.sleep(0.05)
        disk.cut()
        disk.remount()
        os.write(fd, data[40 << 20 :])
        with pytest.raises(OSError) as failed:
            os.fsync(fd)
        assert failed.value.errno == errno.EIO
    finally:
        os.close(fd)
    assert "lost writes" in env.log_text()
    # The mount stopped: it unmounts as one whose disk failed to flush, saying what is
    # lost, and the volume mounts again at its last commit with no manual step.
    result = env.umount(check=False)
    assert result.returncode == 1 and "lost writes" in result.stderr, result.stderr
    assert not env.is_mounted()
    result = env.mount(*cache_args(disk), check=False)
    assert result.returncode == 0, f"mount refused after a power cut: {result.stderr}"
    assert (env.mnt / "ckpt").read_bytes() == checkpoint_bytes(1)
    big = env.mnt / "big"
    got = big.read_bytes() if big.exists() else b""  # must read, not fail with EIO
    assert got == data[: len(got)]
    env.umount()
