import os

import pytest

from tests.mounts import VolumeEnv

pytestmark = pytest.mark.fuse


def test_file_survives_unmount_and_remount(mounted_env: VolumeEnv) -> None:
    data = os.urandom(3_000_000)
    (mounted_env.mnt / "blob").write_bytes(data)
    mounted_env.umount()
    mounted_env.mount()
    assert (mounted_env.mnt / "blob").read_bytes() == data


def test_fsynced_file_survives_a_killed_daemon(mounted_env: VolumeEnv) -> None:
    path = mounted_env.mnt / "ckpt"
    with open(path, "wb") as f:
        f.write(b"state-1")
        f.flush()
        os.fsync(f.fileno())
    mounted_env.kill()
    mounted_env.mount()
    assert path.read_bytes() == b"state-1"
