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


def test_a_checkpoint_with_scattered_edits_adds_a_few_percent_and_survives_a_kill(
    mounted_env: VolumeEnv,
) -> None:
    """Each version changes 1 % of its records, scattered: stored whole, each cost about
    a third of the file (what it costs compressed); as differences from the version
    before, 0.24 % of it in most runs. A chunk whose cut points both moved shares no
    end with an old one and is stored whole (1 MiB in 8), so the bound leaves room for
    two. The version the daemon was killed after reads back whole."""
    path = mounted_env.mnt / "state.json"
    versions = [records(11, 100_000)]
    versions += [edited(versions[-1], seed) for seed in (12, 13)]
    replace_file(path, b"".join(versions[0]))
    first = chunk_bytes(mounted_env.store)
    size = len(b"".join(versions[0]))
    assert first > size * 0.2  # compressed, not stored as nothing
    for version in versions[1:]:
        before = chunk_bytes(mounted_env.store)
        replace_file(path, b"".join(version))
        added = chunk_bytes(mounted_env.store) - before
        assert added < size * 0.15, (added, size)
    mounted_env.kill()
    mounted_env.mount()
    assert path.read_bytes() == b"".join(versions[-1])
