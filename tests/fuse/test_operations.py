"""The FUSE adapter's own decisions, driven without a kernel mount (a memory-store volume)."""

from __future__ import annotations

import errno
import logging
import os

import pyfuse3
import pytest

from sealfs.fuse.operations import Operations, RepeatedErrors
from sealfs.meta.model import ROOT_INO
from sealfs.store.base import ObjectStore
from tests.conftest import mounted


async def test_flush_without_sync_on_close_asks_the_kernel_to_stop_sending_it(
    volume_store: ObjectStore,
) -> None:
    """ENOSYS is the kernel's cue to send no more FLUSH requests on the mount: close()
    waits for nothing then, so each one would be a wasted round trip."""
    async with mounted(volume_store) as volume:
        fh, _ = await volume.create(ROOT_INO, b"f", 0o644, os.O_WRONLY, 0, 0)
        with pytest.raises(pyfuse3.FUSEError) as info:
            await Operations(volume).flush(fh)
        assert info.value.errno == errno.ENOSYS


async def test_flush_with_sync_on_close_commits(volume_store: ObjectStore) -> None:
    async with mounted(volume_store, sync_on_close=True) as volume:
        fh, _ = await volume.create(ROOT_INO, b"f", 0o644, os.O_WRONLY, 0, 0)
        await volume.write(fh, 0, b"data")
        assert volume.commits.has_work()
        await Operations(volume).flush(fh)
        assert not volume.commits.has_work()


def test_a_repeated_request_error_is_logged_again_after_ten_minutes_with_its_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Left-out repeats are not lost from sight: the next line of the same error counts
    them, and another error is logged at once."""
    now = [0.0]
    errors = RepeatedErrors(clock=lambda: now[0])
    caplog.set_level(logging.ERROR, logger="sealfs.fuse")
    for _ in range(5):
        errors.error("store disk full")
        now[0] += 1.0
    errors.error("another error")
    now[0] = RepeatedErrors.REPEAT_AFTER + 1.0
    errors.error("store disk full")
    assert [r.getMessage() for r in caplog.records] == [
        "store disk full",
        "another error",
        "store disk full (the same error 4 more times since it was last logged)",
    ]
