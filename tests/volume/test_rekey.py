"""Rekey at engine level: a new key epoch, old objects re-sealed in place, the old key dropped."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from sealfs.crypto.envelope import ObjectKind, chunk_binding, read_envelope_epoch, reseal
from sealfs.errors import FencedError, FsError, IntegrityError, WrongKeyError
from sealfs.keys.header import HEADER_NAME, decode_header
from sealfs.keys.rekey import begin_rekey
from sealfs.keys.slots import (
    Passphrase,
    RecoveryKey,
    SlotMaker,
    passphrase_slot_maker,
    recovery_slot_maker,
    unlock,
)
from sealfs.meta.model import ROOT_INO
from sealfs.store.base import ObjectStore
from sealfs.store.cache import CachingStore
from sealfs.volume.chunks import MAX_SEALED_CHUNK, chunk_name
from sealfs.volume.engine import Volume
from sealfs.volume.header_io import read_header_version, write_header
from sealfs.volume.loader import check_writer, claim_writer, open_volume
from sealfs.volume.options import VolumeOptions
from tests.conftest import PASSPHRASE, RECOVERY_KEY, cheap_kdf, mounted
from tests.volume.test_engine import ino_of, mkfile, read_all, write_at

NEW_RECOVERY = bytes(range(100, 132))


def object_epochs(store: ObjectStore) -> dict[str, int]:
    """The key epoch every sealed object of the store names."""
    names = [n for p in ("c/", "l/", "s/") for n in store.list(p)]
    return {name: read_envelope_epoch(store.get(name)) for name in names}


def start_rekey(store: ObjectStore, *, recovery: bytes = NEW_RECOVERY) -> bytes:
    """What `sealfs rekey` does before it hands the key over: the epoch N+1 header."""
    old = read_header_version(store)
    unlocked = unlock(old.data, Passphrase(PASSPHRASE))
    makers: dict[int, SlotMaker] = {}
    for slot in unlocked.header.slots:
        if slot.kind == "passphrase":
            makers[slot.slot_id] = passphrase_slot_maker(PASSPHRASE, cheap_kdf())
        else:
            makers[slot.slot_id] = recovery_slot_maker(recovery)
    new, master = begin_rekey(unlocked, makers)
    write_header(store, old, new)
    return master


async def write_sample(volume: Volume, tag: bytes, size: int) -> dict[str, bytes]:
    files = {}
    for k in range(4):
        data = os.urandom(size // 4) + tag * 1000
        await mkfile(volume, ROOT_INO, b"%s-%d" % (tag, k), data)
        files[f"{tag.decode()}-{k}"] = data
    return files


async def check_files(volume: Volume, files: dict[str, bytes]) -> None:
    for name, content in files.items():
        assert await read_all(volume, await ino_of(volume, name)) == content


async def rekey_to_the_end(store: ObjectStore, files: dict[str, bytes]) -> None:
    """Mount, let the rekey the header asks for finish, and check the files on the way."""
    async with mounted(store) as volume:
        assert volume.rekey is not None
        with trio.fail_after(60):
            await volume.rekey.ended.wait()
        assert volume.rekey.progress.finished, volume.rekey.progress.error
        await check_files(volume, files)


def check_rekeyed(store: ObjectStore, epoch: int) -> None:
    """Every object is sealed under epoch, and the header keeps no retired key."""
    epochs = object_epochs(store)
    assert epochs and set(epochs.values()) == {epoch}, "an object is under an older epoch"
    header = decode_header(store.get(HEADER_NAME))
    assert header.data_epoch == epoch and header.retired is None


async def test_rekey_reseals_every_object_while_the_volume_is_written(
    volume_store: ObjectStore,
) -> None:
    async with mounted(volume_store, commit_interval=0.05) as volume:
        files = await write_sample(volume, b"old", 3 << 20)
        await volume.fsync()
        await volume.commits.snapshot()  # an s/ object of epoch 0 too
        assert set(object_epochs(volume_store).values()) == {0}
        master = start_rekey(volume_store)
        await volume.adopt_rekey(master)
        assert volume.loaded.keys.epoch == 1
        files |= await write_sample(volume, b"new", 2 << 20)  # while the rekey runs
        await write_at(volume, await ino_of(volume, "old-0"), 5, b"overwritten")
        data = files["old-0"]
        files["old-0"] = data[:5] + b"overwritten" + data[16:]
        with trio.fail_after(60):
            await volume.rekey.done.wait()  # type: ignore[union-attr]
        progress = volume.rekey.progress  # type: ignore[union-attr]
        assert progress.finished and progress.error is None and progress.resealed > 0
        assert volume.loaded.keys.retired_epoch is None
        await check_files(volume, files)

    check_rekeyed(volume_store, 1)
    with pytest.raises(WrongKeyError):  # the old recovery key opens nothing any more
        unlock(volume_store.get(HEADER_NAME), RecoveryKey(RECOVERY_KEY))
    async with mounted(volume_store) as volume:
        await check_files(volume, files)


async def test_an_interrupted_rekey_resumes_at_the_next_mount(volume_store: ObjectStore) -> None:
    async with mounted(volume_store) as volume:
        files = await write_sample(volume, b"f", 4 << 20)
    start_rekey(volume_store)
    loaded = open_volume(volume_store, Passphrase(PASSPHRASE))
    assert loaded.keys.epoch == 1 and loaded.keys.retired_epoch == 0
    # Re-seal some chunks by hand, as a rekey killed half-way would have left them.
    old, new = loaded.keys.keys(0), loaded.keys.current
    chunks = volume_store.list("c/")
    for name in chunks[:3]:
        binding = chunk_binding(loaded.volume_id, bytes.fromhex(name[-64:]))
        sealed = volume_store.get(name)
        volume_store.put(
            name, reseal(old.chunk_key, new.chunk_key, 1, ObjectKind.CHUNK, binding, sealed)
        )
    left = sum(1 for epoch in object_epochs(volume_store).values() if epoch == 0)
    async with mounted(volume_store) as volume:  # the mount carries on by itself
        assert volume.rekey is not None
        with trio.fail_after(60):
            await volume.rekey.done.wait()
        assert volume.rekey.progress.resealed == left  # what was done is not done again
        await check_files(volume, files)
    check_rekeyed(volume_store, 1)


async def test_adopt_rekey_refuses_a_key_the_header_does_not_name(
    volume_store: ObjectStore,
) -> None:
    async with mounted(volume_store) as volume:
        with pytest.raises(FsError):
            await volume.adopt_rekey(os.urandom(32))  # no rekey started: nothing to adopt
        master = start_rekey(volume_store)
        with pytest.raises(FsError):
            await volume.adopt_rekey(bytes(a ^ 1 for a in master))
        assert volume.loaded.keys.epoch == 0
        await volume.adopt_rekey(master)
        await volume.adopt_rekey(master)  # asking twice is harmless
        assert volume.loaded.keys.epoch == 1
        with trio.fail_after(60):
            await volume.rekey.done.wait()  # type: ignore[union-attr]


async def test_a_store_object_of_an_unknown_epoch_stops_the_rekey(
    volume_store: ObjectStore,
) -> None:
    async with mounted(volume_store) as volume:
        await write_sample(volume, b"x", 1 << 20)
    name = volume_store.list("c/")[0]
    data = bytearray(volume_store.get(name))
    data[6:8] = (7).to_bytes(2, "big")  # a foreign epoch: never re-sealed, never trusted
    volume_store.put(name, bytes(data))
    start_rekey(volume_store)
    async with mounted(volume_store) as volume:
        assert volume.rekey is not None
        with trio.fail_after(30):
            while volume.rekey.progress.error is None:
                await trio.sleep(0.01)
        assert "key epoch 7" in volume.rekey.progress.error
        assert volume.loaded.keys.retired_epoch == 0  # the old key is kept: nothing is lost
    assert decode_header(volume_store.get(HEADER_NAME)).retired is not None
    assert read_envelope_epoch(volume_store.get(name)) == 7


async def test_a_stale_cached_chunk_does_not_stop_a_later_rekey(
    volume_store: ObjectStore, tmp_path: Path
) -> None:
    cached = CachingStore(volume_store, tmp_path / "cache", 1 << 30)
    async with mounted(cached) as volume:  # its cache keeps the epoch-0 chunks
        files = await write_sample(volume, b"a", 2 << 20)
    start_rekey(volume_store)  # 0 -> 1, done without that cache (another host, another dir)
    async with mounted(volume_store) as volume:
        with trio.fail_after(60):
            await volume.rekey.done.wait()  # type: ignore[union-attr]
    start_rekey(volume_store)  # 1 -> 2, resumed by a mount that uses the old cache
    await rekey_to_the_end(CachingStore(volume_store, tmp_path / "cache", 1 << 30), files)
    check_rekeyed(volume_store, 2)


async def test_a_rekey_that_finds_a_chunk_done_drops_its_old_cached_copy(
    volume_store: ObjectStore, tmp_path: Path
) -> None:
    """A rekey resumed by a mount whose cache was filled before the rekey began, after
    another process (another host, `sealfs rekey` with its own cache) re-sealed the
    chunks in the store. Regression: deciding from the store's copy, it skipped those
    chunks and left their old-key copies in its own cache for good, which README says
    only caches the rekeying process did not use may hold."""
    cache = tmp_path / "cache"
    async with mounted(CachingStore(volume_store, cache, 1 << 30)) as volume:
        files = await write_sample(volume, b"o", 2 << 20)  # cached under epoch 0
    start_rekey(volume_store)
    mid_rekey = volume_store.get(HEADER_NAME)
    async with mounted(volume_store) as volume:  # done elsewhere, without that cache
        with trio.fail_after(60):
            await volume.rekey.done.wait()  # type: ignore[union-attr]
    # Interrupted just before the old key was dropped there: resumed with the old cache.
    volume_store.put(HEADER_NAME, mid_rekey)
    async with mounted(CachingStore(volume_store, cache, 1 << 30)) as volume:
        with trio.fail_after(60):
            await volume.rekey.done.wait()  # type: ignore[union-attr]
    check_rekeyed(volume_store, 1)
    cached = [p for p in (cache / "c").rglob("*") if p.is_file()]
    assert {read_envelope_epoch(p.read_bytes()) for p in cached} <= {1}  # no file read yet
    async with mounted(volume_store) as volume:
        await check_files(volume, files)


async def test_a_rekey_resumed_on_a_restored_store_reseals_what_its_cache_holds_resealed(
    volume_store: ObjectStore, tmp_path: Path
) -> None:
    """A store restored from a backup taken mid-rekey, mounted with the cache of the
    mount that had finished that rekey (or a copy of the store made mid-rekey, sharing
    a cache with the original): the cache holds every chunk re-sealed, the store the
    old epoch's. Regression: the rekey read the cached copies, skipped the chunks as
    done, dropped the old key, and every file then read EIO without that cache."""
    async with mounted(volume_store) as volume:
        files = await write_sample(volume, b"r", 4 << 20)
    start_rekey(volume_store)
    backup = dict(volume_store._objects)  # type: ignore[attr-defined]  # taken mid-rekey
    await rekey_to_the_end(CachingStore(volume_store, tmp_path / "cache", 1 << 30), files)
    volume_store._objects.clear()  # type: ignore[attr-defined]  # restored, not mounted
    volume_store._objects.update(backup)  # type: ignore[attr-defined]
    await rekey_to_the_end(CachingStore(volume_store, tmp_path / "cache", 1 << 30), files)
    check_rekeyed(volume_store, 1)
    async with mounted(volume_store) as volume:  # without that cache
        await check_files(volume, files)


async def test_a_damaged_object_stops_the_rekey_and_asking_again_resumes_it(
    volume_store: ObjectStore,
) -> None:
    async with mounted(volume_store) as volume:
        await write_sample(volume, b"d", 1 << 20)
    name = volume_store.list("c/")[0]
    good = volume_store.get(name)
    volume_store.put(name, good[:30] + bytes([good[30] ^ 1]) + good[31:])
    master = start_rekey(volume_store)
    async with mounted(volume_store) as volume:
        assert volume.rekey is not None
        with trio.fail_after(30):
            await volume.rekey.ended.wait()  # stopped: not retried for ever
        assert volume.rekey.progress.stopped and not volume.rekey.progress.finished
        assert "failed authentication" in (volume.rekey.progress.error or "")
        assert volume.loaded.keys.retired_epoch == 0  # the old key is kept: nothing is lost
        volume_store.put(name, good)  # repaired (restored from a backup)
        await volume.adopt_rekey(master)  # what `sealfs rekey` run again does
        with trio.fail_after(60):
            await volume.rekey.done.wait()
    check_rekeyed(volume_store, 1)


@pytest.mark.parametrize("damage", ["cut short", "too large"])
async def test_a_damaged_chunk_no_file_uses_does_not_stop_the_rekey(
    volume_store: ObjectStore, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    """What a power cut leaves of a chunk written but never committed: a file cut short
    under the chunk's name (after a direct write, to its last whole 4 KiB). Or one
    larger than any chunk, refused before it is read: the same leniency (regression:
    that refusal stopped the rekey)."""
    async with mounted(volume_store) as volume:
        files = await write_sample(volume, b"p", 1 << 20)
    leftover = "c/ff/" + "ff" * 32
    sealed = volume_store.get(volume_store.list("c/")[0])
    junk = sealed[:4096] if damage == "cut short" else sealed + bytes(MAX_SEALED_CHUNK)
    volume_store.put(leftover, junk)
    start_rekey(volume_store)
    await rekey_to_the_end(volume_store, files)
    epochs = object_epochs(volume_store)
    assert epochs.pop(leftover) == 0  # left as it was
    assert set(epochs.values()) == {1}
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert [w for w in warnings if leftover in w and "not re-sealed" in w]


async def test_a_damaged_chunk_whose_files_are_gone_does_not_stop_the_rekey(
    volume_store: ObjectStore, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: a chunk the chunk table names (nothing is collected) but no file uses
    any more stopped every rekey for good, and the retired key stayed in force: the
    only fix named, restoring the object, needs a backup. One a file deleted but still
    open uses stops it, as one any file uses does (it may be damaged in transit only)."""
    async with mounted(volume_store) as volume:
        files = await write_sample(volume, b"k", 1 << 20)
        victim = await mkfile(volume, ROOT_INO, b"victim", os.urandom(300_000))
        await volume.fsync()
        extents = volume.inode(victim).extents
        assert extents is not None
        (name,) = {chunk_name(chunk_id) for chunk_id in extents.chunk_ids()}
    good = volume_store.get(name)
    volume_store.put(name, good[:40] + bytes([good[40] ^ 1]) + good[41:])
    start_rekey(volume_store)
    async with mounted(volume_store) as volume:
        held = await volume.open(await ino_of(volume, "victim"), os.O_RDONLY)
        await volume.unlink(ROOT_INO, b"victim")
        assert volume.rekey is not None
        with trio.fail_after(60):
            await volume.rekey.ended.wait()
        assert volume.rekey.progress.stopped  # the deleted file is open still
        await volume.release(held)
    await rekey_to_the_end(volume_store, files)  # no file uses it: left, and finished
    epochs = object_epochs(volume_store)
    assert epochs.pop(name) == 0
    assert set(epochs.values()) == {1}
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert [w for w in warnings if name in w and "no file uses it" in w]


