"""Chunks stored as a difference from a similar chunk (sealfs.volume.chunks)."""

import os
import time
from pathlib import Path

import pytest
import trio

from sealfs.chunking.compress import compress_delta
from sealfs.crypto.envelope import (
    FLAG_DELTA,
    FLAG_ZSTD,
    ObjectKind,
    chunk_binding,
    read_envelope_epoch,
    seal_object,
)
from sealfs.errors import (
    FencedError,
    IntegrityError,
    ObjectNotFoundError,
    StoreUnavailableError,
)
from sealfs.keys.kdf import Argon2Params
from sealfs.meta.model import ROOT_INO
from sealfs.store.cache import CachingStore
from sealfs.store.faults import FaultyStore
from sealfs.store.memory import MemoryStore
from sealfs.volume.chunks import chunk_name
from sealfs.volume.engine import Volume
from sealfs.volume.loader import create_volume
from tests.checkpoints import edited, records
from tests.conftest import PASSPHRASE, RECOVERY_KEY, PowerCutStore, mounted
from tests.volume.test_chunks import (
    chunk_bytes,
    damage_object,
    file_chunks,
    read_file,
    write_file,
)
from tests.volume.test_rekey import check_rekeyed, start_rekey

MiB = 1 << 20


def flags_of(store: MemoryStore, chunk_id: bytes) -> int:
    return store.get(chunk_name(chunk_id))[5]


async def base_and_difference(volume: Volume, old: bytes, new: bytes) -> tuple[bytes, bytes]:
    """Write old then new (one chunk each) as files "old" and "new": new's chunk must be
    stored as a difference from old's. Returns their ids."""
    await write_file(volume, b"old", old)
    await volume.fsync()
    await write_file(volume, b"new", new)
    await volume.fsync()
    (base,) = file_chunks(volume, b"old")
    (delta,) = file_chunks(volume, b"new")
    assert volume.meta.chunks[delta].base == base
    return base, delta


async def test_a_rewrite_with_scattered_edits_is_stored_as_differences(
    volume_store: MemoryStore,
) -> None:
    """1 % of the lines changed, scattered: every chunk changes a little. Stored whole,
    the rewrite cost what the file costs compressed; as differences, a small part of
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
        # all but a chunk that shares no end with an old one: 1 % of them (none, or
        # one of 9-13, in most runs; at least 82 % of them in 150 runs)
        assert len(deltas) >= len(ids) * 0.7, (len(deltas), len(ids))
        assert all(flags_of(volume_store, c) == FLAG_DELTA for c in deltas)
    added = chunk_bytes(volume_store) - whole
    # 1-2 % of it in most runs; a run of realigned cuts stores a few chunks whole
    assert added < whole / 2, (added, whole)
    async with mounted(volume_store) as volume:
        await write_file(volume, b"later.json", b"".join(third))
        await volume.fsync()
        for cid in file_chunks(volume, b"later.json"):
            base = volume.meta.chunks[cid].base
            assert not base or not volume.meta.chunks[base].base, "a base is always whole"
    async with mounted(volume_store, chunk_cache_bytes=0) as volume:
        assert await read_file(volume, b"state.json") == b"".join(second)
        assert await read_file(volume, b"later.json") == b"".join(third)


async def test_a_difference_is_kept_where_it_pays_and_a_mere_likeness_is_stored_whole(
    volume_store: MemoryStore,
) -> None:
    """One-chunk files (under 256 KiB), through the batched path. A small edit is a small
    difference. A file grown by new records is a larger one (over 1/16 of it), kept
    because it is under half of the chunk compressed alone. A file that begins alike
    and goes on otherwise shares its first pieces, and is stored whole. It comes in a
    commit of its own: stored, it is what its head's features name, and grown (which
    shares only its head with old) would find it instead of old if it were sealed
    first in the same batch."""
    old = b"".join(records(4, 1200))
    assert 64 * 1024 < len(old) < 150 * 1024
    edit = old[:50_000] + b"an edit" + old[50_000:]
    grown = old + b"".join(records(9, 400))
    other = old[:16384] + os.urandom(len(old) - 16384)
    async with mounted(volume_store) as volume:
        await write_file(volume, b"old", old)
        await volume.fsync()
        for name, data in ((b"edit", edit), (b"grown", grown)):
            await write_file(volume, name, data)
        await volume.fsync()
        await write_file(volume, b"other", other)
        await volume.fsync()
        (old_id,) = file_chunks(volume, b"old")
        edit_row, grown_row, other_row = (
            volume.meta.chunks[file_chunks(volume, name)[0]]
            for name in (b"edit", b"grown", b"other")
        )
        assert edit_row.base == old_id and edit_row.stored_size < 200
        assert grown_row.base == old_id
        assert len(grown) / 16 < grown_row.stored_size < len(grown) / 6
        assert other_row.base == b"" and other_row.stored_size > len(other) * 0.8
    async with mounted(volume_store, chunk_cache_bytes=0) as volume:
        assert await read_file(volume, b"edit") == edit
        assert await read_file(volume, b"grown") == grown
        assert await read_file(volume, b"other") == other


async def three_versions(volume: Volume, v1: bytes, v2: bytes, v3: bytes) -> list[bytes]:
    """Write v1, v2, v3 as files "old", "new" and "v3", the last two differences from
    the first's chunk. Returns the ids of the base and the two differences."""
    base, delta2 = await base_and_difference(volume, v1, v2)
    await write_file(volume, b"v3", v3)
    await volume.fsync()
    (delta3,) = file_chunks(volume, b"v3")
    assert volume.meta.chunks[delta3].base == base
    return [base, delta2, delta3]


