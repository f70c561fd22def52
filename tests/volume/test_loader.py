"""Loading a volume: what it costs the garbage collector."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager

from sealfs.keys.slots import Passphrase, unlock
from sealfs.meta.model import ROOT_INO
from sealfs.store.base import ObjectStore
from sealfs.volume.loader import load_unlocked, read_header
from tests.conftest import PASSPHRASE, mounted


@contextmanager
def collections() -> Iterator[list[int]]:
    """The generations of the garbage collections that run inside."""
    seen: list[int] = []

    def note(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            seen.append(info["generation"])

    gc.callbacks.append(note)
    try:
        yield seen
    finally:
        gc.callbacks.remove(note)


async def test_loading_collects_no_garbage_and_leaves_the_collector_as_it_was(
    volume_store: ObjectStore,
) -> None:
    # Mount time regression: collections triggered while loading scanned every
    # object loaded so far, about half of the load of 100,000 files.
    async with mounted(volume_store) as volume:
        for i in range(2000):
            fh, _ = await volume.create(ROOT_INO, b"f%d" % i, 0o644, os.O_WRONLY, 0, 0)
            await volume.release(fh)
    unlocked = unlock(read_header(volume_store), Passphrase(PASSPHRASE))
    for enabled in (True, False):
        (gc.enable if enabled else gc.disable)()
        try:
            with collections() as seen:
                loaded = load_unlocked(volume_store, unlocked)
            assert len(loaded.live.inodes) == 2001
            # Re-enabled, the collector may catch up once (the generation depends on
            # what ran before); while loading, thousands of allocations trigger none.
            assert len(seen) <= (1 if enabled else 0), seen
            assert gc.isenabled() is enabled
        finally:
            gc.enable()
