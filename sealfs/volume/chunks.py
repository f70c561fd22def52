"""Chunks as the engine sees them: seal and upload new ones, fetch and open old ones.

Sealing (BLAKE3 id, zstd, AES-GCM) and store I/O run in worker threads, bounded
by one CapacityLimiter, so the FUSE loop never blocks on them. Reads go
through a decrypted-chunk LRU, and concurrent reads of one chunk (as a base
too) share a single fetch.

A new chunk that shares pieces of its ends with a chunk already stored (two of its
similarity features, sealfs.chunking.similarity) is stored as a difference from it where
the difference is small: a checkpoint rewritten with scattered edits changes
every chunk a little, and whole chunks cost what the file costs compressed at
every version. A difference is taken from a whole chunk only, so a read needs
at most one other chunk.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Container
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol, TypeVar

import trio

from sealfs.chunking.compress import compress_delta, decompress, decompress_delta, maybe_compress
from sealfs.chunking.fastcdc import MAX_CHUNK
from sealfs.chunking.similarity import similarity_features
from sealfs.crypto.envelope import (
    ENVELOPE_OVERHEAD,
    FLAG_DELTA,
    FLAG_ZSTD,
    ObjectKind,
    chunk_binding,
    open_object,
    seal_object,
)
from sealfs.crypto.ids import CHUNK_ID_SIZE
from sealfs.crypto.ids import chunk_id as keyed_chunk_id
from sealfs.crypto.keyring import KeyRing
from sealfs.errors import (
    FormatError,
    IntegrityError,
    NewerEpochError,
    ObjectExistsError,
    ObjectNotFoundError,
    SealfsError,
    StoreUnavailableError,
)
from sealfs.keys.header import HEADER_NAME, MAX_HEADER_SIZE, decode_header
from sealfs.meta.model import ChunkInfo
from sealfs.store.base import ObjectStore
from sealfs.store.cache import get_opened, get_stored

log = logging.getLogger("sealfs.volume")

CHUNK_PREFIX = "c/"
# Workers that neither prefetches nor uploads take, so that commits and demand reads
# find one (the engine adds them to io_threads: each side keeps io_threads in flight).
RESERVED_WORKERS = 2
# A chunk whose fetch gave up on the store fails a fetch begun this soon after at once
# (see Chunks.read): the kernel's retry and the fetch's waiters come within milliseconds,
# and a store back by then is asked again a second later.
GAVE_UP_FRESH = 1.0
# A sealed chunk holds at most MAX_CHUNK payload bytes (zstd only where it saves),
# so a larger object under a chunk's name is refused before it is read into memory.
MAX_SEALED_CHUNK = MAX_CHUNK + ENVELOPE_OVERHEAD
SMALL_BATCH = 256  # small pieces sealed per worker-thread call (store_many)
# A difference from a base is kept outright if it is at most this share of the chunk's
# plaintext (about a fifth of what zstd makes of JSON alone). A larger one is kept only
# if it is at most half of the chunk compressed alone, which a difference that large
# pays for (the chunk is compressed alone then anyway, in case it is stored whole): a
# chunk whose cuts moved takes in bytes its base lacks, and a 1.3 MiB chunk whose
# difference was 7.7 % of it cost 440 KB stored whole instead of 102 KB.
MAX_DELTA_SHARE = 1 / 16


def chunk_name(chunk_id: bytes) -> str:
    """Store name of a chunk: c/<first two hex digits>/<64 hex digits>."""
    hexid = chunk_id.hex()
    return f"{CHUNK_PREFIX}{hexid[:2]}/{hexid}"


@dataclass(frozen=True, slots=True)
class StoredChunk:
    """A chunk that is now in the store (uploaded now, or found already known)."""

    chunk_id: bytes
    plain_size: int
    stored_size: int
    uploaded: bool
    features: bytes = b""
    base: bytes = b""

    def info(self) -> ChunkInfo:
        """Its row of the chunk table."""
        return ChunkInfo(self.plain_size, self.stored_size, self.features, self.base)


@dataclass(frozen=True, slots=True)
class _Delta:
    """An opened chunk stored as a difference: its base's id and its zstd frame."""

    base: bytes
    frame: bytes