@pytest.mark.parametrize("damage", ["missing", "tampered"])
async def test_a_difference_whose_base_is_damaged_fails_and_writing_it_again_repairs_it(
    volume_store: MemoryStore, damage: str
) -> None:
    """Its own object is sound, yet no byte of it can be read without the base: the read
    fails naming both, and writing the bytes again stores them whole."""
    old = b"".join(records(5, 1200))
    new = old[:1000] + b"changed" + old[1000:]
    async with mounted(volume_store) as volume:
        base, delta = await base_and_difference(volume, old, new)
    name = chunk_name(base)
    damage_object(volume_store, name, damage)
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
        base, _ = await base_and_difference(volume, old, old + b"appended")
        await volume.unlink(ROOT_INO, b"old")
        assert volume._chunk_in_use(base)
        await volume.unlink(ROOT_INO, b"new")
        await volume.forget(list(volume._lookups.items()))  # as the kernel would
        assert not volume._chunk_in_use(base)


async def test_only_a_writer_keeps_an_index_of_features(volume_store: MemoryStore) -> None:
    """A read-only mount stores no chunk, so it builds no index (up to about 40 MiB) from
    the table it loads or the rows it follows; the writer's next mount begins one from
    the table and stores the next version as a difference at once."""
    old = b"".join(records(8, 1200))
    async with mounted(volume_store) as volume:
        await base_and_difference(volume, old, old + b"appended")
    async with mounted(volume_store, read_only=True) as reader:
        assert reader.meta.similar is None
        assert await read_file(reader, b"new") == old + b"appended"
        async with mounted(volume_store) as writer:
            assert writer.meta.similar is not None and len(writer.meta.similar) > 0
            await write_file(writer, b"next", old + b"appended twice")
            await writer.fsync()
            (base,) = file_chunks(writer, b"old")
            (delta,) = file_chunks(writer, b"next")
            assert writer.meta.chunks[delta].base == base
        assert reader.follower is not None
        await reader.follower.catch_up()
        assert reader.meta.similar is None and delta in reader.meta.chunks
        assert await read_file(reader, b"next") == old + b"appended twice"


