"""A read-write mount removes the temp files a crashed writer left in a local store."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest
import trio

from sealfs.keys.kdf import Argon2Params
from sealfs.store.local import TEMP_PREFIX, LocalStore
from sealfs.store.retry import RetryingStore
from sealfs.volume.loader import create_volume
from tests.conftest import PASSPHRASE, RECOVERY_KEY, mounted


def leftover(path: Path, age: float) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"sealed bytes of an object never published")
    then = time.time() - age
    os.utime(path, (then, then))
    return path


@pytest.mark.parametrize("read_only", [False, True])
async def test_a_writable_mount_removes_old_temp_files_and_keeps_young_ones(
    tmp_path: Path, kdf_params: Argon2Params, caplog: pytest.LogCaptureFixture, read_only: bool
) -> None:
    """Regression: nothing ever called the local store's clean-up, so every crash of a
    writer left its temp files in the store (and in every backup of it) for good."""
    root = tmp_path / "store"
    create_volume(LocalStore(root), PASSPHRASE, kdf_params, RECOVERY_KEY)
    old = [
        leftover(root / "c" / "ab" / f"{TEMP_PREFIX}crashed", 7200),
        leftover(root / "l" / f"{TEMP_PREFIX}crashed", 7200),
    ]
    young = leftover(root / f"{TEMP_PREFIX}header-being-replaced", 60)
    caplog.set_level(logging.INFO)
    async with mounted(RetryingStore(LocalStore(root)), read_only=read_only):
        with trio.move_on_after(10):
            while any(p.exists() for p in old) and not read_only:
                await trio.sleep(0.01)
        await trio.sleep(0.1)  # a read-only mount had its chance to (wrongly) remove them
    assert [p.exists() for p in old] == [read_only, read_only]
    assert young.exists()
    removed = "removed 2 temp files a crash left in the store"
    assert (removed in caplog.text) is not read_only
