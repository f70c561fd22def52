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


async def test_a_directory_the_writer_removed_with_its_parent_still_lists_on_a_follower(
    volume_store: ObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read-only mount following the writer, with a directory open whose parent the
    writer removed too: a listing (getdents) failed with ENOENT, looking up "." and "..",
    where the writer's own mount lists it empty. ".." names the directory itself then."""
    replies: list[tuple[bytes, int]] = []

    def reply(token: object, name: bytes, attr: pyfuse3.EntryAttributes, offset: int) -> bool:
        replies.append((name, attr.st_ino))
        return True

    monkeypatch.setattr(pyfuse3, "readdir_reply", reply)
    async with (
        mounted(volume_store) as writer,
        mounted(volume_store, read_only=True, commit_interval=3600.0) as reader,
    ):
        a = (await writer.mkdir(ROOT_INO, b"a", 0o755, 0, 0)).ino
        b = (await writer.mkdir(a, b"b", 0o755, 0, 0)).ino
        await writer.fsync()
        assert reader.follower is not None
        await reader.follower.catch_up()
        ops = Operations(reader)
        fh = await ops.opendir(b, None)
        await writer.rmdir(a, b"b")
        await writer.rmdir(ROOT_INO, b"a")
        await writer.forget(list(writer._lookups.items()))  # its kernel let go of both
        await writer.fsync()
        await reader.follower.catch_up()
        await ops.readdir(fh, 0, None)
        assert replies == [(b".", b), (b"..", b)]
        await ops.releasedir(fh)