async def test_differences_are_resealed_by_a_rekey_and_read_after_it(
    volume_store: MemoryStore,
) -> None:
    old = b"".join(records(7, 1200))
    new = old[:9000] + old[9100:]
    async with mounted(volume_store) as volume:
        _, delta = await base_and_difference(volume, old, new)
    start_rekey(volume_store)
    async with mounted(volume_store) as volume:
        assert volume.rekey is not None
        await volume.rekey.done.wait()
    check_rekeyed(volume_store, 1)
    assert read_envelope_epoch(volume_store.get(chunk_name(delta))) == 1
    assert flags_of(volume_store, delta) == FLAG_DELTA
    async with mounted(volume_store, chunk_cache_bytes=0) as volume:
        assert await read_file(volume, b"new") == new


@pytest.mark.parametrize("index_similar", [False, True])
async def test_a_writer_without_the_index_rekeys_differences_and_stores_new_chunks_whole(
    volume_store: MemoryStore, index_similar: bool
) -> None:
    """What `sealfs rekey` opens when no daemon holds the volume: it re-seals every
    difference in place and writes no file data, so it keeps no index of features.
    Data it did write would be stored whole, where a writer with the index (the
    other case) stores a version like a chunk of the new epoch as a difference."""
    old = b"".join(records(7, 1200))
    new = old[:9000] + old[9100:]
    async with mounted(volume_store) as volume:
        _, delta = await base_and_difference(volume, old, new)
    start_rekey(volume_store)
    async with mounted(volume_store, index_similar=index_similar) as volume:
        assert (volume.meta.similar is None) is not index_similar
        assert volume.rekey is not None
        await volume.rekey.done.wait()
        # Features are keyed per epoch: a base for the next version must be new too.
        later, again = old + b"later", old + b"later again"
        await write_file(volume, b"later", later)
        await volume.fsync()
        await write_file(volume, b"again", again)
        await volume.fsync()
        (base,) = file_chunks(volume, b"later")
        (version,) = file_chunks(volume, b"again")
        assert volume.meta.chunks[version].base == (base if index_similar else b"")
    check_rekeyed(volume_store, 1)
    assert flags_of(volume_store, delta) == FLAG_DELTA
    assert flags_of(volume_store, version) == (FLAG_DELTA if index_similar else FLAG_ZSTD)
    async with mounted(volume_store, chunk_cache_bytes=0) as volume:
        assert await read_file(volume, b"new") == new
        assert await read_file(volume, b"later") == later
        assert await read_file(volume, b"again") == again


async def test_a_base_fetched_to_read_a_difference_is_cached_for_the_next(
    volume_store: MemoryStore,
) -> None:
    """Every later version of a region is a difference from the same whole chunk: once a
    read has fetched it, reading another version (or the base's own file) needs no
    second fetch. The store's copy is deleted after the first read to show it."""
    v1 = b"".join(records(10, 1200))
    v2 = v1[:1000] + b"changed" + v1[1000:]
    v3 = v1[:70_000] + b"changed later" + v1[70_000:]
    async with mounted(volume_store) as volume:
        base, _, _ = await three_versions(volume, v1, v2, v3)
    async with mounted(volume_store) as volume:
        assert await read_file(volume, b"new") == v2
        volume_store.delete(chunk_name(base))
        assert await read_file(volume, b"v3") == v3
        assert await read_file(volume, b"old") == v1


@pytest.mark.parametrize("damage", ["missing", "tampered"])
async def test_a_difference_from_a_base_found_damaged_is_not_deduplicated_again(
    volume_store: MemoryStore, damage: str
) -> None:
    """Two versions of a region are differences from the same base. A read of one finds
    the base damaged; writing the other version's bytes (a restore from a backup)
    must store them whole, not use the difference again, which cannot be read."""
    v1 = b"".join(records(12, 1200))
    v2 = v1[:1000] + b"changed" + v1[1000:]
    v3 = v1[:70_000] + b"changed later" + v1[70_000:]
    async with mounted(volume_store) as volume:
        base, d2 = await base_and_difference(volume, v1, v2)
        await write_file(volume, b"v3", v3)
        await volume.fsync()
    damage_object(volume_store, chunk_name(base), damage)
    async with mounted(volume_store, chunk_cache_bytes=0) as volume:
        with pytest.raises((ObjectNotFoundError, IntegrityError)):
            await read_file(volume, b"v3")
        await write_file(volume, b"restored", v2)
        await volume.fsync()
        assert volume.meta.chunks[d2].base == b""
    assert flags_of(volume_store, d2) != FLAG_DELTA
    async with mounted(volume_store, chunk_cache_bytes=0) as volume:
        assert await read_file(volume, b"restored") == v2
        assert await read_file(volume, b"new") == v2  # the same chunk, whole now


