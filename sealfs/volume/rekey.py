"""Re-sealing every object of the retired key epoch under the current one.

Runs in the volume's single writer: the mount daemon, or `sealfs rekey` when
nothing is mounted. Each object of the old epoch is opened with that epoch's
key and its payload (as stored: nothing is recompressed) sealed again under
the new epoch, with the same name and identity binding, replacing the object
in place. Readers see the old or the new object, and open either while the
rekey runs. Chunk names stay what they were (their ids were keyed under the
old epoch); new data gets ids keyed under the new epoch.

Order, so that nothing sealed under the old key survives:
1. wait until no seal under the old epoch is in flight (KeyRing counts them;
   every later seal uses the new epoch);
2. list c/, s/ and l/ and re-seal every object that names the old epoch;
3. commit (a segment whose create was retried may still hold old-epoch
   bytes), re-check the segments created since the listing, sync the store;
4. drop the retired key from the header (put_if_match, re-read on a race
   with a keyslot change), then forget it.
After a crash the header still holds the retired key: the next writer starts
again from 1, and skips what was done (already at the new epoch) by reading
each object's envelope.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import trio

from sealfs.crypto.envelope import (
    HEADER_SIZE,
    ObjectKind,
    chunk_binding,
    generation_binding,
    read_envelope_epoch,
    reseal,
)
from sealfs.crypto.ids import CHUNK_ID_SIZE
from sealfs.crypto.keyring import KeyRing
from sealfs.errors import (
    FencedError,
    FormatError,
    IntegrityError,
    ObjectNotFoundError,
    PreconditionFailedError,
    SealfsError,
    WriterStoppedError,
)
from sealfs.keys.header import decode_header
from sealfs.keys.rekey import end_rekey
from sealfs.meta.codec import (
    MAX_SEALED_METADATA,
    SEGMENT_PREFIX,
    SNAPSHOT_PREFIX,
    parse_generation,
)
from sealfs.store.base import ObjectStore
from sealfs.store.cache import drop_cached_unless, get_stored
from sealfs.volume.chunks import CHUNK_PREFIX, MAX_SEALED_CHUNK
from sealfs.volume.committer import Committer
from sealfs.volume.header_io import read_header_version, write_header
from sealfs.volume.loader import Loaded
from sealfs.wording import counted

log = logging.getLogger("sealfs.volume")
T = TypeVar("T")
# Marks the log lines that say what progress.error and failure say too: a daemon's
# log is where those are read, but a command that shows the progress and reports
# the failure itself leaves them out (LogRecord attribute, set through extra=).
PROGRESS_NEWS = {"rekey_progress_news": True}

WORKERS = 8  # objects re-sealed at once (the volume's I/O limiter bounds threads too)
IN_FLIGHT_POLL = 0.02  # seconds between checks for old-epoch seals still running
RETRY_DELAY = 5.0  # after a failed pass (an unreachable store): the daemon tries again
HEADER_ATTEMPTS = 10


@dataclass
class RekeyProgress:
    """What `sealfs status` and the rekey command's progress bar show."""

    from_epoch: int
    to_epoch: int
    listed: int = 0  # objects found in the store so far
    checked: int = 0  # of those, looked at
    resealed: int = 0  # of those, re-sealed now (the rest were done already)
    resealed_bytes: int = 0
    started: float = field(default_factory=time.monotonic)
    finished: bool = False
    error: str | None = None
    # The rekeyer gave up (a damaged object, a fenced or stopped writer): it does not
    # retry by itself; `sealfs rekey` (after a repair) or the next mount resumes it.
    stopped: bool = False

    elapsed: float | None = None  # set when read back from a status dict

    def seconds(self) -> float:
        return self.elapsed if self.elapsed is not None else time.monotonic() - self.started

    def as_dict(self) -> dict[str, object]:
        return {
            "from_epoch": self.from_epoch,
            "to_epoch": self.to_epoch,
            "listed": self.listed,
            "checked": self.checked,
            "resealed": self.resealed,
            "resealed_bytes": self.resealed_bytes,
            "seconds": round(self.seconds(), 3),
            "finished": self.finished,
            "error": self.error,
            "stopped": self.stopped,
        }

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> RekeyProgress:
        fields = {k: raw[k] for k in ("from_epoch", "to_epoch", "listed", "checked", "resealed",
                                      "resealed_bytes", "finished", "error")}  # fmt: skip
        return cls(**fields, stopped=bool(raw.get("stopped")), elapsed=float(raw["seconds"]))


