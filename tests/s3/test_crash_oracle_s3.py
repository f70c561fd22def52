"""The crash oracle of tests/spec/test_crash_oracle.py against an S3 store (moto).

The clean-room reader reads a local store's layout; an S3 volume keeps the same
objects under PREFIX/NAME (format.md section 12), so the bucket's objects are
copied into a directory laid out as a local store before each read. The copy
is made after the kill and before any remount, as the local test reads its
store.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.prereq import require
from tests.s3.conftest import S3VolumeEnv
from tests.s3.server import all_objects
from tests.spec.test_crash_oracle import S3_SEEDS, check_crash

pytestmark = [pytest.mark.fuse, pytest.mark.slow, pytest.mark.s3]


def download(bucket: str, prefix: str, into: Path) -> Path:
    """Every object of the volume at s3://bucket/prefix, as a local store's files.

    botocore checks each body against the checksum its upload declared: an object
    stored with other bytes than its PUT sent fails the copy (the fault proxy once
    forwarded a killed daemon's half-sent PUT as a whole one)."""
    into.mkdir(parents=True)
    for key, body in all_objects(bucket, prefix + "/").items():
        path = into / key.removeprefix(prefix + "/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(body)
    return into


@pytest.mark.parametrize("seed", S3_SEEDS)
def test_a_killed_s3_mount_leaves_a_prefix_the_clean_room_reader_sees(
    s3_env: S3VolumeEnv, bucket: str, seed: int
) -> None:
    require(os.path.exists("/dev/fuse"), "FUSE is needed")
    copies = iter(range(1_000))

    def copy_store() -> Path:
        return download(bucket, "vol", s3_env.root / f"copy-{next(copies)}")

    log: list[str] = []
    check_crash(s3_env, None, seed, log, copy_store=copy_store, rounds=2)
    print("\n".join(log))
