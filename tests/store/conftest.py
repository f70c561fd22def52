"""Store fixtures: every backend the conformance suite runs over, plus tmpfs helpers.

To add a backend, add a factory to STORE_FACTORIES. The S3 ones talk HTTP to
a moto server on 127.0.0.1 (tests/s3/server.py) and carry the s3 mark.
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
from sealfs.store.s3 import S3Store
from tests.prereq import require
from tests.s3.server import moto_endpoint, new_bucket


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


def _s3(tmp_path: Path) -> ObjectStore:
    """An S3Store on the run's moto server (real HTTP on 127.0.0.1), in a fresh bucket.

    The volume sits under a key prefix, beside another prefix holding objects
    of its own: nothing of the neighbour may show through.
    """
    bucket = new_bucket()
    S3Store(bucket, "neighbour", endpoint_url=moto_endpoint()).put("c/ab/1", b"other volume")
    return S3Store(bucket, "vols/one", endpoint_url=moto_endpoint())


def _caching_retrying_s3(tmp_path: Path) -> ObjectStore:
    """What `sealfs mount s3://...` stacks: a chunk cache over retries over S3."""
    inner = RetryingStore(S3Store(new_bucket(), "", endpoint_url=moto_endpoint()), deadline=30)
    return CachingStore(inner, tmp_path / "cache", 64 << 20)


# name -> factory(tmp_path) -> a fresh, empty store
STORE_FACTORIES: dict[str, Callable[[Path], ObjectStore]] = {
    "memory": _memory,
    "local": _local,
    "caching-local": _caching_local,
    "retrying-faulty-local": _retrying_faulty_local,
    "s3": _s3,
    "caching-retrying-s3": _caching_retrying_s3,
}


def _param(name: str) -> object:
    """S3 backends carry the s3 mark (-m "not s3" skips them)."""
    return pytest.param(name, marks=pytest.mark.s3) if "s3" in name else name


@pytest.fixture(params=[_param(name) for name in sorted(STORE_FACTORIES)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ObjectStore]:
    made = STORE_FACTORIES[request.param](tmp_path)
    try:
        yield made
    finally:
        made.close()


def cached_bytes(path: Path) -> int:
    """Bytes of the file that sit in the page cache (util-linux fincore)."""
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout)


def require_disk(path: Path) -> None:
    """Skip (fail in CI) where the file system is the page cache: a tmpfs, as /tmp is on
    some distributions, cannot drop a file's pages, and O_DIRECT goes through them."""
    fstype = subprocess.run(
        ["stat", "--file-system", "--format", "%T", str(path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    require(fstype not in ("tmpfs", "ramfs"), f"{path} is on a {fstype}, not on a disk")


def evict_from_page_cache(path: Path) -> None:
    """Drop the file's pages from the page cache (written back first: dirty ones stay)."""
    require_disk(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    assert cached_bytes(path) == 0, f"{path} stayed in the page cache"


@contextlib.contextmanager
def mounted_tmpfs(path: Path, size: str) -> Iterator[Path]:
    """Mount a tmpfs of the given size at path (root only), unmounting afterwards."""
    with _mounted(path, "tmpfs", f"size={size}"):
        yield path


@contextlib.contextmanager
def mounted_ramfs(path: Path) -> Iterator[Path]:
    """Mount a ramfs at path (root only): a file system that refuses O_DIRECT."""
    with _mounted(path, "ramfs", "mode=0755"):
        yield path


@contextlib.contextmanager
def _mounted(path: Path, fstype: str, options: str) -> Iterator[None]:
    require(os.geteuid() == 0, f"mounting a {fstype} needs root")
    path.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        ["mount", "-t", fstype, "-o", options, fstype, str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    require(result.returncode == 0, f"cannot mount a {fstype} here: {result.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs directory: writes past 1 MiB fail with ENOSPC."""
    with mounted_tmpfs(tmp_path / "tiny", "1m") as path:
        yield path


def assert_owner_only_under(parent: Path, root: str) -> None:
    """parent/root holds c/ab/x, made under umask 0: the directories above root as
    mkdir -p makes them, root's own directories 0700, the object 0600."""

    def mode(path: Path) -> int:
        return path.stat().st_mode & 0o777

    assert mode(parent) == 0o777
    made = [parent / root, parent / root / "c", parent / root / "c" / "ab"]
    assert [mode(path) for path in made] == [0o700] * 3
    assert mode(parent / root / "c" / "ab" / "x") == 0o600