class Rekeyer:
    """Finishes the rekey the volume's KeyRing is in the middle of."""

    def __init__(
        self,
        loaded: Loaded,
        commits: Committer,
        limiter: trio.CapacityLimiter,
        in_use: Callable[[bytes], bool],
    ) -> None:
        """in_use: whether a file (one deleted but still open included) has bytes in a
        chunk id; called on the event loop."""
        old = loaded.keys.retired_epoch
        if old is None:
            raise ValueError("no rekey in progress")
        self._loaded = loaded
        self._store: ObjectStore = loaded.store
        self._ring: KeyRing = loaded.keys
        self._old = old
        self._commits = commits
        self._limiter = limiter
        self._in_use = in_use
        self.progress = RekeyProgress(old, loaded.keys.epoch)
        self.done = trio.Event()  # finished: the retired key is gone
        self.ended = trio.Event()  # finished or stopped (see failure)
        self.failure: SealfsError | None = None  # why it stopped

    async def run(self) -> None:
        """Until done or stopped.

        A failed pass that may succeed later (the store unreachable) is logged
        and tried again. One that cannot (an object that fails authentication
        or names a foreign epoch, a header that is not this rekey's, a fenced or
        stopped writer) stops the rekey: retrying would only read the store
        again and again. The retired key stays in the header, so nothing is
        lost; `sealfs rekey` or the next mount resumes.
        """
        try:
            await self._run()
        finally:
            self.ended.set()

    def _stop(self, exc: SealfsError, message: str) -> None:
        self.failure = exc
        self.progress.error = message
        self.progress.stopped = True

    async def _run(self) -> None:
        log.info(
            "rekey: re-sealing key epoch %d objects under epoch %d", self._old, self._ring.epoch
        )
        while True:
            try:
                await self._pass()
            except FencedError as exc:
                self._stop(exc, "fenced: another writer took the volume over and carries on")
                return  # the new writer resumes the rekey; a fenced one must not write
            except WriterStoppedError as exc:
                self._stop(exc, str(exc))
                return  # the next mount resumes it; a stopped writer must not write
            except (IntegrityError, FormatError) as exc:
                self._stop(exc, str(exc))
                log.error(
                    "rekey stopped: %s; the old key stays until every object is re-sealed:"
                    " repair or restore the object, then run 'sealfs rekey' again",
                    exc,
                    extra=PROGRESS_NEWS,
                )
                return
            except SealfsError as exc:
                self.progress.error = str(exc)
                log.error(
                    "rekey paused, will retry in %.0f s: %s", RETRY_DELAY, exc, extra=PROGRESS_NEWS
                )
                await trio.sleep(RETRY_DELAY)
                continue
            break
        self.progress.error = None
        self.progress.finished = True
        self.done.set()
        p = self.progress
        log.info(
            "rekey to key epoch %d done: %s re-sealed (%d bytes), %d already were",
            p.to_epoch, counted(p.resealed, "object"), p.resealed_bytes, p.checked - p.resealed,
        )  # fmt: skip

    async def _pass(self) -> None:
        while self._ring.in_use(self._old):  # noqa: ASYNC110 - counted in worker threads
            await trio.sleep(IN_FLIGHT_POLL)
        self.progress.listed = self.progress.checked = 0
        names: list[str] = []
        for prefix in (CHUNK_PREFIX, SNAPSHOT_PREFIX, SEGMENT_PREFIX):
            names += await self._thread(self._store.list, prefix)
            self.progress.listed = len(names)
        await self._reseal_all(names)
        # A commit re-publishes a segment whose create may have landed unanswered:
        # those bytes were sealed before the switch. Check what came after the listing.
        await self._commits.sync()
        last = max((n for n in names if n.startswith(SEGMENT_PREFIX)), default="")
        later = await self._thread(lambda: self._store.list(SEGMENT_PREFIX, start_after=last))
        self.progress.listed += len(later)
        await self._reseal_all(later)
        await self._thread(self._store.sync)
        await self._thread(self._drop_retired_key)
        self._ring.drop_retired()

    async def _reseal_all(self, names: list[str]) -> None:
        queue = iter(names)
        failure: list[SealfsError] = []

        async def worker() -> None:
            for name in queue:
                try:
                    if self._commits.stopped is not None:
                        raise self._commits.stopped
                    size = await self._thread(self._reseal, name)
                except SealfsError as exc:
                    failure.append(exc)  # the other workers stop at their next object
                if failure:
                    return
                self.progress.checked += 1
                if size:
                    self.progress.resealed += 1
                    self.progress.resealed_bytes += size

        async with trio.open_nursery() as nursery:
            for _ in range(WORKERS):
                nursery.start_soon(worker)
        if failure:
            raise failure[0]

    async def _thread(self, fn: Callable[..., T], *args: object) -> T:
        return await trio.to_thread.run_sync(fn, *args, limiter=self._limiter)

    def _reseal(self, name: str) -> int:
        """Worker thread: re-seal one object if it is of the old epoch; its new size, or 0."""
        bound = MAX_SEALED_CHUNK if name.startswith(CHUNK_PREFIX) else MAX_SEALED_METADATA
        try:
            # The store's copy, never a cached one: a cache that holds this object
            # re-sealed (a store restored from a backup taken mid-rekey, or a copy of
            # it sharing the cache) made it look done, and the old key was dropped
            # with the store's copy still sealed under it.
            size = self._reseal_checked(name, get_stored(self._store, name, bound))
        except ObjectNotFoundError:
            return 0  # gone meanwhile (a snapshot the writer superseded twice)
        except (IntegrityError, FormatError) as exc:
            # Refused as it was read (too large) or as it was opened, alike.
            if not self._unused(name):
                raise
            # A chunk no commit ever named (what a crash, a power cut before the chunks'
            # sync, leaves cut short), or one whose files are all gone (nothing is
            # collected yet). Asked of the files and of the chunk table's bases, not of
            # the table alone: a difference kept from a crashed writer names a base
            # that has no row of its own. No file reads it, so it must not keep every
            # later rekey from finishing, and with it the retired key in force: a store
            # could keep a compromised key valid by damaging one such object. Left as
            # it is, under the retired epoch, it stays unreadable once that key is
            # dropped; one a file uses may be damaged only in transit, so that one
            # stops the rekey.
            log.warning("rekey: %s left as it is, not re-sealed (no file uses it): %s", name, exc)
            return 0
        if not size:
            # Re-sealed in the store already (by another process, with another cache or
            # none): a copy cached here before the rekey would keep the old key's
            # ciphertext after the key is dropped.
            drop_cached_unless(self._store, name, self._sealed_now, HEADER_SIZE)
        return size

    def _sealed_now(self, head: bytes) -> bool:
        """Whether a sealed object's first bytes name the current epoch."""
        return read_envelope_epoch(head) == self._ring.epoch

    def _unused(self, name: str) -> bool:
        """Worker thread: whether name is a chunk no file uses now (asked of the event
        loop, where the files change)."""
        chunk_id = _chunk_id(name)
        return chunk_id is not None and not trio.from_thread.run_sync(self._in_use, chunk_id)

    def _reseal_checked(self, name: str, data: bytes) -> int:
        try:
            epoch = read_envelope_epoch(data)
        except FormatError as exc:
            raise FormatError(f"{name} is not a sealed object: {exc}") from None
        if epoch == self._ring.epoch:
            return 0
        if epoch != self._old:
            raise IntegrityError(
                f"{name} is sealed under key epoch {epoch}, neither {self._old} nor"
                f" {self._ring.epoch}: the store holds an object this volume did not write"
            )
        kind, binding = self._identity(name)
        old, new = self._ring.keys(self._old), self._ring.current
        if kind is ObjectKind.CHUNK:
            old_key, new_key = old.chunk_key, new.chunk_key
        else:
            old_key, new_key = old.meta_key, new.meta_key
        try:
            sealed = reseal(old_key, new_key, self._ring.epoch, kind, binding, data)
        except (IntegrityError, FormatError) as exc:
            raise type(exc)(f"{name} failed authentication, not re-sealed: {exc}") from None
        self._store.put(name, sealed)
        if kind is ObjectKind.SNAPSHOT:
            trio.from_thread.run_sync(self._commits.resealed, parse_generation(name), sealed)
        return len(sealed)

    def _identity(self, name: str) -> tuple[ObjectKind, bytes]:
        vid = self._loaded.volume_id
        if name.startswith(CHUNK_PREFIX):
            chunk_id = _chunk_id(name)
            if chunk_id is None:
                raise FormatError(
                    f"unexpected object name {name!r} in the store (not a chunk's): move it"
                    " out of the store"
                )
            return ObjectKind.CHUNK, chunk_binding(vid, chunk_id)
        kind = ObjectKind.SNAPSHOT if name.startswith(SNAPSHOT_PREFIX) else ObjectKind.SEGMENT
        return kind, generation_binding(vid, parse_generation(name))

    def _drop_retired_key(self) -> None:
        """Worker thread: the header without the retired key, replaced atomically."""
        for _ in range(HEADER_ATTEMPTS):
            old = read_header_version(self._store)
            new = end_rekey(old.data, self._ring.current, self._ring.epoch)
            if new is None:
                return
            try:
                write_header(self._store, old, new)
            except PreconditionFailedError:
                time.sleep(0.1)  # a keyslot change landed first: re-read, edit again
                continue
            self._loaded.header = decode_header(new)
            return
        raise PreconditionFailedError("the volume header keeps changing: the rekey will retry")


def _chunk_id(name: str) -> bytes | None:
    """The id a chunk's store name spells (c/<ab>/<64 hex digits>), or None if name is
    not one."""
    if not name.startswith(CHUNK_PREFIX):
        return None
    try:
        chunk_id = bytes.fromhex(name.rpartition("/")[2])
    except ValueError:
        return None
    return chunk_id if len(chunk_id) == CHUNK_ID_SIZE else None
