"""glibc allocator settings for the long-lived mount process.

By default glibc gives each thread that allocates a malloc arena of its
own, and the workers that seal and fetch chunks of up to 4 MiB left theirs
full of freed, fragmented buffers that the process never gave back: the
daemon's RSS kept growing under random writes (docs/design.md, "Buffering
and memory", has the measurements).
"""

from __future__ import annotations

import ctypes
import os

ARENA_MAX = 2
_M_ARENA_MAX = -8  # mallopt's parameter number in glibc's malloc.h
# glibc reads these at start-up; an operator's choice wins.
_ENV, _TUNABLES, _TUNABLE = "MALLOC_ARENA_MAX", "GLIBC_TUNABLES", "glibc.malloc.arena_max"


def limit_malloc_arenas() -> bool:
    """Cap glibc's arenas at ARENA_MAX; True if the cap was set here.

    Call it before the process starts threads: arenas made before it remain.
    Does nothing where the C library has no mallopt (musl) or the operator
    set MALLOC_ARENA_MAX or the glibc.malloc.arena_max tunable.
    """
    if _ENV in os.environ or _TUNABLE in os.environ.get(_TUNABLES, ""):
        return False
    try:
        libc = ctypes.CDLL(None)  # the C library the interpreter runs on
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_ARENA_MAX, ARENA_MAX))
