"""Tamper tests: a store that corrupts, swaps or drops objects gives EIO or a refusal.

The threat model promises that every byte a read returns is authentic:
tampering gives EIO and a log line naming the object, never wrong data; a
damaged log is refused at mount (exit code 4) without writing anything.
One pristine volume is built per module; each test tampers with a copy.
"""

from __future__ import annotations

import errno
import hashlib
import os
import random
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from sealfs.cli.status_cmd import _rows
from sealfs.crypto.envelope import ENVELOPE_OVERHEAD
from tests.mounts import VolumeEnv, sealfs

pytestmark = pytest.mark.fuse

FILE_SIZE = 8 << 20
BLOCK = 256 << 10  # the smallest chunk is 256 KiB: each chunk covers at least one block
DATA = random.Random(99).randbytes(FILE_SIZE)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store holding one volume with one multi-chunk file, cleanly unmounted."""
    env = VolumeEnv(tmp_path_factory.mktemp("pristine"))
    env.init()
    env.mount()
    try:
        (env.mnt / "data.bin").write_bytes(DATA)  # its chunks are the only ones
    finally:
        env.umount()
    assert not env.cleanup()
    return env.store


@pytest.fixture
def env(pristine: Path, tmp_path: Path) -> Iterator[VolumeEnv]:
    """A fresh copy of the pristine volume (not mounted); leaks are checked at teardown."""
    e = VolumeEnv(tmp_path)
    shutil.copytree(pristine, e.store)
    yield e
    assert not e.cleanup(), "the test left a mount or a daemon behind"


def chunk_paths(store: Path) -> list[Path]:
    return sorted((store / "c").glob("*/*"))


def whole_block_chunks(store: Path) -> list[Path]:
    """The chunks holding BLOCK bytes or more: each holds the start of some block, which
    read_blocks reads first. The file's last chunk may be shorter (the volume's key seeds
    the chunking): it can sit wholly inside a block that starts in the chunk before it,
    and once that one fails, read_blocks never reaches it."""
    return [p for p in chunk_paths(store) if p.stat().st_size >= BLOCK + ENVELOPE_OVERHEAD]


def object_name(store: Path, path: Path) -> str:
    return path.relative_to(store).as_posix()


def store_fingerprint(store: Path) -> dict[str, str]:
    return {
        p.relative_to(store).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(store.rglob("*"))
        if p.is_file()
    }


def flip_byte(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    at = len(data) // 2 if offset is None else offset
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def read_blocks(path: Path) -> list[int]:
    """Read the file block by block (no readahead); return the indexes of blocks
    that fail with EIO. Every byte that a read returns must be the original byte
    (a read may come back short before the EIO: the pages before the bad chunk)."""
    bad = []
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        for index, offset in enumerate(range(0, FILE_SIZE, BLOCK)):
            pos, end = offset, offset + BLOCK
            while pos < end:
                try:
                    got = os.pread(fd, end - pos, pos)
                except OSError as exc:
                    assert exc.errno == errno.EIO, exc
                    bad.append(index)
                    break
                assert got, f"unexpected end of file at {pos}"
                assert got == DATA[pos : pos + len(got)], f"wrong bytes at {pos}"
                pos += len(got)
    finally:
        os.close(fd)
    return bad


def runs(indexes: list[int]) -> int:
    """How many contiguous runs the sorted indexes form."""
    return sum(1 for i, x in enumerate(indexes) if i == 0 or indexes[i - 1] != x - 1)


def test_pristine_volume_has_several_chunks(pristine: Path) -> None:
    assert len(chunk_paths(pristine)) >= 4
    assert len(whole_block_chunks(pristine)) >= 3  # all but perhaps the last one


def test_flipped_byte_in_a_chunk_gives_eio_there_only(env: VolumeEnv) -> None:
    victim = chunk_paths(env.store)[1]
    flip_byte(victim)
    env.mount()
    try:
        bad = read_blocks(env.mnt / "data.bin")
        assert bad, "a tampered chunk was read without error"
        assert len(bad) < FILE_SIZE // BLOCK and runs(bad) == 1, bad
    finally:
        env.umount()
    assert object_name(env.store, victim) in env.log_text(), "the log does not name the object"


def test_read_spanning_chunks_logs_typed_eio_not_exception_group(env: VolumeEnv) -> None:
    """Regression: a read over several chunks fetched them in a nursery, so a bad chunk
    surfaced as an ExceptionGroup: logged as an unexpected error with a traceback."""
    victim = chunk_paths(env.store)[0]
    flip_byte(victim)
    env.mount()
    try:
        # Every boundary of the bad chunk falls inside some read request: that
        # request spans two chunks and takes the concurrent-fetch path.
        assert read_blocks(env.mnt / "data.bin")
    finally:
        env.umount()
    log = env.log_text()
    assert f"I/O error: chunk {object_name(env.store, victim)}" in log, log
    assert "Traceback" not in log and "unexpected error" not in log, log


def test_swapped_chunks_give_eio_never_other_bytes(env: VolumeEnv) -> None:
    a, b = whole_block_chunks(env.store)[:2]  # both read, so both logged
    os.replace(a, b)  # b now holds a's (authentic, but differently bound) bytes; a is gone
    env.mount()
    try:
        bad = read_blocks(env.mnt / "data.bin")
        assert bad and len(bad) < FILE_SIZE // BLOCK and runs(bad) <= 2, bad
    finally:
        env.umount()
    log = env.log_text()
    assert object_name(env.store, b) in log and object_name(env.store, a) in log


def test_truncated_chunk_gives_eio(env: VolumeEnv) -> None:
    victim = chunk_paths(env.store)[2]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 3])
    env.mount()
    try:
        bad = read_blocks(env.mnt / "data.bin")
        assert bad and len(bad) < FILE_SIZE // BLOCK and runs(bad) == 1, bad
    finally:
        env.umount()
    assert object_name(env.store, victim) in env.log_text()


def refused_mount(env: VolumeEnv, code: int | None = 4) -> str:
    """Mount must fail without touching the store; returns its one stderr line."""
    before = store_fingerprint(env.store)
    result = env.mount(check=False)
    assert not env.is_mounted()
    if code is None:
        assert result.returncode != 0
    else:
        assert result.returncode == code, (result.returncode, result.stderr)
    err = result.stderr.strip()
    assert err and "\n" not in err and "Traceback" not in err, err
    assert store_fingerprint(env.store) == before, "a refused mount changed the store"
    return err


def test_tampered_segment_refuses_mount_naming_the_segment(env: VolumeEnv) -> None:
    """Regression (the fix): the line ended at "data was modified or the key is wrong",
    where a gap or a broken chain in the log names what to restore or move out."""
    flip_byte(env.store / "l" / "0000000000000002")
    err = refused_mount(env)
    assert "segment 2" in err or "0000000000000002" in err, err
    assert "restore the store from a complete copy" in err, err
    assert "move l/0000000000000002 and the segments after it out" in err, err
    assert "to mount generation 1" in err, err


def test_missing_middle_segment_refuses_mount(env: VolumeEnv) -> None:
    segments = sorted((env.store / "l").iterdir())
    assert len(segments) >= 4
    segments[2].unlink()
    err = refused_mount(env)
    assert "missing" in err, err


def test_newest_segments_deleted_refuse_mount_on_the_host_that_saw_them(env: VolumeEnv) -> None:
    """A log cut short leaves only authentic objects: the host's record is what tells."""
    older = {p.relative_to(env.store) for p in env.store.glob("[ls]/*")}
    env.mount()
    try:
        for i in range(3):
            (env.mnt / f"later-{i}.txt").write_text(f"written after the cut {i}")
            assert sealfs("sync", str(env.mnt)).returncode == 0  # a commit each
    finally:
        env.umount()
    newer = [p for p in env.store.glob("[ls]/*") if p.relative_to(env.store) not in older]
    assert len(newer) >= 4  # the writer's claim, three syncs, the release
    for path in newer:
        path.unlink()
    err = refused_mount(env)
    assert "rolled back" in err and "--accept-rollback" in err, err
    status = env.store_status()
    assert status["seen_generation"] > status["generation"]
    assert "rolled back" in dict(_rows(status))["seen on this host"]
    env.mount("--accept-rollback")
    try:
        assert sorted(p.name for p in env.mnt.iterdir()) == ["data.bin"]
        assert (env.mnt / "data.bin").read_bytes() == DATA
    finally:
        env.umount()


