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

import boto3
import pytest
from botocore.config import Config

from tests.prereq import require
from tests.s3.conftest import S3VolumeEnv
from tests.s3.server import moto_endpoint
from tests.spec.test_crash_oracle import S3_SEEDS, check_crash

pytestmark = [pytest.mark.fuse, pytest.mark.slow, pytest.mark.s3]


def download(bucket: str, prefix: str, into: Path) -> Path:
    """Every object of the volume at s3://bucket/prefix, as a local store's files.

    The bytes are taken as the service holds them, without botocore's check of the
    checksum the upload declared: moto stores the body of a PUT whose client died
    mid-body (a daemon killed while uploading) with the checksum that client declared,
    where S3 would refuse the PUT. Such an object is an upload that never completed: a
    reader must not need it (format.md section 11: garbage, never an inconsistency)."""
    into.mkdir(parents=True)
    config = Config(s3={"addressing_style": "path"}, response_checksum_validation="when_required")
    c = boto3.client("s3", endpoint_url=moto_endpoint(), config=config)
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        for item in page.get("Contents", []):
            body = c.get_object(Bucket=bucket, Key=item["Key"])["Body"].read()
            path = into / item["Key"].removeprefix(prefix + "/")
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
