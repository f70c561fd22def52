"""A read-only mount following the generations a writer elsewhere commits.

The writer only ever adds log segments (none is rewritten or deleted), so
following is what mounting did, again and again: replay what the log holds past
this mount's generation. Each segment is opened and authenticated in a worker
thread and applied on the FUSE loop between two requests, whole, so a reader
always sees a committed generation, never part of one.

What the kernel keeps is the engine's and the FUSE layer's to settle (see
Volume._adopt_followed and docs/design.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio
import trio.lowlevel

from sealfs.errors import SealfsError, StoreError, VolumeChangedError
from sealfs.keys.header import decode_header
from sealfs.meta.codec import LoggedSegment
from sealfs.volume.committer import RetryLog
from sealfs.volume.loader import Loaded, fetch_new_segments, read_header

log = logging.getLogger("sealfs.volume")

FOLLOW_BATCH = 256  # segments fetched per look at the store, at most (a long outage's backlog)


class Follower:
    """Looks for new segments every interval and hands each to adopt, in order."""

    def __init__(
        self,
        loaded: Loaded,
        limiter: trio.CapacityLimiter,
        interval: float,
        adopt: Callable[[str, LoggedSegment], None],
    ) -> None:
        self._loaded = loaded
        self._limiter = limiter
        self._interval = interval
        self._adopt = adopt
        self._retry_log = RetryLog("reading the writer's new commits", logging.WARNING)
        self.stopped: str | None = None  # why this mount no longer follows, once it does not

    async def loop(self) -> None:
        """Follow until cancelled, or until the log cannot be followed any further."""
        while self.stopped is None:
            await trio.sleep(self._interval)
            await self.catch_up()

    async def catch_up(self) -> None:
        """Adopt every segment the store holds past this mount's generation now (a batch
        at a time, until a look finds none, or the one after the last good fails)."""
        while self.stopped is None:
            try:
                # Abandoned on unmount: a look at a store that stopped answering waits up to
                # --store-timeout, and a read-only mount has nothing to finish before it ends.
                batch = await trio.to_thread.run_sync(
                    fetch_new_segments,
                    self._loaded,
                    FOLLOW_BATCH,
                    limiter=self._limiter,
                    abandon_on_cancel=True,
                )
            except StoreError as exc:  # unreachable, or slow: the next look may get through
                self._retry_log.failed(exc)
                return
            except SealfsError as exc:
                self._stop(exc)
                return
            self._retry_log.succeeded()
            if not batch:
                return
            for name, logged in batch:
                if self.stopped is not None:  # by a read that met a rekey, meanwhile
                    return
                try:
                    self._adopt(name, logged)
                except SealfsError as exc:
                    self._stop(exc)
                    return
                # A commit at a time, requests in between: each sees a whole generation,
                # and a batch of big commits (0.9 s for 120,000 records) held them all.
                await trio.lowlevel.checkpoint()

    async def notice_rekey(self) -> None:
        """After a read here failed authentication: stop, saying why, if the volume's
        header names a key epoch newer than this mount's.

        A rekey re-seals every chunk in place under a key this mount lacks, and a look
        meets it only in the writer's next commit: after an idle writer's rekey the
        mount went on following, its status said nothing, and its reads failed.
        """
        if self.stopped is not None:
            return
        try:
            data = await trio.to_thread.run_sync(
                read_header, self._loaded.store, limiter=self._limiter, abandon_on_cancel=True
            )
            epoch = decode_header(data).data_epoch
        except SealfsError:  # an unreadable header says nothing of a rekey
            return
        if epoch > self._loaded.keys.epoch:
            self._stop(VolumeChangedError(f"the volume's header names key epoch {epoch}"))

    def _stop(self, exc: SealfsError) -> None:
        generation = self._loaded.live.generation
        if isinstance(exc, VolumeChangedError):
            why = "the volume was rekeyed, and this mount holds only the keys it was mounted with"
        else:
            why = str(exc)
        self.stopped = f"stays at generation {generation}: {why}"
        log.error(
            "this read-only mount stopped following the writer and %s; remount it to see"
            " later changes",
            self.stopped,
        )
