"""Chunks stored as a difference from a similar chunk (sealfs.volume.chunks)."""

import os
import random

import pytest

from sealfs.crypto.envelope import FLAG_DELTA, read_envelope_epoch
from sealfs.errors import IntegrityError, ObjectNotFoundError
from sealfs.meta.model import ROOT_INO
from sealfs.store.memory import MemoryStore
from sealfs.volume.chunks import chunk_name
from sealfs.volume.engine import Volume
from tests.conftest import mounted
from tests.volume.test_chunks import read_file, write_file
from tests.volume.test_rekey import check_rekeyed, start_rekey

MiB = 1 << 20


def records(seed: int, count: int) -> list[bytes]:
    """JSON lines of a few random words each: text that compresses as checkpoints do."""
    rng = random.Random(seed)
    words = [
        "".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 9))) for _ in range(3000)
    ]
    return [
        b'{"id": %d, "text": "%s"}\n' % (i, " ".join(rng.choices(words, k=12)).encode())
        for i in range(count)
    ]


def edited(lines: list[bytes], seed: int, share: float = 0.01) -> list[bytes]:
    """lines with a share of them, scattered, replaced by lines of another length."""
    rng = random.Random(seed)
    out = list(lines)
    for i in rng.sample(range(len(lines)), int(len(lines) * share)):
        out[i] = b'{"id": %d, "text": "revised %d"}\n' % (i, rng.randrange(10**9))
    return out


def chunk_bytes(store: MemoryStore) -> int:
    return sum(len(store.get(name)) for name in store.list("c/"))


def flags_of(store: MemoryStore, chunk_id: bytes) -> int:
    return store.get(chunk_name(chunk_id))[5]


def file_chunks(volume: Volume, name: bytes) -> list[bytes]:
    ino = volume.meta.inodes[ROOT_INO].entries[name]  # type: ignore[index]
    extents = volume.meta.inodes[ino].extents
    assert extents is not None
    return list(dict.fromkeys(extents.chunk_ids()))


async def test_a_rewrite_with_scattered_edits_is_stored_as_differences(
    volume_store: MemoryStore,
) -> None:
    """1 % of the lines changed, scattered: every chunk changes a little. Stored whole,
    the rewrite cost what the file costs compressed; as differences, a few percent of
    that. The second mount finds the bases through the chunk table it replayed."""
    first = records(1, 120_000)
    second = edited(first, 2)
    third = edited(second, 3)
    async with mounted(volume_store) as volume:
        await write_file(volume, b"state.json", b"".join(first))
        await volume.fsync()
    whole = chunk_bytes(volume_store)
    async with mounted(volume_store) as volume:
        await write_file(volume, b"state.json.tmp", b"".join(second))
        await volume.rename(ROOT_INO, b"state.json.tmp", ROOT_INO, b"state.json", 0)
        await volume.fsync()
        ids = file_chunks(volume, b"state.json")
        rows = [volume.meta.chunks[c] for c in ids]
        assert len(ids) >= 5
        deltas = [c for c, row in zip(ids, rows, strict=True) if row.base]
        assert len(deltas) >= len(ids) - 2, "all but the ends' chunks are differences"
        assert all(flags_of(volume_store, c) == FLAG_DELTA for c in deltas)
    added = chunk_bytes(volume_store) - whole
    assert added < whole * 0.15, (added, whole)
    async with mounted(volume_store) as volume:
        await write_file(volume, b"later.json", b"".join(third))
        await volume.fsync()
        for cid in file_chunks(volume, b"later.json"):
            base = volume.meta.chunks[cid].base
            assert not base or not volume.meta.chunks[base].base, "a base is always whole"
    async with mounted(volume_store, chunk_cache_bytes=0) as volume:
        assert await read_file(volume, b"state.json") == b"".join(second)
        assert await read_file(volume, b"later.json") == b"".join(third)


