"""An agent's checkpoint rewritten in place of the last one, on a real mount."""

import os
from pathlib import Path

import pytest

from tests.checkpoints import edited, records
from tests.mounts import VolumeEnv

pytestmark = pytest.mark.fuse


def chunk_bytes(store: Path) -> int:
    return sum(p.stat().st_size for p in (store / "c").rglob("*") if p.is_file())


def replace_file(path: Path, data: bytes) -> None:
    """Write a temporary file, fsync it, rename it over path: the checkpoint pattern."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def test_checkpoints_with_scattered_edits_are_stored_as_differences_and_survive_a_kill(
    mounted_env: VolumeEnv,
) -> None:
    """Each version changes 1 % of its records, scattered: stored whole, each cost what
    the first did (the file compressed, about 37 % of it); as differences from the
    version before, 0.24 % of the file in most runs. A chunk that shares no end with an
    old one is stored whole (1 MiB in 8), and a run of realigned cuts stores a few: one
    rewrite in 20 added over 5 % in the engine, one in 300 a quarter of the file. So
    the bound is on both rewrites together: less than one version stored whole. The
    version the daemon was killed after reads back whole."""
    path = mounted_env.mnt / "state.json"
    versions = [records(11, 100_000)]
    versions += [edited(versions[-1], seed) for seed in (12, 13)]
    replace_file(path, b"".join(versions[0]))
    first = chunk_bytes(mounted_env.store)
    size = len(b"".join(versions[0]))
    assert first > size * 0.2  # compressed, not stored as nothing
    for version in versions[1:]:
        replace_file(path, b"".join(version))
    added = chunk_bytes(mounted_env.store) - first
    assert added < first, (added, first, size)
    mounted_env.kill()
    mounted_env.mount()
    assert path.read_bytes() == b"".join(versions[-1])