# What one entry costs beyond its payload: the id, the bytes object and the
# OrderedDict node (about 200 bytes, measured with tracemalloc). Counting payload
# alone let a cache of tiny chunks (small files read one after another) hold
# several times its bound: 100,000 files of 10 bytes took 21 MB for 1 MB counted.
ENTRY_OVERHEAD = 200


class PlainCache:
    """LRU of opened chunk plaintexts, bounded in bytes (payload plus per-entry overhead)."""

    def __init__(self, max_bytes: int) -> None:
        self._max = max_bytes
        self._items: OrderedDict[bytes, bytes] = OrderedDict()
        self.nbytes = 0

    def __contains__(self, chunk_id: bytes) -> bool:
        return chunk_id in self._items

    def peek(self, chunk_id: bytes) -> bytes | None:
        """The plaintext if cached, without counting a use: one dictionary lookup, so a
        worker thread may call it while the event loop changes the cache."""
        return self._items.get(chunk_id)

    def get(self, chunk_id: bytes) -> bytes | None:
        data = self._items.get(chunk_id)
        if data is not None:
            self._items.move_to_end(chunk_id)
        return data

    def put(self, chunk_id: bytes, data: bytes) -> None:
        if chunk_id in self._items or len(data) + ENTRY_OVERHEAD > self._max:
            return
        self._items[chunk_id] = data
        self.nbytes += len(data) + ENTRY_OVERHEAD
        while self.nbytes > self._max:
            _, old = self._items.popitem(last=False)
            self.nbytes -= len(old) + ENTRY_OVERHEAD

    def discard(self, chunk_id: bytes) -> None:
        """Forget a chunk that is not likely to be read again (its memory matters more)."""
        data = self._items.pop(chunk_id, None)
        if data is not None:
            self.nbytes -= len(data) + ENTRY_OVERHEAD


P = TypeVar("P")
R = TypeVar("R")
# Told when an upload gave up on the store (see Chunks._upload).
OnUnavailable = Callable[[StoreUnavailableError], None]