async def test_a_whole_copy_found_of_a_difference_from_a_damaged_base_stands(
    volume_store: MemoryStore,
) -> None:
    """This mount never read the difference itself, only its base: its copy may have been
    repaired meanwhile by a writer that took the volume over (whose rekey may seal
    it under a key this writer lacks). Written again, the chunk is put create-only,
    and a whole copy found stands."""
    v1 = b"".join(records(16, 1200))
    v2 = v1[:1000] + b"changed" + v1[1000:]
    v3 = v1[:70_000] + b"changed later" + v1[70_000:]
    async with mounted(volume_store) as volume:
        base, d2 = await base_and_difference(volume, v1, v2)
        await write_file(volume, b"v3", v3)
        await volume.fsync()
    damage_object(volume_store, chunk_name(base), "missing")
    async with mounted(volume_store, chunk_cache_bytes=0) as volume:
        with pytest.raises(ObjectNotFoundError):
            await read_file(volume, b"v3")
        repaired = seal_whole(volume, d2, v2)
        volume_store.put(chunk_name(d2), repaired)  # by the writer that took over
        await write_file(volume, b"restored", v2)
        await volume.fsync()
        assert volume.meta.chunks[d2].base == b""
    assert volume_store.get(chunk_name(d2)) == repaired
    async with mounted(volume_store, chunk_cache_bytes=0) as volume:
        assert await read_file(volume, b"restored") == v2


async def test_a_difference_cached_on_disk_gives_way_to_the_chunk_repaired_in_the_store(
    volume_store: MemoryStore, tmp_path: Path
) -> None:
    """Another mount (a follower, or this volume mounted from another host) holds a
    chunk's difference in its disk cache, but not the base, which is damaged. A
    writer repairs the chunk by writing its bytes again: stored whole now. The
    cached difference still opens, and read alone it made the file unreadable on
    that host until its cache was cleared."""
    v1 = b"".join(records(13, 1200))
    v2 = v1[:1000] + b"changed" + v1[1000:]
    async with mounted(volume_store) as volume:
        base, delta = await base_and_difference(volume, v1, v2)
    cached = CachingStore(volume_store, tmp_path / "cache", 64 << 20)
    cached.get(chunk_name(delta))  # the other host read the file once, its base since evicted
    volume_store.delete(chunk_name(base))
    async with mounted(volume_store, chunk_cache_bytes=0) as volume:  # the writer repairs it
        with pytest.raises(ObjectNotFoundError):
            await read_file(volume, b"new")
        await write_file(volume, b"copy", v2)
        await volume.fsync()
    async with mounted(cached, read_only=True, chunk_cache_bytes=0) as volume:
        assert await read_file(volume, b"new") == v2
    assert flags_of(volume_store, delta) != FLAG_DELTA


async def test_an_unreachable_store_fails_a_difference_at_its_base_without_a_put(
    volume_store: MemoryStore,
) -> None:
    """Each request to a store that stopped answering waits out --store-timeout. The base's
    read giving up is the chunk's failure: passed over, the chunk was stored whole,
    and its put waited out the timeout again (twice more with a second base)."""
    old = b"".join(records(15, 1200))
    faulty = FaultyStore(volume_store)
    async with mounted(faulty, chunk_cache_bytes=0, commit_interval=3600.0) as volume:
        await write_file(volume, b"old", old)
        await volume.fsync()
        faulty.add_rule("get", "c/", "unavailable")
        faulty.add_rule("put", "c/", "unavailable")
        await write_file(volume, b"new", old[:1000] + b"changed" + old[1000:])
        with pytest.raises(StoreUnavailableError):
            await volume.fsync()
        assert [(method, fault) for method, _, fault in faulty.injected] == [("get", "unavailable")]
        faulty.clear()
        await volume.fsync()