async def test_a_fenced_writer_never_replaces_a_chunk_the_new_writer_rekeyed(
    volume_store: ObjectStore,
) -> None:
    """A writer taken over, not yet knowing it, read a chunk that the new writer's rekey
    had re-sealed under an epoch it does not hold: it took the chunk for damaged, so its
    next write of the same bytes replaced it with a copy under the old key, and the new
    writer's file read EIO once that key was dropped."""
    data = os.urandom(200_000)
    with pytest.RaisesGroup(FencedError, flatten_subgroups=True):
        async with mounted(volume_store, commit_interval=3600.0, chunk_cache_bytes=0) as old:
            f = await mkfile(old, ROOT_INO, b"f", data)
            await old.fsync()
            loaded = open_volume(volume_store, Passphrase(PASSPHRASE))
            check_writer(loaded, takeover=True)
            claim_writer(loaded)
            await rekey_to_the_end_in(Volume(loaded, VolumeOptions(commit_interval=3600.0)))
            with pytest.raises(IntegrityError):
                await read_all(old, f)  # under epoch 1 now, which it does not hold
            await mkfile(old, ROOT_INO, b"g", data)  # the same bytes: the same chunk ids
            with pytest.raises(FencedError):
                await old.commits.commit()
    async with mounted(volume_store) as volume:
        assert await read_all(volume, await ino_of(volume, "f")) == data


