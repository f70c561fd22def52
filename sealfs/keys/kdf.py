"""Argon2id passphrase stretching, parameter limits and calibration.

The parameters live in the (untrusted) volume header, so they are checked
before every derivation: too weak means an attacker may have lowered them to
speed up guessing (WeakKdfError); absurdly large means a hostile header tries to
make unlock allocate or spin without bound (FormatError).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from argon2.exceptions import HashingError
from argon2.low_level import Type, hash_secret_raw

from sealfs.errors import FormatError, KeyUnavailableError, WeakKdfError

KEY_SIZE = 32
SALT_SIZE = 16
MIN_MEMORY_KIB = 65536
MAX_MEMORY_KIB = 4 * 1024 * 1024
MIN_ITERATIONS = 1
MAX_ITERATIONS = 1024
MIN_LANES = 1
MAX_LANES = 64
ARGON2_VERSION = 0x13


@dataclass(frozen=True)
class Argon2Params:
    """Argon2id cost parameters and salt for one passphrase keyslot."""

    memory_kib: int
    iterations: int
    lanes: int
    salt: bytes = field(repr=False)


def _is_int(value: object) -> bool:
    # bool is an int subclass; a header saying m=True is malformed, not m=1.
    return isinstance(value, int) and not isinstance(value, bool)


def check_params(p: Argon2Params) -> None:
    """Raise WeakKdfError if p is below the minimum, FormatError if it is absurd."""
    if not (_is_int(p.memory_kib) and _is_int(p.iterations) and _is_int(p.lanes)):
        raise FormatError("Argon2 parameters must be integers")
    if not isinstance(p.salt, bytes) or len(p.salt) != SALT_SIZE:
        raise FormatError(f"Argon2 salt must be {SALT_SIZE} bytes")
    if p.memory_kib > MAX_MEMORY_KIB:
        raise FormatError(f"Argon2 memory {p.memory_kib} KiB exceeds the limit {MAX_MEMORY_KIB}")
    if p.iterations > MAX_ITERATIONS:
        raise FormatError(f"Argon2 iterations {p.iterations} exceed the limit {MAX_ITERATIONS}")
    if not MIN_LANES <= p.lanes <= MAX_LANES:
        raise FormatError(f"Argon2 lanes {p.lanes} outside {MIN_LANES}..{MAX_LANES}")
    if p.memory_kib < MIN_MEMORY_KIB:
        raise WeakKdfError(
            f"Argon2 memory {p.memory_kib} KiB is below the minimum {MIN_MEMORY_KIB} KiB"
        )
    if p.iterations < MIN_ITERATIONS:
        raise WeakKdfError(
            f"Argon2 iterations {p.iterations} is below the minimum {MIN_ITERATIONS}"
        )


def derive_key(secret: bytes, params: Argon2Params) -> bytes:
    """Stretch secret into a 32-byte key with Argon2id; check params first.

    Raises KeyUnavailableError if Argon2 cannot run them here: a slot's memory
    (up to MAX_MEMORY_KIB, 4 GiB) need not fit every machine or ulimit -v.
    """
    check_params(params)
    try:
        return hash_secret_raw(
            secret=secret,
            salt=params.salt,
            time_cost=params.iterations,
            memory_cost=params.memory_kib,
            parallelism=params.lanes,
            hash_len=KEY_SIZE,
            type=Type.ID,
            version=ARGON2_VERSION,
        )
    except HashingError as exc:
        # Reported as "unexpected HashingError ... a bug in sealfs" (exit 70) before.
        raise KeyUnavailableError(
            f"Argon2 could not stretch the passphrase with {params.memory_kib // 1024} MiB"
            f" ({exc}): free memory or raise ulimit -v, or use a machine with more"
            " (--kdf-memory sets a new slot's memory)"
        ) from None


def _time_one(params: Argon2Params) -> float:
    start = time.perf_counter()
    derive_key(b"sealfs calibration", params)
    return time.perf_counter() - start


def calibrate(
    target_seconds: float = 0.5,
    memory_kib: int = 262144,
    lanes: int = 4,
    *,
    fixed_memory: bool = False,
    timer: Callable[[Argon2Params], float] = _time_one,
) -> Argon2Params:
    """Pick Argon2id parameters that take about target_seconds on this machine.

    Measures one iteration at memory_kib; if that alone exceeds the target,
    halves memory (never below MIN_MEMORY_KIB) and measures again, unless
    fixed_memory says memory_kib is the user's choice (--kdf-memory): a
    larger memory was silently cut to what fits the target. Iterations are
    then scaled to the target (at least 1). timer is injectable so tests
    need not run Argon2. Returns params with a fresh random salt.
    """
    salt = os.urandom(SALT_SIZE)
    params = Argon2Params(memory_kib, 1, lanes, salt)
    check_params(params)
    elapsed = timer(params)
    while not fixed_memory and elapsed > target_seconds and params.memory_kib > MIN_MEMORY_KIB:
        params = Argon2Params(max(MIN_MEMORY_KIB, params.memory_kib // 2), 1, lanes, salt)
        elapsed = timer(params)
    iterations = round(target_seconds / elapsed) if elapsed > 0 else MAX_ITERATIONS
    iterations = min(MAX_ITERATIONS, max(MIN_ITERATIONS, iterations))
    return Argon2Params(params.memory_kib, iterations, lanes, salt)