def seal_whole(volume: Volume, cid: bytes, plaintext: bytes) -> bytes:
    """Chunk cid (holding plaintext) sealed whole under the volume's current key."""
    binding = chunk_binding(volume.chunks._volume_id, cid)
    with volume.chunks._keys.sealing() as (epoch, keys):
        return seal_object(keys.chunk_key, ObjectKind.CHUNK, binding, plaintext, epoch=epoch)


def seal_as_difference(volume: Volume, cid: bytes, plaintext: bytes, root: bytes) -> bytes:
    """Chunk cid (holding plaintext) sealed as a difference from chunk root, whole in
    the table: what a writer that did not know cid as a base could have put."""
    root_plain = volume.chunks.cache.peek(root)
    assert root_plain is not None
    frame = compress_delta(plaintext, root_plain)
    binding = chunk_binding(volume.chunks._volume_id, cid)
    with volume.chunks._keys.sealing() as (epoch, keys):
        return seal_object(
            keys.chunk_key, ObjectKind.CHUNK, binding, root + frame, flags=FLAG_DELTA, epoch=epoch
        )


async def test_a_base_found_in_the_store_as_a_difference_is_replaced_whole(
    volume_store: MemoryStore,
) -> None:
    """A base must be whole: its differences are read with it and nothing more. A base
    without a row (kept_with_a_base_without_a_row) found as a sound difference was
    kept, and the file using its difference read FormatError from then on."""
    v1 = b"".join(records(14, 1200))
    v2 = v1[:1000] + b"changed" + v1[1000:]
    other = os.urandom(100_000)
    base = await kept_with_a_base_without_a_row(volume_store, v1, v2)
    async with mounted(volume_store) as volume:
        await write_file(volume, b"other", other)
        await volume.fsync()
        (root,) = file_chunks(volume, b"other")
        assert await read_file(volume, b"other") == other
        volume_store.put(chunk_name(base), seal_as_difference(volume, base, v1, root))
        await write_file(volume, b"again", v1)
        await volume.fsync()
        assert volume.meta.chunks[base].base == b""
    assert flags_of(volume_store, base) != FLAG_DELTA
    async with mounted(volume_store, chunk_cache_bytes=0) as volume:
        assert await read_file(volume, b"new") == v2
        assert await read_file(volume, b"again") == v1


class GetLogStore(MemoryStore):
    """A memory store that notes the name of every object read."""

    def __init__(self) -> None:
        super().__init__()
        self.got: list[str] = []

    def get(self, name: str, max_size: int | None = None) -> bytes:
        self.got.append(name)
        return super().get(name, max_size)


async def test_the_next_checkpoint_compresses_against_the_bases_its_read_fetched(
    kdf_params: Argon2Params,
) -> None:
    """The agent's round: read the last checkpoint (a difference), write the next. The
    write finds its base in the plaintext cache instead of fetching it again."""
    store = GetLogStore()
    create_volume(store, PASSPHRASE, kdf_params, RECOVERY_KEY)
    v1 = b"".join(records(11, 1200))
    v2 = v1[:1000] + b"changed" + v1[1000:]
    v3 = v2[:80_000] + b"changed next" + v2[80_000:]
    async with mounted(store) as volume:
        base, _ = await base_and_difference(volume, v1, v2)
    async with mounted(store) as volume:
        assert await read_file(volume, b"new") == v2
        store.got.clear()
        await write_file(volume, b"next", v3)
        await volume.fsync()
        assert volume.meta.chunks[file_chunks(volume, b"next")[0]].base == base
        assert chunk_name(base) not in store.got


