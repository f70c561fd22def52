"""The figures of `sealfs status`, checked against what the engine and the store hold."""

from __future__ import annotations

import pytest

from sealfs.meta.model import ROOT_INO
from sealfs.store.base import ObjectStore
from sealfs.volume.status import volume_status
from tests.volume.test_engine import GID, RW, UID, install_cached_unlock, session
from tests.volume.test_filedata import SMALL, stream, wait_until, write_stream

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _cached_unlock(monkeypatch: pytest.MonkeyPatch) -> None:
    install_cached_unlock(monkeypatch)


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
