"""The mount process's cap on glibc malloc arenas, checked in fresh interpreters."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from sealfs.cli.allocator import ARENA_MAX

REPO = Path(__file__).resolve().parents[2]

# Eight threads malloc at once; glibc's malloc_info then lists one <heap> per arena.
COUNT_ARENAS = r"""
import ctypes, sys, tempfile, threading
from sealfs.cli.allocator import limit_malloc_arenas
print(limit_malloc_arenas())
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.fopen.restype, libc.fopen.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_char_p]
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.fclose.argtypes = [ctypes.c_void_p]
barrier = threading.Barrier(8)

def work():
    barrier.wait()
    blocks = [libc.malloc(4096) for _ in range(2000)]
    barrier.wait()
    for block in blocks:
        libc.free(block)

threads = [threading.Thread(target=work) for _ in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
with tempfile.NamedTemporaryFile() as out:
    fp = libc.fopen(out.name.encode(), b"w")
    libc.malloc_info(0, fp)
    libc.fclose(fp)
    print(open(out.name).read().count("<heap nr="))
"""


def arenas(env: dict[str, str]) -> tuple[str, int]:
    run = subprocess.run(
        [sys.executable, "-c", COUNT_ARENAS],
        env={**env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    capped, count = run.stdout.split()
    return capped, int(count)


def unset_by_operator() -> dict[str, str]:
    """This environment without the settings that would make the cap stand aside."""
    return {k: v for k, v in os.environ.items() if k not in ("MALLOC_ARENA_MAX", "GLIBC_TUNABLES")}


def test_threads_share_at_most_arena_max_arenas() -> None:
    assert arenas(unset_by_operator()) == ("True", ARENA_MAX)


def test_without_the_cap_threads_get_arenas_of_their_own() -> None:
    """The control: what the cap prevents (glibc's default, eight per core)."""
    capped, count = arenas({**unset_by_operator(), "MALLOC_ARENA_MAX": "64"})
    assert capped == "False"  # the operator's setting wins
    assert count > ARENA_MAX + 2


def test_an_operators_tunable_wins_too() -> None:
    capped, count = arenas({**unset_by_operator(), "GLIBC_TUNABLES": "glibc.malloc.arena_max=5"})
    assert capped == "False"
    assert count == 5