def small_batch_size(count: int, workers: int) -> int:
    """Small pieces per store_many call when count of them are sealed (small files of a
    commit, or small regions of one file's flush).

    A worker seals and uploads its batch one file after another, so a batch
    costs a store round trip per file. 300 small files made two batches, one
    worker sent 256 PUTs in a row while six others stood idle, and the fsync
    waited 15.6 s behind 25 ms of latency each way. Spread over the workers
    (at most SMALL_BATCH each, still one thread hop per batch on a local store)
    the same commit sends eight PUTs at a time. The caller leaves out the
    workers kept for demand reads (RESERVED_WORKERS), as prefetches do.
    """
    return max(1, min(SMALL_BATCH, -(-count // max(1, workers))))


class ChunkTable(Protocol):
    """What the chunk side asks of the chunk table (MetaState), from worker threads."""

    def similar_roots(self, features: bytes) -> list[bytes]:
        """The whole chunks a new chunk with these features may be a difference from."""
        ...

    def is_base(self, chunk_id: bytes) -> bool:
        """Whether a row names chunk_id as its base."""
        ...

    def base_of(self, chunk_id: bytes) -> bytes:
        """The base chunk_id's row names (b"" if it is whole or has no row)."""
        ...


class Chunks:
    """The chunk side of the data path for one unlocked volume."""

    def __init__(
        self,
        store: ObjectStore,
        volume_id: bytes,
        keys: KeyRing,
        limiter: trio.CapacityLimiter,
        table: ChunkTable,
        cache_bytes: int = 64 << 20,
    ) -> None:
        self._store = store
        self._table = table
        self._volume_id = volume_id
        self._keys = keys
        self._limiter = limiter
        # For threads that hold a token of limiter already: not trio's default limiter,
        # which the flushes' CDC passes fill when a commit carries many files.
        self._unbounded = trio.CapacityLimiter(math.inf)
        self.cache = PlainCache(cache_bytes)
        self._inflight: dict[bytes, trio.Event] = {}
        # Prefetches leave RESERVED_WORKERS of the workers to other work (see prefetch),
        # and the chunks waiting for one of their slots count as on their way.
        slots = max(1, int(limiter.total_tokens) - RESERVED_WORKERS)
        self._prefetch_slots = trio.CapacityLimiter(slots)
        # Sealing and uploading leave them too (see store): a commit of a tree copy
        # started a batch of small files per SMALL_BATCH of them, more than there are
        # workers, and a read of another file queued behind every batch.
        self._store_slots = trio.CapacityLimiter(slots)
        self.store_workers = slots
        self._prefetch_queued: set[bytes] = set()
        # Chunks a read found missing or damaged in the store: new data with the same
        # content is uploaded again instead of deduplicated against them, so that
        # writing a damaged file's bytes again (from a good source) repairs it.
        self._unusable: set[bytes] = set()
        # Chunks whose fetch gave up on the store just now: (when, why), by trio's clock.
        self._gave_up: dict[bytes, tuple[float, StoreUnavailableError]] = {}
        # Chunks being fetched by a worker thread, which others needing one wait for.
        self._fetches: dict[bytes, Future[bytes | _Delta]] = {}
        self._fetches_lock = threading.Lock()
        self.uploaded_bytes = 0

    def _seal_and_put(self, plaintext: bytes | memoryview, known: Container[bytes]) -> StoredChunk:
        """Worker-thread body: id, dedup check, compress, seal, upload.

        Ids are keyed per epoch too, so after a rekey new data never shares a
        chunk with data of the old epoch (its ids were made with the old key).
        """
        with self._keys.sealing() as (epoch, keys):
            cid = keyed_chunk_id(keys.chunk_id_blake3_key, plaintext)
            replace = cid in self._unusable
            # A difference whose base a read found damaged is as unreadable: deduplicated,
            # a restored file used it again (each version of a region is a difference
            # from the same base). Its copy was never read here, so it is put
            # create-only, and replaced only if found still a difference (whole, or
            # re-sealed by a writer that took over, it stands).
            base_damaged = self._table.base_of(cid) in self._unusable
            if cid in known and not (replace or base_damaged):
                return StoredChunk(cid, len(plaintext), 0, uploaded=False)
            features = similarity_features(keys.chunk_id_key, plaintext)
            whole = replace or base_damaged or self._table.is_base(cid)
            if whole:
                # Written again over a damaged copy, it may be the base of differences
                # stored meanwhile, which it repairs; a base with no row (named by a
                # difference kept from another writer) may be missing. A base is
                # always whole.
                base, (payload, flags) = b"", _whole(plaintext)
            else:
                base, payload, flags = self._payload(cid, plaintext, features)
            binding = chunk_binding(self._volume_id, cid)

            def sealed_as(payload: bytes | memoryview, flags: int) -> bytes:
                return seal_object(
                    keys.chunk_key, ObjectKind.CHUNK, binding, payload, flags=flags, epoch=epoch
                )

            base, stored_size = self._put_new(
                cid, sealed_as(payload, flags), base, known,
                lambda: sealed_as(*_whole(plaintext)), replace=replace, whole=whole,
            )  # fmt: skip
        self._unusable.discard(cid)
        # Recorded in the chunk table even where _put_new kept the store's copy: the
        # table lacks it (it was not in known).
        return StoredChunk(cid, len(plaintext), stored_size, True, features, base)

    def _payload(
        self, cid: bytes, plaintext: bytes | memoryview, features: bytes
    ) -> tuple[bytes, bytes | memoryview, int]:
        """Worker thread: (base id or b"", payload, flags) for a new chunk: a difference
        from a similar chunk where one pays (MAX_DELTA_SHARE), else the chunk whole.

        Each feature names the chunk stored last with it, and they may disagree:
        a file that begins like one and ends like another. The second is tried
        only if the first gives no difference worth keeping. A base that cannot
        be read is passed over (an unreachable store fails the chunk instead: its
        put would wait out the store timeout again), and one found damaged is not
        offered again (_unusable).
        """
        alone: tuple[bytes | memoryview, int] | None = None
        for root in self._table.similar_roots(features) if features else []:
            if root == cid or root in self._unusable:
                continue
            base = self.cache.peek(root)
            if base is None:
                try:
                    base = self._get_base(root)
                except StoreUnavailableError:
                    raise  # the put would wait out the store timeout as well
                except SealfsError as exc:
                    log.info("chunk %s not used as a base: %s", chunk_name(root), exc)
                    continue
            frame = compress_delta(plaintext, base)
            size = CHUNK_ID_SIZE + len(frame)
            if size > len(plaintext) * MAX_DELTA_SHARE:
                alone = alone or _whole(plaintext)
                if size > len(alone[0]) / 2:
                    continue
            return root, root + frame, FLAG_DELTA
        return b"", *(alone or _whole(plaintext))

    def _put_new(
        self,
        cid: bytes,
        sealed: bytes,
        base: bytes,
        known: Container[bytes],
        sealed_whole: Callable[[], bytes],
        *,
        replace: bool,
        whole: bool,
    ) -> tuple[bytes, int]:
        """Put a chunk, keeping one already under its name unless it is known damaged.
        Returns the base of the copy the store holds now (sealed's is base) and its
        size: a copy kept may be a difference where sealed is whole, or the other way
        round. A copy replaced is replaced whole (sealed_whole), as a damaged
        chunk written again is: differences found later may name it as their base.
        whole: the chunk must be stored whole, and a difference found is unfit.

        The name says what the chunk holds, so an object found there is this chunk
        sealed by another: a commit that crashed before its segment, or the writer
        that took the volume over, which a rekey may have re-sealed under a key this
        writer lacks (replacing that made the chunk unreadable once the old key was
        retired). A found copy is kept only if it opens, or is sealed under a newer key
        epoch that the volume's header names: a crash before the store's sync can leave
        a new file empty, cut short or, at its full size, holding zeros or stale blocks
        (ext4 data=writeback), and a commit kept such a copy for the data it
        committed, which then read EIO.
        """
        name = chunk_name(cid)
        try:
            self._store.put(name, sealed, replace=replace)
        except ObjectExistsError:
            why, kept_base, kept_size = self._unfit(cid, name, known, whole=whole)
            if why is None:
                return kept_base, kept_size
            log.info("chunk %s in the store %s: replaced", name, why)
            if base:
                sealed, base = sealed_whole(), b""
            self._store.put(name, sealed)
        return base, len(sealed)

    def _unfit(
        self, cid: bytes, name: str, known: Container[bytes], *, whole: bool
    ) -> tuple[str | None, bytes, int]:
        """Why the store's own copy of chunk name cannot stand for this writer's (or None),
        that copy's base (b"" if it is whole, or could not be opened) and its size."""
        why, found, opened = self._open_found(cid, name)
        if why is None and isinstance(opened, _Delta):
            why = (
                "is a difference, where this chunk must be whole"
                if whole
                else self._unfit_difference(opened, known)
            )
            if why is None:
                return None, opened.base, len(found)
        return why, b"", len(found)

    def _unfit_difference(self, delta: _Delta, known: Container[bytes]) -> str | None:
        """Why a copy found stored as a difference cannot stand (or None).

        It is kept only if its base, as the store holds it, is whole and the
        difference decodes against it: a plaintext in the cache says neither. A base
        that no known chunk is was put by a writer that may have died before its
        sync, so it is put again, create-only: that makes this writer's next sync
        flush it (sealfs.store.local). Replacing the copy instead is no answer: it
        may be the committed chunk of a writer that took the volume over, whose base
        this writer never saw.
        """
        base_name = chunk_name(delta.base)
        why, found_base, base = self._open_found(delta.base, base_name)
        if why is not None:
            return f"names as its base {base_name}, which {why}"
        if isinstance(base, _Delta):
            return f"names as its base {base_name}, itself a difference"
        if base is not None:  # else another writer's rekey re-sealed it: kept as it is
            try:
                decompress_delta(delta.frame, base, MAX_CHUNK)
            except FormatError as exc:
                return f"does not decode against its base {base_name} ({exc})"
            if delta.base not in known:
                with contextlib.suppress(ObjectExistsError):
                    self._store.put(base_name, found_base, replace=False)
        return None

    def _open_found(self, cid: bytes, name: str) -> tuple[str | None, bytes, bytes | _Delta | None]:
        """(why it is unfit or None, its sealed bytes, what it opens to) for the store's
        own copy of chunk name. Opened is None where why is None for a copy sealed
        under a newer key epoch that the volume's header names: the new writer's rekey
        re-sealed it, never this writer's to undo."""
        try:
            found = get_stored(self._store, name, MAX_SEALED_CHUNK)
        except ObjectNotFoundError:
            return "is gone", b"", None
        except FormatError as exc:  # larger than any chunk, or not a regular file
            return f"is malformed ({exc})", b"", None
        try:
            return None, found, self._open(cid, found)
        except NewerEpochError as exc:
            if self._rekeyed_to(exc.epoch):
                return None, found, None
            return f"names key epoch {exc.epoch}, which the volume's header does not", found, None
        except (IntegrityError, FormatError) as exc:
            return f"does not open ({exc})", found, None

    def _rekeyed_to(self, epoch: int) -> bool:
        """Whether the volume's header (as the store holds it now) names key epoch epoch
        or a later one: an object sealed under it is another writer's rekey, not damage.

        A header that cannot be parsed says nothing either way: taken as a rekey, so that
        a writer taken over never replaces what the new writer made.
        """
        try:
            data = self._store.get(HEADER_NAME, MAX_HEADER_SIZE)
            return decode_header(data).data_epoch >= epoch
        except (FormatError, ObjectNotFoundError):
            return True

    async def store(
        self,
        plaintext: bytes | memoryview,
        known: Container[bytes],
        on_unavailable: OnUnavailable,
    ) -> StoredChunk:
        """Make sure a chunk with this content is in the store (skipping known ids).

        on_unavailable: see _upload.
        """
        result = await self._upload(self._seal_and_put, plaintext, known, on_unavailable)
        self.uploaded_bytes += result.stored_size
        return result

    async def _upload(
        self,
        work: Callable[[P, Container[bytes]], R],
        pieces: P,
        known: Container[bytes],
        on_unavailable: OnUnavailable,
    ) -> R:
        """Run a sealing and uploading job in a worker thread.

        on_unavailable gets the error when the job gave up on the store, before its worker
        goes to the next job waiting for one: a caller that then cancels its other
        jobs stops them before any begins a request of its own. (Uploads sent
        together to a stalled service give up together: with the worker handed
        on as its thread ended, the next job began, and waited the whole store
        timeout again.)

        Jobs never take the last RESERVED_WORKERS workers, as prefetches do not: a
        demand read (or a commit's own step) finds one at once however many chunks
        or batches of small files a commit has to store, unless prefetches hold the
        rest (each side may take io_threads, so that neither waits for the other).
        Behind 30 ms per request, a 4 KiB read waited 16-31 s during `cp -a` of
        24,000 files.
        """
        async with self._store_slots, self._limiter:
            try:
                return await trio.to_thread.run_sync(work, pieces, known, limiter=self._unbounded)
            except StoreUnavailableError as exc:
                on_unavailable(exc)
                raise

    def _open(self, chunk_id: bytes, sealed: bytes) -> bytes | _Delta:
        """The plaintext of a sealed chunk, or what a difference names (authenticated)."""
        binding = chunk_binding(self._volume_id, chunk_id)
        epoch, keys = self._keys.keys_for(sealed)
        flags, body = open_object(keys.chunk_key, ObjectKind.CHUNK, binding, sealed, epoch=epoch)
        if flags & FLAG_DELTA:
            if len(body) <= CHUNK_ID_SIZE:
                raise FormatError("a difference too short to name its base")
            return _Delta(body[:CHUNK_ID_SIZE], body[CHUNK_ID_SIZE:])
        return decompress(body, MAX_CHUNK) if flags & FLAG_ZSTD else body

    def _seal_and_put_many(self, pieces: list[bytes], known: Container[bytes]) -> list[StoredChunk]:
        """Worker-thread body for many small chunks: one thread hop for all of them."""
        out: list[StoredChunk] = []
        seen: set[bytes] = set()
        for piece in pieces:
            stored = self._seal_and_put(piece, AnyOf(known, seen))
            seen.add(stored.chunk_id)
            out.append(stored)
        return out

    async def store_many(
        self,
        pieces: list[bytes],
        known: Container[bytes],
        on_unavailable: OnUnavailable,
    ) -> list[StoredChunk]:
        """store() for many small pieces at once (thread hops dominate for small files)."""
        results = await self._upload(self._seal_and_put_many, pieces, known, on_unavailable)
        self.uploaded_bytes += sum(r.stored_size for r in results)
        return results

    def _get_and_open(self, chunk_id: bytes) -> tuple[bytes, tuple[bytes, bytes] | None]:
        """Worker thread: the plaintext of a chunk, read with its base if it is stored as
        a difference, and (base id, base plaintext) if the base was fetched for it.

        The caller caches the base too. The versions of a region are differences from
        the same whole chunk until one no longer pays: an agent that reads its last
        checkpoint and writes the next compresses against the bases that read fetched
        (else one GET each on S3), and reading two versions fetched each base twice.
        A chunk whose base is missing or damaged cannot be read either, and is marked
        so (_unusable): writing its bytes again stores them whole. A copy of the
        difference in a disk cache is dropped and the store asked again first: the
        store may hold the chunk whole by now, repaired by another mount, while the
        cached difference still opens.
        """
        discard: Callable[[str], None] | None = getattr(self._store, "discard", None)
        while True:
            opened = self._get_shared(chunk_id)
            if not isinstance(opened, _Delta):
                return opened, None
            try:
                cached = self.cache.peek(opened.base)
                base = cached or self._get_base(opened.base)
                fetched = None if cached else (opened.base, base)
                return decompress_delta(opened.frame, base, MAX_CHUNK), fetched
            except (ObjectNotFoundError, IntegrityError, FormatError) as exc:
                if discard is not None:
                    discard(chunk_name(chunk_id))
                    discard = None  # once: the store's own copy is the last word
                    continue
                if opened.base in self._unusable or isinstance(exc, FormatError):
                    self._unusable.add(chunk_id)
                name = chunk_name(chunk_id)
                raise type(exc)(f"chunk {name}, stored as a difference: {exc}") from None

    def _get_base(self, chunk_id: bytes) -> bytes:
        """Worker thread: the plaintext of a chunk another is a difference from, which
        must be stored whole (a base is never itself a difference)."""
        opened = self._get_shared(chunk_id)
        if isinstance(opened, _Delta):
            raise FormatError(f"chunk {chunk_name(chunk_id)} is itself stored as a difference")
        return opened

    def _get_shared(self, chunk_id: bytes) -> bytes | _Delta:
        """Worker thread: _get_opened, with threads that need one chunk at once sharing
        one fetch of it, its failure too. read() shares the fetch of the chunk asked
        for, but bases are fetched inside its threads: two versions of a region read
        side by side are differences from one base, and each fetched it (one GET each
        on S3, of up to MAX_CHUNK), as did the read of the base's own file beside them.
        """
        with self._fetches_lock:
            ongoing = self._fetches.get(chunk_id)
            if ongoing is None:
                fetch = self._fetches[chunk_id] = Future[bytes | _Delta]()
        if ongoing is not None:
            return ongoing.result()  # bounded: the fetching thread's store calls time out
        try:
            opened = self._get_opened(chunk_id)
        except BaseException as exc:
            fetch.set_exception(exc)
            raise
        else:
            fetch.set_result(opened)
            return opened
        finally:
            with self._fetches_lock:
                del self._fetches[chunk_id]

    def _get_opened(self, chunk_id: bytes) -> bytes | _Delta:
        name = chunk_name(chunk_id)
        try:
            return get_opened(
                self._store, name, lambda data: self._open(chunk_id, data), MAX_SEALED_CHUNK
            )
        except ObjectNotFoundError:
            self._unusable.add(chunk_id)
            raise ObjectNotFoundError(f"chunk {name} is missing from the store") from None
        except NewerEpochError as exc:
            if not self._rekeyed_to(exc.epoch):  # damaged where it names its epoch
                self._unusable.add(chunk_id)
                raise IntegrityError(
                    f"chunk {name} failed authentication: {exc}, which the volume's header"
                    " does not name"
                ) from None
            # Not damage: another writer, which took the volume over, rekeyed it. Taken
            # for damaged, the chunk was replaced at the next write of its bytes with a
            # copy under this mount's key, which that writer then dropped.
            raise IntegrityError(
                f"chunk {name} cannot be read: {exc}: the volume was rekeyed by another"
                " writer (this mount was taken over, or must be mounted again)"
            ) from None
        except IntegrityError as exc:
            self._unusable.add(chunk_id)
            raise IntegrityError(f"chunk {name} failed authentication: {exc}") from None
        except FormatError as exc:
            self._unusable.add(chunk_id)
            raise FormatError(f"chunk {name} is malformed: {exc}") from None

    async def read(self, chunk_id: bytes) -> bytes:
        """The plaintext of a chunk. Raises IntegrityError, ObjectNotFoundError, StoreError.

        A fetch that gave up on the store (StoreUnavailableError, after the whole store
        timeout) fails the fetches of the same chunk begun within GAVE_UP_FRESH with it:
        the kernel asks again at once for a page whose read-ahead failed, and a reader
        that waited for another's fetch fetched anew, so a cold read(2) during an outage
        failed after twice --store-timeout (ten minutes by default).
        """
        while True:
            data = self.cache.get(chunk_id)
            if data is not None:
                return data
            pending = self._inflight.get(chunk_id)
            if pending is None:
                break
            await pending.wait()  # then look in the cache again (or fetch, if it failed)
        gave_up = self._gave_up.get(chunk_id)
        if gave_up is not None and trio.current_time() - gave_up[0] < GAVE_UP_FRESH:
            raise StoreUnavailableError(str(gave_up[1]))
        done = self._inflight[chunk_id] = trio.Event()
        try:
            plaintext, fetched = await trio.to_thread.run_sync(
                self._get_and_open, chunk_id, limiter=self._limiter
            )
        except StoreUnavailableError as exc:
            now = trio.current_time()
            self._gave_up = {c: g for c, g in self._gave_up.items() if now - g[0] < GAVE_UP_FRESH}
            self._gave_up[chunk_id] = (now, exc)
            raise
        else:
            if fetched is not None:
                self.cache.put(*fetched)  # the base first: the chunk is the newer use
            self.cache.put(chunk_id, plaintext)
            self._gave_up.pop(chunk_id, None)
            return plaintext
        finally:
            del self._inflight[chunk_id]
            done.set()

    def wanted(self, chunk_id: bytes) -> bool:
        """Whether a prefetch of the chunk would do anything (it is neither cached nor
        being fetched). Looking does not count as a use for the LRU."""
        return (
            chunk_id not in self.cache
            and chunk_id not in self._inflight
            and chunk_id not in self._prefetch_queued
        )

    async def prefetch(self, chunk_id: bytes) -> None:
        """Warm the cache for a likely next read; failures surface on the real read.

        Prefetches never take the last RESERVED_WORKERS workers: on a slow store a
        sequential reader's readahead (12 MiB, a dozen chunks) took every worker and
        queued ahead of everything else, and an unrelated fsync waited behind
        seconds of downloads for each of its steps.
        """
        if not self.wanted(chunk_id):
            return
        self._prefetch_queued.add(chunk_id)
        try:
            async with self._prefetch_slots:
                self._prefetch_queued.discard(chunk_id)
                if self.wanted(chunk_id):
                    await self.read(chunk_id)
        except Exception as exc:
            log.debug("prefetch of %s failed: %s", chunk_name(chunk_id), exc)
        finally:
            self._prefetch_queued.discard(chunk_id)


def _whole(plaintext: bytes | memoryview) -> tuple[bytes | memoryview, int]:
    """(payload, flags) of a chunk stored whole: compressed where that saves."""
    packed = maybe_compress(plaintext)
    return (plaintext, 0) if packed is None else (packed, FLAG_ZSTD)


class AnyOf:
    """Membership in any of several containers (chunk ids known from several sources),
    without merging them into a copy."""

    def __init__(self, *containers: Container[bytes]) -> None:
        self._containers = containers

    def __contains__(self, item: object) -> bool:
        return any(item in c for c in self._containers)
