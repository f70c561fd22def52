import hashlib
import hmac
import math
import os
from pathlib import Path

import pytest

from sealfs.crypto.ids import chunk_id
from sealfs.errors import FormatError, IntegrityError, ObjectNotFoundError
from sealfs.meta.model import ROOT_INO
from sealfs.store.cache import CachingStore
from sealfs.store.local import LocalStore
from sealfs.store.memory import MemoryStore
from sealfs.volume import chunks
from sealfs.volume.chunks import (
    ENTRY_OVERHEAD,
    MAX_SEALED_CHUNK,
    RESERVED_WORKERS,
    PlainCache,
    small_batch_size,
)
from sealfs.volume.engine import Volume
from sealfs.volume.loader import create_volume
from sealfs.volume.options import VolumeOptions
from tests.checkpoints import records
from tests.conftest import PASSPHRASE, RECOVERY_KEY, cheap_kdf, mounted


async def test_corrupt_cached_chunk_is_refetched_from_the_store(tmp_path: Path) -> None:
    inner = MemoryStore()
    create_volume(inner, PASSPHRASE, cheap_kdf(), RECOVERY_KEY)
    data = os.urandom(2_000_000)
    async with mounted(CachingStore(inner, tmp_path / "cache", 1 << 30)) as volume:
        fh, _ = await volume.create(ROOT_INO, b"f", 0o644, os.O_WRONLY, 0, 0)
        await volume.write(fh, 0, data)
        await volume.release(fh)
    cached = [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
    assert cached, "the write-through cache should hold the chunks"
    for path in cached:
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        path.write_bytes(raw)
    async with mounted(CachingStore(inner, tmp_path / "cache", 1 << 30)) as volume:
        attr = await volume.lookup(ROOT_INO, b"f")
        fh = await volume.open(attr.ino, os.O_RDONLY)
        assert await volume.read(fh, 0, len(data)) == data
        await volume.release(fh)


async def test_a_tampered_chunk_in_the_store_is_an_integrity_error(
    volume_store: MemoryStore,
) -> None:
    async with mounted(volume_store) as volume:
        fh, _ = await volume.create(ROOT_INO, b"f", 0o644, os.O_WRONLY, 0, 0)
        await volume.write(fh, 0, b"precious" * 1000)
        await volume.release(fh)
    for name in volume_store.list("c/"):
        sealed = bytearray(volume_store.get(name))
        sealed[-1] ^= 1
        volume_store.put(name, bytes(sealed))
    async with mounted(volume_store) as volume:
        attr = await volume.lookup(ROOT_INO, b"f")
        fh = await volume.open(attr.ino, os.O_RDONLY)
        with pytest.raises(IntegrityError, match="c/"):
            await volume.read(fh, 0, 100)
        await volume.release(fh)


@pytest.mark.parametrize("damage", ["missing", "tampered"])
async def test_writing_a_damaged_file_s_bytes_again_repairs_it(
    volume_store: MemoryStore, damage: str
) -> None:
    """Regression: new data deduplicated against the chunk table, not against what the
    store holds, so a copy of the same bytes written from a good source was committed
    (fsync said so) onto the very chunk that was gone, and read EIO after a remount."""
    data = os.urandom(300_000)
    async with mounted(volume_store) as volume:
        await write_file(volume, b"damaged", data)
    for name in volume_store.list("c/"):
        damage_object(volume_store, name, damage)
    async with mounted(volume_store) as volume:
        with pytest.raises(ObjectNotFoundError if damage == "missing" else IntegrityError):
            await read_file(volume, b"damaged")
        await write_file(volume, b"rewritten", data)
        await volume.fsync()
    async with mounted(volume_store) as volume:
        assert await read_file(volume, b"rewritten") == data
        assert await read_file(volume, b"damaged") == data  # the same chunk, whole again


def hmac_named(key: bytes, plaintext: bytes | bytearray | memoryview) -> bytes:
    """How sealfs before 0.2.0 named a chunk: HMAC-SHA256 (there under the chunk-id key;
    here under the key it is given, as only the function matters to the names)."""
    return hmac.new(key, plaintext, hashlib.sha256).digest()


def chunk_bytes(store: MemoryStore) -> int:
    return sum(len(store.get(name)) for name in store.list("c/"))


async def test_chunks_an_older_writer_named_read_and_cost_little_to_write_again(
    volume_store: MemoryStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An upgrade from HMAC-SHA256 to BLAKE3 names: a reader never recomputes a name, so
    old chunks read as they are. The same bytes written again get other names, but
    their similarity features did not change, so each chunk large enough to have
    features is stored as a difference from its old twin (a few bytes)."""
    data = b"".join(records(11, 40_000))
    with monkeypatch.context() as older:
        older.setattr(chunks, "keyed_chunk_id", hmac_named)
        async with mounted(volume_store) as volume:
            await write_file(volume, b"old", data)
            await volume.fsync()
            old_ids = file_chunks(volume, b"old")
    assert len(old_ids) >= 2
    whole = chunk_bytes(volume_store)
    async with mounted(volume_store, chunk_cache_bytes=0) as volume:
        assert await read_file(volume, b"old") == data
        await write_file(volume, b"again", data)
        await volume.fsync()
        new_ids = file_chunks(volume, b"again")
        key = volume.loaded.keys.current.chunk_id_blake3_key
        start = 0
        for cid in new_ids:
            row = volume.meta.chunks[cid]
            assert cid == chunk_id(key, data[start : start + row.plain_size])
            assert cid not in old_ids
            assert row.base in old_ids or row.plain_size < 64 * 1024
            start += row.plain_size
    assert chunk_bytes(volume_store) - whole < whole / 20, (chunk_bytes(volume_store), whole)
    async with mounted(volume_store, chunk_cache_bytes=0) as volume:
        assert await read_file(volume, b"old") == data
        assert await read_file(volume, b"again") == data


def file_chunks(volume: Volume, name: bytes) -> list[bytes]:
    ino = volume.meta.inodes[ROOT_INO].entries[name]  # type: ignore[index]
    extents = volume.meta.inodes[ino].extents
    assert extents is not None
    return list(dict.fromkeys(extents.chunk_ids()))


async def write_file(volume: Volume, name: bytes, data: bytes) -> None:
    fh, _ = await volume.create(ROOT_INO, name, 0o644, os.O_WRONLY, 0, 0)
    await volume.write(fh, 0, data)
    await volume.release(fh)


def damage_object(store: MemoryStore, name: str, damage: str) -> None:
    """damage "missing": delete the object; "tampered": flip a bit of its tag."""
    if damage == "missing":
        store.delete(name)
    else:
        sealed = bytearray(store.get(name))
        sealed[-1] ^= 1
        store.put(name, bytes(sealed))


async def read_file(volume: Volume, name: bytes) -> bytes:
    attr = await volume.lookup(ROOT_INO, name)
    fh = await volume.open(attr.ino, os.O_RDONLY)
    try:
        return await volume.read(fh, 0, attr.size)
    finally:
        await volume.release(fh)


async def test_many_small_files_in_one_commit_are_sealed_in_batches(
    volume_store: MemoryStore,
) -> None:
    contents = {
        b"f%03d" % i: (b"same" if i % 3 == 0 else b"unique-%d" % i) * 10 for i in range(600)
    }
    async with mounted(volume_store) as volume:
        for name, data in contents.items():
            fh, _ = await volume.create(ROOT_INO, name, 0o644, os.O_WRONLY, 0, 0)
            await volume.write(fh, 0, data)
            await volume.release(fh)
        puts_before = volume_store.counts["put"]
        await volume.fsync()
        uploads = volume_store.counts["put"] - puts_before
    # Within a batch identical files upload once; concurrent batches of one commit
    # may each upload it once more (an idempotent put), never more than that.
    workers = VolumeOptions().io_threads + RESERVED_WORKERS
    unique, batches = len(set(contents.values())), math.ceil(600 / small_batch_size(600, workers))
    assert unique <= uploads <= unique + batches - 1
    async with mounted(volume_store) as volume:
        for name, data in contents.items():
            attr = await volume.lookup(ROOT_INO, name)
            fh = await volume.open(attr.ino, os.O_RDONLY)
            assert await volume.read(fh, 0, 1000) == data
            await volume.release(fh)


def test_the_plaintext_cache_counts_what_each_entry_costs() -> None:
    """A cache of tiny chunks (small files read one after another) stays within its
    bound in memory, not only in payload bytes: each entry costs about 200 bytes
    beyond its payload."""
    cache = PlainCache(1 << 20)
    for k in range(100_000):
        cache.put(k.to_bytes(32, "big"), b"0123456789")
    assert len(cache._items) <= (1 << 20) // (10 + ENTRY_OVERHEAD)
    assert cache.nbytes <= 1 << 20
    newest = (99_999).to_bytes(32, "big")
    assert cache.get(newest) == b"0123456789"
    cache.discard(newest)
    assert cache.nbytes == len(cache._items) * (10 + ENTRY_OVERHEAD)


async def test_a_chunk_object_larger_than_any_chunk_is_refused_unread(tmp_path: Path) -> None:
    """Junk appended to a chunk in the store (a sparse file costs nothing) was read into
    memory whole before authentication failed: enough of it killed the mount daemon."""
    store = LocalStore(tmp_path / "store")
    create_volume(store, PASSPHRASE, cheap_kdf(), RECOVERY_KEY)
    async with mounted(store) as volume:
        await write_file(volume, b"f", b"precious" * 1000)
    (name,) = store.list("c/")
    with open(tmp_path / "store" / name, "r+b") as f:
        f.truncate(MAX_SEALED_CHUNK + (64 << 20))  # holes: nothing is written to disk
    async with mounted(store) as volume:
        with pytest.raises(FormatError, match=rf"{name} .* more than the {MAX_SEALED_CHUNK}"):
            await read_file(volume, b"f")


def copy_store(source: MemoryStore) -> MemoryStore:
    copy = MemoryStore()
    for name in source.list(""):
        copy.put(name, source.get(name))
    return copy


@pytest.mark.parametrize("found", ["whole", "cut short"])
async def test_a_chunk_another_writer_put_is_kept_unless_it_is_cut_short(
    volume_store: MemoryStore, found: str
) -> None:
    """Regression: a writer replaced every chunk it uploaded, so one that had lost the
    volume to another overwrote chunks the other's rekey had re-sealed with its own,
    sealed under the key the rekey retires: after the rekey, reads failed with EIO."""
    data = os.urandom(300_000)
    other = copy_store(volume_store)
    async with mounted(other) as volume:
        await write_file(volume, b"theirs", data)
    theirs = {name: other.get(name) for name in other.list("c/")}
    assert theirs
    for name, sealed in theirs.items():  # in the store, not yet in this writer's table
        volume_store.put(name, sealed if found == "whole" else sealed[: len(sealed) // 2])
    async with mounted(volume_store) as volume:
        await write_file(volume, b"ours", data)
    for name, sealed in theirs.items():
        now = volume_store.get(name)
        if found == "whole":
            if now != sealed:  # (not assert: a diff of 300 kB of bytes takes minutes)
                pytest.fail(f"the store's copy of {name} was replaced")
        else:
            assert len(now) == len(sealed), f"a cut copy of {name} was kept"
    async with mounted(volume_store) as volume:
        assert await read_file(volume, b"ours") == data


@pytest.mark.parametrize("found", ["flipped byte", "zeros"])
async def test_a_found_chunk_of_the_same_size_that_does_not_open_is_replaced(
    volume_store: MemoryStore, found: str
) -> None:
    """Regression: a chunk found in the store was kept whenever its size was right, so a
    crash leftover that a file system kept at its full size but not its bytes (zeros or
    stale blocks: ext4 data=writeback) was kept for new data, which read EIO once committed."""
    data = os.urandom(300_000)
    other = copy_store(volume_store)
    async with mounted(other) as volume:
        await write_file(volume, b"theirs", data)
    for name in other.list("c/"):
        sealed = bytearray(other.get(name))
        if found == "zeros":
            sealed[:] = bytes(len(sealed))
        else:
            sealed[len(sealed) // 2] ^= 0xFF
        volume_store.put(name, bytes(sealed))
    async with mounted(volume_store) as volume:
        await write_file(volume, b"ours", data)
        await volume.fsync()
    async with mounted(volume_store) as volume:
        assert await read_file(volume, b"ours") == data


async def test_a_chunk_damaged_in_its_key_epoch_is_repaired_by_writing_its_bytes_again(
    volume_store: MemoryStore,
) -> None:
    """Regression: a chunk whose epoch field named an epoch above the volume's was taken
    for another writer's rekey, never for damage: not marked unusable, it was kept when
    its bytes were written again, and stayed unreadable for good."""
    data = os.urandom(300_000)
    async with mounted(volume_store) as volume:
        await write_file(volume, b"damaged", data)
    for name in volume_store.list("c/"):
        sealed = bytearray(volume_store.get(name))
        sealed[7] ^= 0x05  # the low byte of the key epoch (big-endian, bytes 6-7)
        volume_store.put(name, bytes(sealed))
    async with mounted(volume_store) as volume:
        with pytest.raises(IntegrityError, match=r"failed authentication: .* header does not"):
            await read_file(volume, b"damaged")
        await write_file(volume, b"rewritten", data)
        await volume.fsync()
    async with mounted(volume_store) as volume:
        assert await read_file(volume, b"rewritten") == data
        assert await read_file(volume, b"damaged") == data
