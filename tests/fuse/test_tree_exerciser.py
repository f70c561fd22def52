"""Random namespace operations on a mount and on a plain directory, compared
(tests/fuse/tree_exerciser.py). A few seeds run here; longer hunts run the module
itself with other seeds."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.fuse.tree_exerciser import TreeExerciser, exercise_side_by_side
from tests.mounts import VolumeEnv, python_for_others, read_only_mount
from tests.prereq import require

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


NOBODY = 65534
AS_NOBODY = """
import json, random, sys, types
from pathlib import Path
from tests.fuse.tree_exerciser import TreeExerciser
root, seed = Path(sys.argv[1]), int(sys.argv[2])
mount = types.SimpleNamespace(mnt=root / "mnt")  # no remounts: the mount is all it needs
exerciser = TreeExerciser(
    mount, root / "own" / "reference", random.Random(seed), subtree="own/tree", alone=False
)
exerciser.run(int(sys.argv[3]))
print(json.dumps(exerciser.counts))
"""


def test_an_unprivileged_user_s_operations_end_as_on_a_plain_directory() -> None:
    """Run as nobody on a mount root made with --allow-other, where the kernel checks
    permissions (default_permissions) as ext4 does for root's own file system: chmods
    make directories nobody may search or write, and every EACCES must come alike."""
    require(os.geteuid() == 0, "running the exerciser as another user needs root")
    require(shutil.which("setpriv") is not None, "setpriv (util-linux) is needed")
    root = Path(tempfile.mkdtemp(prefix="sealfs-exerciser-"))
    root.chmod(0o755)
    env = VolumeEnv(root)
    try:
        with python_for_others(root):
            env.init()
            env.mount("--allow-other", *COMMIT_OFTEN)
            for own in (env.mnt / "own", root / "own"):
                own.mkdir()
                os.chown(own, NOBODY, NOBODY)
            ran = subprocess.run(
                ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                 sys.executable, "-c", AS_NOBODY, str(root), "13", "500"],
                capture_output=True, text=True, timeout=300, check=False, cwd="/",
                env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
            )  # fmt: skip
            assert ran.returncode == 0, ran.stderr
            counts = json.loads(ran.stdout)
            assert counts["EACCES"] > 10 and counts["succeeded"] > 150, counts
            env.umount()
    finally:
        leaked = env.cleanup()
        shutil.rmtree(root, ignore_errors=True)
    assert not leaked, "the test left a mount or a daemon behind"
