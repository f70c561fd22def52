"""The figures of `sealfs status`, checked against what the engine and the store hold."""

from __future__ import annotations

from typing import Any

import pytest
import trio.lowlevel

from sealfs.keys.slots import Passphrase
from sealfs.meta.model import ROOT_INO
from sealfs.store.base import ObjectStore
from sealfs.store.memory import MemoryStore
from sealfs.volume import status
from sealfs.volume.engine import Volume
from sealfs.volume.loader import claim_writer, open_volume
from sealfs.volume.options import VolumeOptions
from sealfs.volume.status import volume_status
from tests.conftest import PASSPHRASE
from tests.volume.test_engine import GID, RW, UID, install_cached_unlock, mkfile, session
from tests.volume.test_filedata import (
    SMALL,
    gated_volume_store,
    stream,
    wait_until,
    write_stream,
)

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _cached_unlock(monkeypatch: pytest.MonkeyPatch) -> None:
    install_cached_unlock(monkeypatch)


def chunk_object_bytes(store: ObjectStore) -> int:
    """Bytes of every chunk object in the store (what `du` of its c/ counts)."""
    return sum(len(store.get(name)) for name in store.list("c/"))


async def test_pending_counts_data_sealed_early_until_it_is_committed(
    volume_store: ObjectStore,
) -> None:
    """Regression: pending_bytes was only what is still in memory. A file past the flush
    threshold is sealed early and its data waits for the next commit, as exposed to a
    crash as a buffer: status showed 2 MiB pending with 100 MB uncommitted."""
    async with session(volume_store, **SMALL) as v:
        fh, _ = await v.create(ROOT_INO, b"big", 0o644, RW, UID, GID)
        await write_stream(v, fh, stream(1, 6 * MiB))  # past the 4 MiB flush threshold
        await wait_until(lambda: not v._relieving)
        status = volume_status(v)
        assert status["pending_bytes"] == 6 * MiB  # none of it is committed ...
        assert status["buffered_bytes"] < 6 * MiB  # ... though some was sealed early
        await v.fsync()
        status = volume_status(v)
        assert status["pending_bytes"] == status["buffered_bytes"] == 0
        await v.release(fh)


async def test_pending_counts_a_commit_in_flight_until_it_is_published(
    memory_store: MemoryStore, kdf_params: Any
) -> None:
    """Regression: a commit takes its records out of pending at its cut, so while its
    segment was being written status showed nothing pending: a crash then lost what a
    script waiting for pending_bytes == 0 took as committed."""
    store = await gated_volume_store(memory_store, kdf_params)
    async with session(store, commit_interval=3600.0) as v:  # type: ignore[arg-type]
        await mkfile(v, ROOT_INO, b"f", stream(4, 200_000))
        before = volume_status(v)
        assert before["pending_bytes"] == 200_000 and before["pending_records"] > 0
        store.put = memory_store.put  # type: ignore[method-assign]  # chunks pass the gate
        store.close_gate()  # the segment's put_if_absent waits
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(v.fsync)
                await wait_until(lambda: store.waiting > 0)
                during = volume_status(v)
                assert during["pending_bytes"] == 200_000, during
                assert during["pending_records"] >= before["pending_records"], during
                store.open_gate()
        finally:
            store.open_gate()
        after = volume_status(v)
        assert after["pending_bytes"] == after["pending_records"] == 0


async def test_sizes_against_what_was_written_and_what_the_store_holds(
    volume_store: ObjectStore,
) -> None:
    """logical_bytes is du --apparent-size (holes in, a hard link once); data_bytes leaves
    the holes out; stored_bytes is the chunks of today's files, store_chunk_bytes every
    chunk object in the store. Regression: the store's chunks of overwritten data were
    nowhere, and a sparse file's holes counted as bytes saved by dedup."""
    blob, other = stream(2, 2 * MiB), stream(3, 1 * MiB)
    async with session(volume_store, **SMALL) as v:
        first = await mkfile(v, ROOT_INO, b"a", blob)
        await mkfile(v, ROOT_INO, b"copy", blob)  # dedups with a
        await v.link(first, ROOT_INO, b"a-link")  # one file, two names
        fh, sparse = await v.create(ROOT_INO, b"sparse", 0o644, RW, UID, GID)
        await v.write(fh, 50 * MiB, b"abc")
        await v.setattr(sparse.ino, size=100 * MiB)
        await v.release(fh)
        await mkfile(v, ROOT_INO, b"over", other)
        await v.fsync()
        fh = await v.open(await _ino(v, b"over"), RW)
        await v.setattr(await _ino(v, b"over"), size=0)
        await v.write(fh, 0, b"short")  # other's chunk stays in the store, unreferenced
        await v.release(fh)
        await v.fsync()
        status: dict[str, Any] = volume_status(v)
        assert status["files"] == 4
        assert status["logical_bytes"] == 2 * len(blob) + 100 * MiB + len(b"short")
        assert status["data_bytes"] == 2 * len(blob) + len(b"abc") + len(b"short")
        assert status["unique_bytes"] == len(blob) + len(b"abc") + len(b"short")
        in_store = chunk_object_bytes(volume_store)
        assert status["store_chunk_bytes"] == in_store
        assert status["store_chunks"] == len(volume_store.list("c/"))
        # other's bytes, sealed: 36 bytes of envelope per chunk, and usually two chunks;
        # an early flush under load (the full suite) may cut it into a few more.
        assert len(other) < in_store - status["stored_bytes"] < len(other) + 8 * 36


async def test_a_mount_s_status_lets_other_requests_in_while_it_counts(
    volume_store: ObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: the pass over every file held the mount's event loop, so on a volume
    of 100,000 files each `sealfs status` stalled every request for one to two seconds."""
    monkeypatch.setattr(status, "SIZES_STEP", 3)
    async with session(volume_store) as v:
        for k in range(12):
            await mkfile(v, ROOT_INO, b"f%d" % k, b"x" * k)
        others_ran = 0
        done = False

        async def other_request() -> None:
            nonlocal others_ran
            while not done:
                others_ran += 1
                await trio.lowlevel.checkpoint()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(other_request)
            await trio.lowlevel.checkpoint()
            ran_before = others_ran
            live = await status.mounted_volume_status(v)
            done = True
        # It pauses once per 3 of the 13 inodes (root included): 4 times. The other task
        # runs at each pause but perhaps the last, where trio may finish the status first.
        assert others_ran - ran_before >= 3
        assert live == volume_status(v)
        assert live["files"] == 12 and live["logical_bytes"] == sum(range(12))


async def _ino(volume: Any, name: bytes) -> int:
    return int((await volume.lookup(ROOT_INO, name)).ino)


async def test_the_last_commit_after_a_mount_is_the_writer_s_claim(
    volume_store: ObjectStore,
) -> None:
    """Regression: the daemon builds its Volume before it claims the writer, and the
    claim is a commit; status then gave the previous commit's time for the claim's
    generation, and a final commit that failed named that older time as the last."""
    loaded = open_volume(volume_store, Passphrase(PASSPHRASE))
    before = loaded.live.committed_ns
    volume = Volume(loaded, VolumeOptions(commit_interval=3600.0))  # as `sealfs mount` does
    claim_writer(loaded)
    assert loaded.live.committed_ns > before
    async with volume.running():
        assert volume.commits.generation == loaded.live.generation
        assert volume.commits.last_commit_ns == loaded.live.committed_ns
