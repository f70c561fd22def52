"""Random I/O on a real mount, every byte read checked (tests/fuse/file_exerciser.py).

A few seeds run here; longer hunts run the module itself with other seeds.
"""

from __future__ import annotations

import random

import pytest

from tests.fuse.file_exerciser import Exerciser, exercise_stripes
from tests.mounts import VolumeEnv, read_only_mount, sealfs

pytestmark = [pytest.mark.fuse, pytest.mark.slow]

COMMIT_OFTEN = ("--commit-interval", "0.05")  # many commits between the syncs
PAST_4_GIB = (4 << 30) - (512 << 10)  # the exercised bytes straddle the 4 GiB mark


@pytest.mark.parametrize(("seed", "base"), [(1, 0), (2, PAST_4_GIB)], ids=["at-0", "at-4GiB"])
def test_random_io_reads_back_what_was_written(volume_env: VolumeEnv, seed: int, base: int) -> None:
    """Multi-chunk files (4 MiB) written by every path, read back through every path,
    unmounted and mounted again now and then."""
    volume_env.mount(*COMMIT_OFTEN)
    exerciser = Exerciser(
        volume_env, random.Random(seed), 4 << 20, mount_options=COMMIT_OFTEN, base=base
    )
    exerciser.run(700)
    assert exerciser.counts["remount"] > 0 and exerciser.counts["direct write"] > 0
    volume_env.umount()


def test_random_io_survives_kills(volume_env: VolumeEnv) -> None:
    """Killed now and then, the file holds one of the states since its last sync."""
    volume_env.mount(*COMMIT_OFTEN)
    exerciser = Exerciser(
        volume_env, random.Random(3), 1 << 20, crash=True, mount_options=COMMIT_OFTEN
    )
    exerciser.run(700)
    assert exerciser.counts["kill"] > 0
    volume_env.umount()


def test_a_read_only_mount_shows_each_synced_state(volume_env: VolumeEnv) -> None:
    """After every fsync, once it has replayed that generation, a read-only mount shows
    the file as written, to a fresh open and to a descriptor held all along, across
    kills of the writer."""
    volume_env.mount(*COMMIT_OFTEN)
    with read_only_mount(volume_env, 0.05) as follower:
        exerciser = Exerciser(
            volume_env, random.Random(4), 2 << 20, True, COMMIT_OFTEN, follower=follower
        )
        exerciser.run(500)
    assert exerciser.counts["fsync"] > 0 and exerciser.counts["kill"] > 0
    volume_env.umount()


def test_random_io_through_rekeys_and_kills(volume_env: VolumeEnv) -> None:
    """Rekeys started now and then re-seal every object in the daemon's background
    while the I/O, remounts and kills go on: every byte still reads as written, and the
    volume ends under the newest key."""
    volume_env.mount(*COMMIT_OFTEN)
    exerciser = Exerciser(volume_env, random.Random(6), 1 << 20, True, COMMIT_OFTEN, rekeys=True)
    exerciser.run(500)
    assert exerciser.counts["rekey"] > 2 and exerciser.counts["kill"] > 0
    volume_env.umount()
    listed = sealfs(
        "key", "list", str(volume_env.store), "--passphrase-file", str(volume_env.passfile)
    )
    epoch = listed.stdout.splitlines()[1]  # "key epoch N", and whether its rekey finished
    assert epoch.split()[:3] == ["key", "epoch", str(exerciser.counts["rekey"])], listed.stdout


def test_writers_side_by_side_on_one_file(volume_env: VolumeEnv) -> None:
    """Four threads write their own stripes of one file while another syncs and drops
    the page cache; every stripe reads back as its writer left it, before and after a
    remount."""
    volume_env.mount(*COMMIT_OFTEN)
    exercise_stripes(volume_env, seed=5, ops=1500)
    volume_env.umount()