async def rekey_to_the_end_in(volume: Volume) -> None:
    async with volume.running():
        await volume.adopt_rekey(start_rekey(volume.store))
        assert volume.rekey is not None
        with trio.fail_after(60):
            await volume.rekey.ended.wait()
        assert volume.rekey.progress.finished, volume.rekey.progress.error


async def test_a_snapshot_a_fenced_writer_wrote_after_the_rekey_is_passed_over(
    volume_store: ObjectStore, caplog: pytest.LogCaptureFixture
) -> None:
    """A writer taken over wrote its snapshot after the new writer's rekey had re-sealed
    the snapshots and retired the old key: every later mount failed, calling it damaged.
    The log it was made from is whole, so the mount replays that instead."""
    data = os.urandom(200_000)
    with pytest.RaisesGroup(FencedError, flatten_subgroups=True):
        async with mounted(volume_store, commit_interval=3600.0) as old:
            await mkfile(old, ROOT_INO, b"f", data)
            await old.fsync()
            loaded = open_volume(volume_store, Passphrase(PASSPHRASE))
            check_writer(loaded, takeover=True)
            claim_writer(loaded)
            await rekey_to_the_end_in(Volume(loaded, VolumeOptions(commit_interval=3600.0)))
            await old.commits.snapshot()  # under epoch 0, which the volume no longer holds
            late = volume_store.list("s/")[-1]
            assert read_envelope_epoch(volume_store.get(late)) == 0
            await mkfile(old, ROOT_INO, b"g", data)
            with pytest.raises(FencedError):
                await old.commits.commit()
    async with mounted(volume_store) as volume:
        assert await read_all(volume, await ino_of(volume, "f")) == data
    assert f"snapshot {late} passed over" in caplog.text