def test_tampered_header_refuses_mount(env: VolumeEnv) -> None:
    header = env.store / "sealfs.vol"
    size = header.stat().st_size
    for offset in (20, size // 2, size - 40):  # early body, middle of the body, end of the body
        original = header.read_bytes()
        flip_byte(header, offset)
        refused_mount(env, code=None)
        header.write_bytes(original)


def test_a_copy_written_separately_served_as_the_log_this_host_saw_refuses_mount(
    env: VolumeEnv, tmp_path: Path
) -> None:
    """A copy of the volume (a backup, mounted and written elsewhere) shares its id and
    keys: from where it diverged, its log chains onto the same history, every object
    authentic. A store holding one served its longer branch in place of the one this
    host committed, and the mount showed the copy's files, this host's gone without a
    word: the generation alone, which the copy had passed, could not tell."""
    copy = VolumeEnv(tmp_path / "copy")
    shutil.copytree(env.store, copy.store)
    shutil.copy(env.passfile, copy.passfile)
    shared = {p.relative_to(env.store) for p in env.store.glob("[ls]/*")}
    copy.mount()
    try:
        for name in ("copy-1", "copy-2", "copy-3"):
            (copy.mnt / name).write_text(name)
            assert sealfs("sync", str(copy.mnt)).returncode == 0  # a commit each
    finally:
        copy.umount()
    assert not copy.cleanup()
    env.mount()
    try:
        (env.mnt / "here.txt").write_text("committed on this host")
    finally:
        env.umount()
    ours = [p for p in env.store.glob("[ls]/*") if p.relative_to(env.store) not in shared]
    theirs = [p for p in copy.store.glob("[ls]/*") if p.relative_to(copy.store) not in shared]
    assert len(theirs) > len(ours)  # the copy's branch is the longer one
    for path in ours:
        path.unlink()
    for path in [*theirs, *copy.store.glob("c/*/*")]:
        target = env.store / path.relative_to(copy.store)
        target.parent.mkdir(exist_ok=True)
        shutil.copy(path, target)
    err = refused_mount(env)
    assert "another copy" in err and "--accept-rollback" in err, err
    env.mount("--accept-rollback")  # a restore of that copy, meant
    try:
        assert sorted(p.name for p in env.mnt.iterdir()) == [
            "copy-1", "copy-2", "copy-3", "data.bin",
        ]  # fmt: skip
    finally:
        env.umount()
