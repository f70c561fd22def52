"""Mount set-up as the kernel sees it (sealfs.fuse.mount)."""

import os
from pathlib import Path

import pytest

from sealfs.fuse.mount import READ_AHEAD_KB
from tests.mounts import VolumeEnv
from tests.prereq import require

pytestmark = pytest.mark.fuse


def test_read_ahead_is_raised_before_mount_returns(mounted_env: VolumeEnv) -> None:
    """Regression: read-ahead was raised a moment after the mount reported ready, so a
    file opened at once kept 128 KiB read-ahead (8x the read requests of 1 MiB)."""
    require(os.geteuid() == 0, "raising a mount's read-ahead needs root")
    device = os.stat(mounted_env.mnt).st_dev
    bdi = Path(f"/sys/class/bdi/{os.major(device)}:{os.minor(device)}/read_ahead_kb")
    assert int(bdi.read_text()) == READ_AHEAD_KB


def test_mount_is_nosuid_and_nodev(mounted_env: VolumeEnv) -> None:
    """design.md relies on it: a write by another user leaves the set-ID bits, so they
    must never take effect through the mount (nor device nodes made on it)."""
    flags = os.statvfs(mounted_env.mnt).f_flag
    assert flags & os.ST_NOSUID, "mounted without nosuid"
    assert flags & os.ST_NODEV, "mounted without nodev"
