"""Argon2id parameters: limits, a pinned derivation, calibration."""

from __future__ import annotations

import dataclasses

import pytest

from sealfs.errors import FormatError, WeakKdfError
from sealfs.keys.kdf import (
    MAX_MEMORY_KIB,
    MIN_MEMORY_KIB,
    Argon2Params,
    calibrate,
    check_params,
    derive_key,
)

GOLDEN_KEY = "fc8135cb0b278c487da7b351052a7bc3a6c11e6ae6394b40276aaf23559ffda2"


def test_golden_derivation(fast_kdf: Argon2Params) -> None:
    assert derive_key(b"correct horse", fast_kdf).hex() == GOLDEN_KEY


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"memory_kib": MIN_MEMORY_KIB - 1}, "65535 KiB is below the minimum 65536"),
        ({"memory_kib": 8}, "below the minimum"),
        ({"iterations": 0}, "iterations 0 is below the minimum 1"),
    ],
)
def test_weak_params(fast_kdf: Argon2Params, change: dict[str, int], message: str) -> None:
    with pytest.raises(WeakKdfError, match=message):
        derive_key(b"pw", dataclasses.replace(fast_kdf, **change))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "change",
    [
        {"memory_kib": 100 * 1024 * 1024},  # 100 GiB from a hostile header
        {"memory_kib": MAX_MEMORY_KIB + 1},
        {"iterations": 1 << 40},
        {"lanes": 0},
        {"lanes": 1 << 20},
        {"salt": b"short"},
        {"memory_kib": True},
        {"iterations": "1"},
    ],
)
def test_absurd_params(fast_kdf: Argon2Params, change: dict[str, object]) -> None:
    with pytest.raises(FormatError):
        check_params(dataclasses.replace(fast_kdf, **change))  # type: ignore[arg-type]


def test_repr_hides_salt(fast_kdf: Argon2Params) -> None:
    assert "salt" not in repr(fast_kdf)


def test_calibrate_scales_iterations() -> None:
    seen: list[Argon2Params] = []

    def timer(params: Argon2Params) -> float:
        seen.append(params)
        return 0.1

    params = calibrate(0.5, memory_kib=262144, lanes=4, timer=timer)
    assert (params.memory_kib, params.iterations, params.lanes) == (262144, 5, 4)
    assert len(params.salt) == 16
    assert [p.iterations for p in seen] == [1]


def test_calibrate_halves_memory_on_slow_machine() -> None:
    seen: list[int] = []

    def timer(params: Argon2Params) -> float:
        seen.append(params.memory_kib)
        return params.memory_kib / 65536  # 1 s per 64 MiB

    params = calibrate(0.5, memory_kib=262144, lanes=1, timer=timer)
    assert seen == [262144, 131072, 65536]
    assert (params.memory_kib, params.iterations) == (MIN_MEMORY_KIB, 1)


def test_calibrate_fresh_salt() -> None:
    a = calibrate(0.5, memory_kib=MIN_MEMORY_KIB, lanes=1, timer=lambda p: 0.5)
    b = calibrate(0.5, memory_kib=MIN_MEMORY_KIB, lanes=1, timer=lambda p: 0.5)
    assert a.salt != b.salt


def test_calibrate_for_real() -> None:
    params = calibrate(0.01, memory_kib=MIN_MEMORY_KIB, lanes=1)
    check_params(params)
    assert params.iterations >= 1


def test_calibrate_keeps_a_memory_the_user_chose() -> None:
    """Regression: `--kdf-memory 1024` made a slot of 128 MiB on this machine: calibration
    halved the memory asked for until one pass fit the target, without a word."""
    seen: list[int] = []

    def timer(params: Argon2Params) -> float:
        seen.append(params.memory_kib)
        return params.memory_kib / 65536  # 1 s per 64 MiB

    params = calibrate(0.5, memory_kib=1 << 20, lanes=4, fixed_memory=True, timer=timer)
    assert seen == [1 << 20]
    assert (params.memory_kib, params.iterations) == (1 << 20, 1)
