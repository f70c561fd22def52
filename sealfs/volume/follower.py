"""A read-only mount following the generations a writer elsewhere commits.

The writer only ever adds log segments (none is rewritten or deleted), so
following is what mounting did, again and again: replay what the log holds past
this mount's generation. Each segment is opened and authenticated in a worker
thread and applied on the FUSE loop between two requests, whole, so a reader
always sees a committed generation, never part of one.

What the kernel keeps is the engine's and the FUSE layer's to settle (see
Volume._adopt_followed and docs/design.md).

A rekey seals the writer's next commits, and re-seals every object, under a
key this mount was not given. It unlocks the new header with the secret it was
mounted with, read again from where the mount read it (a file, KMS, a token):
the daemon keeps no secret in memory for it. A passphrase or PIN typed on a
terminal cannot be read again, and a slot the rekey dropped no longer opens: such a
mount stops following, and says to remount.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import trio
import trio.lowlevel

from sealfs.errors import (
    KeyUnavailableError,
    SealfsError,
    StoreError,
    VolumeChangedError,
)
from sealfs.keys.header import decode_header, verify_header_mac
from sealfs.keys.rekey import open_retired
from sealfs.keys.slots import Unlocked
from sealfs.meta.codec import LoggedSegment
from sealfs.volume.committer import Failing, RetryLog
from sealfs.volume.loader import Loaded, fetch_new_segments, read_header

log = logging.getLogger("sealfs.volume")

FOLLOW_BATCH = 256  # segments fetched per look at the store, at most (a long outage's backlog)
# Every this many looks in a row that find nothing new, one also looks a few generations
# further on, for a segment the store lost or hides while it keeps the later ones.
GAP_PROBE_LOOKS = 60
# Unlocks a header with the secret the mount was unlocked with, read again (blocking).
UnlockAgain = Callable[[bytes], Unlocked]
REKEYED = "the volume was rekeyed"
# Between two tries of a key service or token that could not be used at a rekey: each
# try may take a KMS client's timeouts and retries (20 s and more), or an Argon2id run
# that did not fit, and reads failing meanwhile wait for it.
KEY_RETRY_SECONDS = 30.0


class Follower:
    """Looks for new segments every interval and hands each to adopt, in order."""

    def __init__(
        self,
        loaded: Loaded,
        limiter: trio.CapacityLimiter,
        interval: float,
        adopt: Callable[[str, LoggedSegment], None],
        unlock_again: UnlockAgain | None = None,
    ) -> None:
        self._loaded = loaded
        self._limiter = limiter
        self._interval = interval
        self._adopt = adopt
        self._retry_log = RetryLog("reading the writer's new commits", logging.WARNING)
        self._unlock_again = unlock_again  # None: the mount's secret cannot be read again
        self._taking_key = trio.Lock()  # reads failing together unlock the new header once
        self._key_retry = RetryLog("unlocking the rekey's new header", logging.WARNING)
        self._next_key_try = -math.inf  # time.monotonic() after which the unlock is tried
        self.stopped: str | None = None  # why this mount no longer follows, once it does not
        self._empty_looks = 0  # looks in a row that found nothing new

    def failing(self) -> list[tuple[str, Failing]]:
        """What keeps this mount behind the writer for now, and retried: its looks at the
        store, or the unlock of a rekey's new key (KMS or the token out of reach). Only
        the log said so; status showed a mount following with nothing new."""
        retries = (self._retry_log, self._key_retry)
        return [(retry.what, retry.failing) for retry in retries if retry.failing is not None]

    async def loop(self) -> None:
        """Follow until cancelled, or until the log cannot be followed any further."""
        while self.stopped is None:
            await trio.sleep(self._interval)
            await self.catch_up()

    async def catch_up(self) -> None:
        """Adopt every segment the store holds past this mount's generation now (a batch
        at a time, until a look finds none, or the one after the last good fails)."""
        if self._loaded.keys.retired_epoch is not None:
            await self._drop_retired_once_unused()
        while self.stopped is None:
            tried_under = self._loaded.keys.epoch
            past_a_gap = self._empty_looks >= GAP_PROBE_LOOKS
            try:
                # Abandoned on unmount: a look at a store that stopped answering waits up to
                # --store-timeout, and a read-only mount has nothing to finish before it ends.
                batch = await trio.to_thread.run_sync(
                    fetch_new_segments,
                    self._loaded,
                    FOLLOW_BATCH,
                    past_a_gap,
                    limiter=self._limiter,
                    abandon_on_cancel=True,
                )
            except StoreError as exc:  # unreachable, or slow: the next look may get through
                self._retry_log.failed(exc)
                return
            except VolumeChangedError:  # a segment sealed under a newer key epoch
                if await self.notice_rekey(tried_under):
                    continue
                return
            except SealfsError as exc:
                self._stop(str(exc))
                return
            self._retry_log.succeeded()
            self._empty_looks = 0 if batch or past_a_gap else self._empty_looks + 1
            if not batch:
                return
            for name, logged in batch:
                if self.stopped is not None:  # by a read that met a rekey, meanwhile
                    return
                try:
                    self._adopt(name, logged)
                except SealfsError as exc:
                    self._stop(str(exc))
                    return
                # A commit at a time, requests in between: each sees a whole generation,
                # and a batch of big commits (0.9 s for 120,000 records) held them all.
                await trio.lowlevel.checkpoint()

    async def notice_rekey(self, tried_under: int) -> bool:
        """After a read here failed authentication under key epoch tried_under: take the
        new key if the volume's header names a key epoch newer than this mount's. Returns
        whether the mount now holds a newer epoch than tried_under (the read may be tried
        again), taken here or by another request meanwhile.

        A rekey re-seals every chunk in place, and a look meets it only in the writer's
        next commit: after an idle writer's rekey the reads failed, and the mount went
        on following with nothing said in its status. The epoch is the caller's, taken
        before its read: one that failed under the old key while another request took
        the new one found it held already here, and failed with EIO.
        """
        return await self._take_new_key() and self._loaded.keys.epoch > tried_under

    async def _take_new_key(self) -> bool:
        """Hold the keys of the header's epochs if it names a newer one than this mount's,
        unlocking it again (see the module's docstring). Returns whether following goes
        on; stops, saying why, when the new key cannot be had. A header that cannot be
        read says nothing either way: the next look or read asks again. Nor does a key
        service or token out of reach (KeyUnavailableError: KMS unreachable, a token
        unplugged), tried again KEY_RETRY_SECONDS later: it stopped the mount for good,
        where an unreachable store only postpones the next look.
        """
        async with self._taking_key:
            if self.stopped is not None:
                return False
            ring = self._loaded.keys
            try:
                data = await self._read_header()
                found = decode_header(data)
            except SealfsError:
                return False
            if found.data_epoch <= ring.epoch:
                return True  # taken meanwhile, or no rekey at all
            if found.volume_id != self._loaded.volume_id:  # named before any Argon2id run
                self._stop("the store's header now belongs to another volume")
                return False
            if self._unlock_again is None:
                self._stop(
                    f"{REKEYED}, and this mount was unlocked with a passphrase or PKCS#11 PIN"
                    " typed on a terminal, which it cannot read again"
                )
                return False
            if time.monotonic() < self._next_key_try:
                return False
            try:
                unlocked = await trio.to_thread.run_sync(
                    self._unlock_again, data, limiter=self._limiter, abandon_on_cancel=True
                )
                header = unlocked.header  # decoded from the same bytes: the same volume
                retired = open_retired(header, unlocked.master_key)
            except KeyUnavailableError as exc:
                self._key_retry.failed(exc)
                self._next_key_try = time.monotonic() + KEY_RETRY_SECONDS
                return False
            except SealfsError as exc:
                self._stop(f"{REKEYED}, and this mount could not unlock its new key: {exc}")
                return False
            self._key_retry.succeeded()
            ring.follow(header.data_epoch, unlocked.subkeys, retired)
            self._loaded.header = header
            log.info("key epoch %d: this read-only mount reads under it", header.data_epoch)
            return True

    async def _drop_retired_once_unused(self) -> None:
        """Forget the retired epoch's keys once the header, as this epoch's key MACed it,
        no longer names it: the writer has re-sealed every object under the new key.

        The writer commits nothing when it ends a rekey, so only the header tells (one
        GET per look while a rekey is unfinished). Kept, the old key opened, for good,
        whatever the holder of the key the rekey revoked put in the store.
        """
        async with self._taking_key:
            ring = self._loaded.keys
            try:
                data = await self._read_header()
                verify_header_mac(data, ring.current.header_mac_key)
                header = decode_header(data)
            except SealfsError:  # unreadable, or another epoch's: a newer rekey is met apart
                return
            retired = ring.retired_epoch
            if header.data_epoch == ring.epoch and header.retired is None:
                ring.drop_retired()
                self._loaded.header = header
                log.info("key epoch %s is no longer read: the rekey is finished", retired)

    async def _read_header(self) -> bytes:
        """The store's header, read in a worker thread (abandoned on unmount, as a look is)."""
        return await trio.to_thread.run_sync(
            read_header, self._loaded.store, limiter=self._limiter, abandon_on_cancel=True
        )

    def _stop(self, why: str) -> None:
        generation = self._loaded.live.generation
        self.stopped = f"stays at generation {generation}: {why}"
        log.error(
            "this read-only mount stopped following the writer and %s; remount it to see"
            " later changes",
            self.stopped,
        )