class HeldBaseStore(GetLogStore):
    """Holds each read of one object (held) until all of others have been asked for, so
    that reads begun side by side meet while one of them fetches it."""

    def __init__(self) -> None:
        super().__init__()
        self.held = ""
        self.others: set[str] = set()

    def get(self, name: str, max_size: int | None = None) -> bytes:
        if name == self.held:
            deadline = time.monotonic() + 5  # else the test fails below, not hangs
            while not self.others <= set(self.got) and time.monotonic() < deadline:
                time.sleep(0.002)
        return super().get(name, max_size)


@pytest.mark.parametrize("damage", ["none", "missing"])
async def test_versions_read_side_by_side_fetch_their_base_once(
    kdf_params: Argon2Params, damage: str
) -> None:
    """Three versions of a checkpoint read at once are a base and two differences from
    it: the reads wait for the first one's fetch of the base, or fail with it."""
    store = HeldBaseStore()
    create_volume(store, PASSPHRASE, kdf_params, RECOVERY_KEY)
    v1 = b"".join(records(12, 1200))
    v2 = v1[:1000] + b"changed" + v1[1000:]
    v3 = v1[:70_000] + b"changed later" + v1[70_000:]
    async with mounted(store) as volume:
        base, delta2, delta3 = await three_versions(volume, v1, v2, v3)
    store.held = chunk_name(base)
    store.others = {chunk_name(delta2), chunk_name(delta3)}
    if damage == "missing":
        store.delete(chunk_name(base))
    outcomes: dict[bytes, bytes | Exception] = {}

    async def read(name: bytes) -> None:
        try:
            outcomes[name] = await read_file(volume, name)
        except ObjectNotFoundError as exc:
            outcomes[name] = exc

    async with mounted(store) as volume:
        store.got.clear()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read, b"new")
            nursery.start_soon(read, b"v3")
            nursery.start_soon(read, b"old")
        assert store.others <= set(store.got)  # both differences were fetched, then:
        assert store.got.count(chunk_name(base)) == 1
        if damage == "none":
            assert outcomes == {b"new": v2, b"v3": v3, b"old": v1}
        else:
            for name, delta in ((b"new", delta2), (b"v3", delta3)):
                error = outcomes[name]
                assert isinstance(error, ObjectNotFoundError)
                assert f"{chunk_name(delta)}, stored as a difference" in str(error)
                assert chunk_name(base) in str(error)
            assert isinstance(outcomes[b"old"], ObjectNotFoundError)


@pytest.mark.parametrize("damage", ["missing", "tampered"])
async def test_a_damaged_base_written_again_is_stored_whole_and_its_differences_read(
    volume_store: MemoryStore, damage: str
) -> None:
    """Writing a damaged base's bytes again repairs every difference from it, so it must
    come back whole: stored as a difference from a chunk written meanwhile (which
    took over its features), the repair made its differences unreadable for good, and
    a new chunk like them was stored as a difference from it, readable only until
    the plaintext cache forgot it."""
    v1 = b"".join(records(5, 1200))
    v2 = v1[:1000] + b"changed" + v1[1000:]
    v3 = v1[:60_000] + b"another edit" + v1[60_000:]
    v4 = v2[:90_000] + b"a later edit" + v2[90_000:]
    async with mounted(volume_store) as volume:
        base, _ = await base_and_difference(volume, v1, v2)
    damage_object(volume_store, chunk_name(base), damage)
    async with mounted(volume_store, chunk_cache_bytes=0) as volume:
        await write_file(volume, b"v3", v3)  # its base is damaged: stored whole
        await volume.fsync()
        await write_file(volume, b"old again", v1)  # the repair
        await volume.fsync()
        assert volume.meta.chunks[base].base == b""
        await write_file(volume, b"v4", v4)
        await volume.fsync()
        (later,) = file_chunks(volume, b"v4")
        root = volume.meta.chunks[later].base
        assert not root or not volume.meta.chunks[root].base, "a base is always whole"
    assert flags_of(volume_store, base) != FLAG_DELTA
    async with mounted(volume_store, chunk_cache_bytes=0) as volume:
        for name, data in ((b"old", v1), (b"new", v2), (b"v3", v3), (b"v4", v4)):
            assert await read_file(volume, name) == data, name


