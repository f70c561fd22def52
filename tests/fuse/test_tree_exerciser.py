"""Random namespace operations on a mount and on a plain directory, compared
(tests/fuse/tree_exerciser.py). A few seeds run here; longer hunts run the module
itself with other seeds."""

from __future__ import annotations

import random

import pytest

from tests.fuse.tree_exerciser import TreeExerciser, exercise_side_by_side
from tests.mounts import VolumeEnv, read_only_mount

pytestmark = [pytest.mark.fuse, pytest.mark.slow]

COMMIT_OFTEN = ("--commit-interval", "0.05")


@pytest.mark.parametrize("crash", [False, True], ids=["remounts", "kills"])
def test_tree_operations_end_as_on_a_plain_directory(volume_env: VolumeEnv, crash: bool) -> None:
    volume_env.mount(*COMMIT_OFTEN)
    exerciser = TreeExerciser(
        volume_env, volume_env.root / "reference", random.Random(7 + crash), crash, COMMIT_OFTEN
    )
    exerciser.run(600)
    assert exerciser.counts["succeeded"] > 200 and exerciser.counts["failed alike"] > 50
    assert exerciser.counts["kill" if crash else "remount"] > 0
    volume_env.umount()


def test_a_read_only_mount_shows_each_synced_tree(volume_env: VolumeEnv) -> None:
    """After every fsync, once it has replayed that generation, a read-only mount shows
    the tree as it is, across kills of the writer."""
    volume_env.mount(*COMMIT_OFTEN)
    with read_only_mount(volume_env, 0.05) as follower:
        exerciser = TreeExerciser(
            volume_env, volume_env.root / "reference", random.Random(9), True, COMMIT_OFTEN,
            follower,
        )  # fmt: skip
        exerciser.run(500)
    assert exerciser.counts["fsync"] > 0 and exerciser.counts["kill"] > 0
    volume_env.umount()


def test_four_trees_worked_on_side_by_side(volume_env: VolumeEnv) -> None:
    """Namespace requests from four threads at once, each in its own directory, end as
    on four plain directories, before and after a remount."""
    volume_env.mount(*COMMIT_OFTEN)
    exercise_side_by_side(volume_env, seed=11, ops=400)
    volume_env.umount()
