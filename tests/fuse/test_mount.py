"""Mount set-up as the kernel sees it (sealfs.fuse.mount)."""

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import trio
import trio.testing

from sealfs.fuse.mount import IDLE_TRIM_AFTER, READ_AHEAD_KB, trim_when_idle
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


def test_an_idle_daemon_trims_its_heap_once_per_burst_of_commits() -> None:
    """Regression: a daemon that went idle kept the heap its work had grown. After a
    25-minute agent soak whose files were then deleted, the idle writer held 302 MB
    (malloc: 58 MB in use, 137 MB free) and its follower 155 MB, where the README
    promises about 33 MiB for an idle mount; malloc_trim took them to 205 and 107 MB."""
    commits = SimpleNamespace(generation=5)
    trims: list[float] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            volume = SimpleNamespace(commits=commits)
            nursery.start_soon(trim_when_idle, volume, lambda: trims.append(trio.current_time()))
            await trio.sleep(IDLE_TRIM_AFTER * 3.5)  # idle since the mount: one trim
            assert len(trims) == 1
            for _ in range(50):  # a burst of commits: none while they come
                commits.generation += 1
                await trio.sleep(IDLE_TRIM_AFTER / 4)
            assert len(trims) == 1
            await trio.sleep(IDLE_TRIM_AFTER * 5)  # idle again: one more, and only one
            assert len(trims) == 2
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_trim_gives_freed_heap_memory_back_to_the_system() -> None:
    """What the daemon keeps (_tune_malloc leaves 1 MiB buffers in the heap, and up to
    64 MiB free at its top) goes back to the system with release_free_memory()."""
    code = """
import os
from sealfs.fuse.mount import _tune_malloc, release_free_memory

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

_tune_malloc()
blocks = [b"\\x01" * (1 << 20) for _ in range(200)]
last = blocks.pop()  # it keeps the heap from shrinking at its top
del blocks
before = rss()
release_free_memory()
print(before, rss())
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    before, after = map(int, out.stdout.split())
    assert before - after >= 100 << 20, (before, after)
