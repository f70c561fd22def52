"""No core dump of a process holding keys: a dump would put the master key on local disk."""

from __future__ import annotations

import subprocess
import sys

from tests.mounts import VolumeEnv

PROBE = (
    "import ctypes, resource;"
    " from sealfs.cli.coredumps import forbid_core_dumps;"
    " forbid_core_dumps();"
    " print(ctypes.CDLL(None).prctl(3, 0, 0, 0, 0), *resource.getrlimit(resource.RLIMIT_CORE))"
)  # prctl 3 is PR_GET_DUMPABLE


def test_a_process_that_forbade_core_dumps_is_not_dumpable() -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.split() == ["0", "0", "0"]


def test_the_mount_daemon_writes_no_core_file(mounted_env: VolumeEnv) -> None:
    (pid,) = mounted_env.daemon_pids()
    with open(f"/proc/{pid}/limits") as limits:
        core = next(line for line in limits if line.startswith("Max core file size"))
    assert core.split()[4:6] == ["0", "0"], core