async def crashed_before_recording(
    store: MemoryStore, old: bytes, new: bytes
) -> tuple[bytes, bytes]:
    """A base and a difference from it in the store, which no commit records: as if the
    writer died after uploading them, before its segment. Returns their ids."""
    async with mounted(store) as volume:
        segments = set(store.list("l/"))
        base, delta = await base_and_difference(volume, old, new)
    for name in set(store.list("l/")) - segments:
        store.delete(name)
    return base, delta


async def test_a_difference_found_in_the_store_is_kept_and_its_unrecorded_base_made_durable(
    kdf_params: Argon2Params,
) -> None:
    """The next writer of the same bytes finds the difference in the store and keeps it.
    Its base is in no commit and may not have reached the disk (the writer that put
    it died before its sync): the writer puts it again, create-only, so that its own
    sync flushes it, and a power cut after the commit takes neither."""
    store = PowerCutStore()
    create_volume(store, PASSPHRASE, kdf_params, RECOVERY_KEY)
    old = b"".join(records(8, 1200))
    new = old[:5000] + b"an edit" + old[5000:]
    base, delta = await crashed_before_recording(store, old, new)
    store.unsynced |= {chunk_name(base), chunk_name(delta)}  # it died before its sync
    async with mounted(store) as volume:
        assert base not in volume.meta.chunks
        await write_file(volume, b"new", new)
        await volume.fsync()
        assert file_chunks(volume, b"new") == [delta]
        row = volume.meta.chunks[delta]
        assert row.base == base  # the copy found, kept, and counted as the store holds it
        assert row.stored_size == len(store.get(chunk_name(delta))) < len(new) / 10
    store.cut_power()
    async with mounted(store, chunk_cache_bytes=0) as volume:
        assert await read_file(volume, b"new") == new


async def write_a_likeness_then(volume: Volume, data: bytes, base: bytes) -> None:
    """Write a file like data, then data, whose one chunk is base: it must be stored
    whole, not as a difference from the likeness."""
    await write_file(volume, b"other", data[:80_000] + b"other edit" + data[80_000:])
    await volume.fsync()
    await write_file(volume, b"old", data)
    await volume.fsync()
    assert volume.meta.chunks[base].base == b""


async def check_whole_and_read(store: MemoryStore, base: bytes, name: bytes, data: bytes) -> None:
    """base is stored whole, and file name (a difference from it) reads data after a
    remount, with no plaintext cached."""
    assert flags_of(store, base) != FLAG_DELTA
    async with mounted(store, chunk_cache_bytes=0) as volume:
        assert await read_file(volume, name) == data


async def kept_with_a_base_without_a_row(store: MemoryStore, old: bytes, new: bytes) -> bytes:
    """A crashed writer's base and difference (crashed_before_recording), then file "new"
    written by the next writer, which keeps the difference found: its row names a
    base that has no row. Returns the base's id."""
    base, delta = await crashed_before_recording(store, old, new)
    async with mounted(store) as volume:
        await write_file(volume, b"new", new)
        await volume.fsync()
        assert base not in volume.meta.chunks and volume.meta.chunks[delta].base == base
    return base


