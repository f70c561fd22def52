"""Store fixtures: every backend the conformance suite runs over, plus tmpfs helpers.

To add a backend (S3 on moto, say), add a factory to STORE_FACTORIES.
"""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sealfs.store.base import ObjectStore
from sealfs.store.cache import CachingStore
from sealfs.store.faults import FaultyStore
from sealfs.store.local import LocalStore
from sealfs.store.memory import MemoryStore
from sealfs.store.retry import RetryingStore


def _memory(tmp_path: Path) -> ObjectStore:
    return MemoryStore()


def _local(tmp_path: Path) -> ObjectStore:
    return LocalStore(tmp_path / "store")


def _caching_local(tmp_path: Path) -> ObjectStore:
    return CachingStore(LocalStore(tmp_path / "store"), tmp_path / "cache", 64 << 20)


def _retrying_faulty_local(tmp_path: Path) -> ObjectStore:
    """Roughly one call in four fails transiently, before or after it took effect."""
    faulty = FaultyStore(LocalStore(tmp_path / "store"), seed=1234)
    faulty.add_rule("*", "", "transient", probability=0.15)
    faulty.add_rule("*", "", "transient_after", probability=0.1)
    return RetryingStore(
        faulty, attempts=30, sleep=lambda _s: None, deadline=None, rng=random.Random(5)
    )


# name -> factory(tmp_path) -> a fresh, empty store
STORE_FACTORIES: dict[str, Callable[[Path], ObjectStore]] = {
    "memory": _memory,
    "local": _local,
    "caching-local": _caching_local,
    "retrying-faulty-local": _retrying_faulty_local,
}


@pytest.fixture(params=sorted(STORE_FACTORIES))
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ObjectStore]:
    made = STORE_FACTORIES[request.param](tmp_path)
    try:
        yield made
    finally:
        made.close()


@contextlib.contextmanager
def mounted_tmpfs(path: Path, size: str) -> Iterator[Path]:
    """Mount a tmpfs of the given size at path (root only), unmounting afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs to fill a disk needs root")
    path.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs directory: writes past 1 MiB fail with ENOSPC."""
    with mounted_tmpfs(tmp_path / "tiny", "1m") as path:
        yield path
