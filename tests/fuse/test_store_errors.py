"""Store failures as a real mount's callers and its log see them (sealfs.fuse.operations)."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest

from tests.mounts import VolumeEnv, sealfs
from tests.store.conftest import mounted_tmpfs

pytestmark = pytest.mark.fuse


def fill(directory: Path) -> Path:
    """Write a file into directory until its file system is full; return the file."""
    filler = directory / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * (64 << 10))
                f.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    return filler


def test_a_full_store_disk_is_logged_once_not_at_every_fsync(tmp_path: Path) -> None:
    """An agent checkpointing every second against a full store disk. Each fsync fails
    with ENOSPC, as it should, and the data stays buffered; but each also wrote the same
    ERROR line to the daemon's log, 3,600 an hour per agent, for as long as the disk
    stayed full (the commit loop's own retries were already logged once)."""
    with mounted_tmpfs(tmp_path / "disk", "4m") as disk:
        env = VolumeEnv(tmp_path)
        env.store = disk / "store"
        try:
            env.init()
            env.mount()
            filler = fill(disk)
            checkpoints = []
            for step in range(8):
                data = b"%08d" % step * 1000
                with open(env.mnt / "ckpt.bin", "wb") as f:
                    f.write(data)
                    f.flush()
                    with pytest.raises(OSError) as info:
                        os.fsync(f.fileno())
                assert info.value.errno == errno.ENOSPC
                checkpoints.append(data)
            log = env.log_text()
            per_request = [line for line in log.splitlines() if "sealfs.fuse[" in line]
            full = [line for line in per_request if "store disk full" in line]
            assert len(full) == 1, "\n".join(full)
            filler.unlink()
            with open(env.mnt / "ckpt.bin", "rb+") as f:
                os.fsync(f.fileno())  # the space is back: what was buffered is committed
            env.umount()
            env.mount()
            assert (env.mnt / "ckpt.bin").read_bytes() == checkpoints[-1]
            env.umount()
        finally:
            env.cleanup()


def test_a_store_emptied_under_the_mount_stops_it_instead_of_taking_commits(
    mounted_env: VolumeEnv,
) -> None:
    """Regression: with the store's files removed (the directory kept), the next
    segment was created as any new file: sync and umount succeeded, and the volume,
    its header gone, never mounted again, with all that was acknowledged since."""
    env = mounted_env
    (env.mnt / "before").write_text("committed")
    assert sealfs("sync", str(env.mnt)).returncode == 0
    for path in sorted(env.store.rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()
    time.sleep(1.2)  # past the interval between two checks of the store
    (env.mnt / "after").write_text("never committed")
    synced = sealfs("sync", str(env.mnt))
    assert synced.returncode == 1, synced.stderr
    assert "the store no longer holds this volume's log" in synced.stderr, synced.stderr
    with pytest.raises(OSError) as refused:
        (env.mnt / "later").write_text("x")
    assert refused.value.errno == errno.EROFS
    assert not list(env.store.glob("l/*"))  # nothing published into the emptied store
    gone = sealfs("umount", str(env.mnt))
    assert gone.returncode == 1 and "had stopped committing; unmounted it" in gone.stderr
    assert not env.is_mounted()