async def test_a_chunk_that_shares_only_an_end_with_another_is_stored_whole(
    volume_store: MemoryStore,
) -> None:
    """One chunk files (under 256 KiB) through the batched path: a small edit is a
    difference, a file that begins alike and goes on otherwise is stored whole."""
    old = b"".join(records(4, 1200))
    assert 64 * 1024 < len(old) < 256 * 1024
    edit = old[:50_000] + b"an edit" + old[50_000:]
    other = old[:4096] + os.urandom(len(old) - 4096)
    async with mounted(volume_store) as volume:
        await write_file(volume, b"old", old)
        await volume.fsync()
        await write_file(volume, b"edit", edit)
        await write_file(volume, b"other", other)
        await volume.fsync()
        (edit_id,) = file_chunks(volume, b"edit")
        (other_id,) = file_chunks(volume, b"other")
        (old_id,) = file_chunks(volume, b"old")
        assert volume.meta.chunks[edit_id].base == old_id
        assert volume.meta.chunks[other_id].base == b""
        assert volume.meta.chunks[edit_id].stored_size < 200
    async with mounted(volume_store, chunk_cache_bytes=0) as volume:
        assert await read_file(volume, b"edit") == edit
        assert await read_file(volume, b"other") == other


@pytest.mark.parametrize("damage", ["missing", "tampered"])
async def test_a_difference_whose_base_is_damaged_fails_and_writing_it_again_repairs_it(
    volume_store: MemoryStore, damage: str
) -> None:
    """Its own object is sound, yet no byte of it can be read without the base: the read
    fails naming both, and writing the bytes again stores them whole."""
    old = b"".join(records(5, 1200))
    new = old[:1000] + b"changed" + old[1000:]
    async with mounted(volume_store) as volume:
        await write_file(volume, b"old", old)
        await volume.fsync()
        await write_file(volume, b"new", new)
        await volume.fsync()
        (base,) = file_chunks(volume, b"old")
        (delta,) = file_chunks(volume, b"new")
        assert volume.meta.chunks[delta].base == base
    name = chunk_name(base)
    if damage == "missing":
        volume_store.delete(name)
    else:
        sealed = bytearray(volume_store.get(name))
        sealed[-1] ^= 1
        volume_store.put(name, bytes(sealed))
    error = ObjectNotFoundError if damage == "missing" else IntegrityError
    async with mounted(volume_store, chunk_cache_bytes=0) as volume:
        with pytest.raises(error, match=f"{chunk_name(delta)}, stored as a difference: .*{name}"):
            await read_file(volume, b"new")
        await write_file(volume, b"again", new)
        await volume.fsync()
        assert volume.meta.chunks[delta].base == b""
    assert flags_of(volume_store, delta) != FLAG_DELTA
    async with mounted(volume_store, chunk_cache_bytes=0) as volume:
        assert await read_file(volume, b"new") == new  # the same chunk, whole now


async def test_a_base_no_file_uses_is_in_use_through_its_differences(
    volume_store: MemoryStore,
) -> None:
    """What the rekey asks before it leaves a damaged chunk behind: a base is needed as
    long as a file uses a chunk stored as a difference from it."""
    old = b"".join(records(6, 1200))
    async with mounted(volume_store) as volume:
        await write_file(volume, b"old", old)
        await volume.fsync()
        await write_file(volume, b"new", old + b"appended")
        await volume.fsync()
        (base,) = file_chunks(volume, b"old")
        (delta,) = file_chunks(volume, b"new")
        assert volume.meta.chunks[delta].base == base
        await volume.unlink(ROOT_INO, b"old")
        assert volume._chunk_in_use(base)
        await volume.unlink(ROOT_INO, b"new")
        await volume.forget(list(volume._lookups.items()))  # as the kernel would
        assert not volume._chunk_in_use(base)


async def test_differences_are_resealed_by_a_rekey_and_read_after_it(
    volume_store: MemoryStore,
) -> None:
    old = b"".join(records(7, 1200))
    new = old[:9000] + old[9100:]
    async with mounted(volume_store) as volume:
        await write_file(volume, b"old", old)
        await volume.fsync()
        await write_file(volume, b"new", new)
        await volume.fsync()
        (delta,) = file_chunks(volume, b"new")
        assert volume.meta.chunks[delta].base
    start_rekey(volume_store)
    async with mounted(volume_store) as volume:
        assert volume.rekey is not None
        await volume.rekey.done.wait()
    check_rekeyed(volume_store, 1)
    assert read_envelope_epoch(volume_store.get(chunk_name(delta))) == 1
    assert flags_of(volume_store, delta) == FLAG_DELTA
    async with mounted(volume_store, chunk_cache_bytes=0) as volume:
        assert await read_file(volume, b"new") == new
