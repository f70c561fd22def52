"""Moving a volume between stores with ordinary tools: every file of a local store
copied to an S3 prefix, every key copied back, by a plain boto3 client (no sealfs
code), as `aws s3 sync` does (README, "Moving a volume to another store")."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.mounts import VolumeEnv
from tests.s3.conftest import S3VolumeEnv
from tests.s3.server import client
from tests.spec.reader import read_volume


def tree(root: Path) -> dict[str, bytes | str | None]:
    """Every path under root: a file's bytes, a symlink's target, None for a directory."""
    out: dict[str, bytes | str | None] = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            out[rel] = os.readlink(path)
        elif path.is_dir():
            out[rel] = None
        else:
            out[rel] = path.read_bytes()
    return out


@pytest.fixture
def s3_copy(tmp_path: Path, bucket: str, moto: str) -> Iterator[S3VolumeEnv]:
    """A mountpoint for the volume once copied to s3://BUCKET/vol (not initialised)."""
    env = S3VolumeEnv(tmp_path / "s3", url=f"s3://{bucket}/vol", endpoint=moto)
    yield env
    assert not env.cleanup(), "the test left a mount or a daemon behind"


@pytest.fixture
def local_copy(tmp_path: Path) -> Iterator[VolumeEnv]:
    """A mountpoint for the volume once copied back to a local directory."""
    env = VolumeEnv(tmp_path / "back")
    yield env
    assert not env.cleanup(), "the test left a mount or a daemon behind"


def test_a_volume_copied_to_s3_and_back_key_for_key_mounts_at_each_place(
    volume_env: VolumeEnv, s3_copy: S3VolumeEnv, local_copy: VolumeEnv, bucket: str
) -> None:
    env = volume_env
    env.mount()
    (env.mnt / "a" / "b").mkdir(parents=True)
    (env.mnt / "a" / "big.bin").write_bytes(os.urandom(700_000))
    (env.mnt / "a" / "b" / "small.txt").write_text("hello\n")
    (env.mnt / "link").symlink_to("a/b/small.txt")
    env.umount()
    (env.store / ".lock").touch()  # what a key change leaves, and a crash's temp file
    (env.store / "l" / ".tmp-0123456789abcdef").write_bytes(b"half")
    env.mount("--read-only")
    before = tree(env.mnt)
    env.umount()

    s3 = client()
    for path in env.store.rglob("*"):  # everything, hidden files too: they are ignored
        if path.is_file():
            key = f"vol/{path.relative_to(env.store)}"
            s3.put_object(Bucket=bucket, Key=key, Body=path.read_bytes())
    s3_copy.mount()
    assert tree(s3_copy.mnt) == before
    (s3_copy.mnt / "moved.txt").write_text("written in S3\n")
    s3_copy.umount()

    listed = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix="vol/")
    for page in listed:
        for item in page.get("Contents", []):
            path = local_copy.store / item["Key"].removeprefix("vol/")
            path.parent.mkdir(parents=True, exist_ok=True)  # with the umask's modes
            path.write_bytes(s3.get_object(Bucket=bucket, Key=item["Key"])["Body"].read())
    volume = read_volume(local_copy.store, passphrase=env.passfile.read_bytes())
    assert volume.tree["/moved.txt"].data == b"written in S3\n"
    assert volume.tree["/a/big.bin"].data == before["a/big.bin"]
    local_copy.mount()
    assert tree(local_copy.mnt) == {**before, "moved.txt": b"written in S3\n"}
    local_copy.umount()