async def test_a_damaged_copy_found_is_replaced_whole_and_a_difference_from_it_kept(
    volume_store: MemoryStore,
) -> None:
    """The crashed writer's base came back damaged, its difference sound. The next writer
    of the base's bytes replaces the damaged copy, whole although a chunk written
    meanwhile is like it (stored as a difference from that chunk, it made the
    difference found next unreadable), and then keeps the difference it finds."""
    v1 = b"".join(records(5, 1200))
    v2 = v1[:1000] + b"changed" + v1[1000:]
    base, delta = await crashed_before_recording(volume_store, v1, v2)
    damage_object(volume_store, chunk_name(base), "tampered")
    async with mounted(volume_store) as volume:
        await write_a_likeness_then(volume, v1, base)  # which finds the damaged copy
        await write_file(volume, b"new", v2)  # finds the difference: kept
        await volume.fsync()
        assert volume.meta.chunks[delta].base == base
    await check_whole_and_read(volume_store, base, b"new", v2)


async def test_a_missing_base_with_no_row_written_again_is_stored_whole(
    volume_store: MemoryStore,
) -> None:
    """A difference kept from a crashed writer names a base with no row. Gone from the
    store, the base is no object a create-only put finds: written again after a
    chunk like it, it was stored as a difference from that chunk, and the kept
    difference read FormatError for good (writing the base's bytes once more
    deduplicated onto the new row)."""
    v1 = b"".join(records(5, 1200))
    v2 = v1[:1000] + b"changed" + v1[1000:]
    base = await kept_with_a_base_without_a_row(volume_store, v1, v2)
    volume_store.delete(chunk_name(base))
    async with mounted(volume_store) as volume:
        await write_a_likeness_then(volume, v1, base)
    await check_whole_and_read(volume_store, base, b"new", v2)


async def test_a_damaged_base_no_row_names_but_a_difference_does_stops_the_rekey(
    volume_store: MemoryStore,
) -> None:
    """A difference kept from a crashed writer names a base with no row of its own. The
    rekey leaves a damaged chunk that no file uses (a crash's leftover), and asked
    only the table's rows whether this one was recorded: it left the base, under
    the key it then dropped, and the file lost its bytes."""
    old = b"".join(records(9, 1200))
    new = old[:3000] + b"an edit" + old[3000:]
    base = await kept_with_a_base_without_a_row(volume_store, old, new)
    damage_object(volume_store, chunk_name(base), "tampered")
    start_rekey(volume_store)
    async with mounted(volume_store) as volume:
        assert volume.rekey is not None
        with trio.fail_after(30):
            await volume.rekey.ended.wait()
        assert volume.rekey.progress.stopped and not volume.rekey.progress.finished
        assert volume.loaded.keys.retired_epoch == 0  # the old key is kept


async def test_a_writer_taken_over_keeps_the_new_writers_difference(
    volume_store: MemoryStore,
) -> None:
    """A writer taken over (not fenced yet) writes bytes the new writer has committed as
    a difference from a chunk the old one never saw. It must keep that copy: replaced
    by its own difference, from a chunk it alone wrote and no commit records, the new
    writer's file lost its bytes with that chunk."""
    v1 = b"".join(records(5, 1200))
    v2 = v1[:1000] + b"changed" + v1[1000:]
    mine = v2[:80_000] + b"old writer's edit" + v2[80_000:]
    with pytest.raises(BaseExceptionGroup) as ended:
        async with (
            mounted(volume_store, commit_interval=3600.0) as old_writer,
            mounted(volume_store, takeover=True) as new_writer,
        ):
            base, delta = await base_and_difference(new_writer, v1, v2)
            for name, data in ((b"mine", mine), (b"theirs", v2)):
                await write_file(old_writer, name, data)
                ino = old_writer.meta.inodes[ROOT_INO].entries[name]  # type: ignore[index]
                await old_writer.commits._flush_early(ino)  # uploads, no commit
            (only_mine,) = file_chunks(old_writer, b"mine")
            assert only_mine not in new_writer.meta.chunks
    fenced, others = ended.value.split(FencedError)
    assert fenced is not None and others is None, others  # its last commit refused, no more
    volume_store.delete(chunk_name(only_mine))
    async with mounted(volume_store, chunk_cache_bytes=0, read_only=True) as volume:
        assert volume.meta.chunks[delta].base == base
        assert await read_file(volume, b"new") == v2
