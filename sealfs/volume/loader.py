"""Creating a volume, and opening one: header, unlock, snapshot, replay, writer claim.

Everything here is synchronous and runs before the FUSE loop (and before a
mount daemonises), so that a wrong passphrase, a tampered object or another
writer is reported on the terminal with a clear line.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import hashlib
import itertools
import logging
import os
import socket
import stat
import time
from collections.abc import Generator, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime

from sealfs.crypto.keyring import KeyRing
from sealfs.crypto.subkeys import derive_subkeys
from sealfs.errors import (
    FormatError,
    IntegrityError,
    NewerEpochError,
    NotAVolumeError,
    ObjectExistsError,
    ObjectNotFoundError,
    RetiredEpochError,
    SealfsError,
    StoreError,
    UnsupportedVersionError,
    VolumeChangedError,
    VolumeExistsError,
    WriterConflictError,
)
from sealfs.keys.header import HEADER_NAME, MAGIC, MAX_HEADER_SIZE, VolumeHeader, decode_header
from sealfs.keys.kdf import Argon2Params
from sealfs.keys.rekey import open_retired
from sealfs.keys.slots import (
    Secret,
    SlotMaker,
    Unlocked,
    create_header,
    new_master_key,
    new_volume_id,
    unlock,
)
from sealfs.meta import ops
from sealfs.meta.codec import (
    MAX_SEALED_METADATA,
    SEGMENT_PREFIX,
    SNAPSHOT_PREFIX,
    LoggedSegment,
    Segment,
    decode_segment,
    decode_snapshot,
    encode_segment,
    parse_generation,
    segment_name,
)
from sealfs.meta.compact import Snapshot
from sealfs.meta.model import ROOT_INO, MetaState, WriterInfo
from sealfs.meta.replay import replay_segment
from sealfs.store.base import PROBE_PREFIX, ObjectStore

log = logging.getLogger("sealfs.volume")

LOAD_WORKERS = 8  # log segments fetched at once while mounting
LOAD_AHEAD = 32  # fetched segments waiting to be replayed, at most
CLAIM_ATTEMPTS = 10  # segment creates a claim tries, catching up between them


@dataclass(eq=False)
class Loaded:
    """An unlocked volume's keys and state as of its newest committed generation."""

    store: ObjectStore
    header: VolumeHeader
    keys: KeyRing = field(repr=False)
    live: MetaState
    base: Snapshot | None  # newest snapshot, for compaction
    tail: list[LoggedSegment]  # segments after it
    writer: WriterInfo | None = None  # ours, once claimed

    @property
    def volume_id(self) -> bytes:
        return self.header.volume_id

    def free_bytes(self) -> int:
        return self.store.free_bytes()


def check_store_is_empty(store: ObjectStore) -> None:
    """Refuse a store that holds a volume or any other object. Raises VolumeExistsError.

    init checks this before it asks for a passphrase, so that a store already in use is
    named at once, not after the passphrase was typed twice and Argon2 ran.
    """
    if _exists(store, HEADER_NAME):
        raise VolumeExistsError(
            f"{store.describe()} already holds a sealfs volume: use it ('sealfs mount'),"
            " or give an empty directory (or an unused S3 prefix) for a new one"
        )
    if held := store.list(""):
        if held == [segment_name(1)]:  # what a kill between init's two writes leaves
            raise VolumeExistsError(
                f"{store.describe()} holds only {held[0]}, left by an init that was cut short"
                f" before its header: if no other init is running on it, delete {held[0]}"
                " and run init again"
            )
        if all(name.startswith(PROBE_PREFIX) for name in held):
            # Init's own check of conditional writes, cut short (Ctrl-C, a kill, a lost
            # connection) before it deleted its object: "not empty" named no way out.
            them = held[0] if len(held) == 1 else f"{held[0]} and {len(held) - 1} more"
            raise VolumeExistsError(
                f"{store.describe()} holds only {them} under {PROBE_PREFIX}, left by an init"
                " cut short while it checked the store: if no other init is running on it,"
                f" delete {PROBE_PREFIX} there and run init again"
            )
        some = "1 object:" if len(held) == 1 else f"{len(held)} objects, such as"
        raise VolumeExistsError(
            f"{store.describe()} is not empty ({some} {held[0]}) and holds no sealfs volume:"
            " give an empty directory or an unused S3 prefix"
        )


def create_volume(
    store: ObjectStore,
    passphrase: bytes | None,
    kdf: Argon2Params | None,
    recovery_key: bytes,
    *,
    extra_slots: Sequence[SlotMaker] = (),
) -> VolumeHeader:
    """Write a new, empty volume into an empty store. Raises VolumeExistsError.

    Keyslots: passphrase (unless None), recovery, then extra_slots (KMS,
    PKCS#11); a slot that cannot be made fails before anything is written.
    The root directory's segment goes first and the header last, so a crash
    half-way leaves no header, and the store is not mistaken for a volume.
    """
    check_store_is_empty(store)  # again: another init may have filled it since
    master_key, volume_id = new_master_key(), new_volume_id()
    header_bytes = create_header(master_key, volume_id, passphrase, kdf, recovery_key, extra_slots)
    subkeys = derive_subkeys(master_key, volume_id)
    now = time.time_ns()
    root = ops.new_inode_record(
        ino=ROOT_INO, mode=stat.S_IFDIR | 0o755, uid=os.getuid(), gid=os.getgid(), nlink=2,
        size=0, atime_ns=now, mtime_ns=now, ctime_ns=now, rdev=0, parent=ROOT_INO, target=b"",
    )  # fmt: skip
    first = Segment(1, bytes(32), now, [root])
    store.put_if_absent(segment_name(1), encode_segment((0, subkeys), volume_id, first)[0])
    try:
        store.sync()
        store.put_if_absent(HEADER_NAME, header_bytes)
    except StoreError:
        _take_back_first_segment(store)
        raise
    store.sync()
    return decode_header(header_bytes)


def _take_back_first_segment(store: ObjectStore) -> None:
    """After a failed init, remove the root's segment unless a header made it a volume.

    Left alone, it made the store "not empty" to the init that the error asks for
    ("free space and retry"), which then refused it. A header that is there (its
    put landed though its reply was lost, or another init's) needs the segment: it
    stays, and so it does when the store cannot even say.
    """
    with contextlib.suppress(StoreError):
        if not _exists(store, HEADER_NAME):
            store.delete(segment_name(1))
            store.sync()


def read_header(store: ObjectStore) -> bytes:
    """The header bytes. Raises NotAVolumeError if the store holds none, FormatError if
    what it holds does not begin as a sealfs header does."""
    try:
        data = store.get(HEADER_NAME, MAX_HEADER_SIZE)
    except ObjectNotFoundError:
        # Not just "run init": at boot the usual cause is a disk not mounted yet, where
        # init would make a second, empty volume on the directory under it.
        raise NotAVolumeError(
            f"{store.describe()} is not a sealfs volume (no {HEADER_NAME}): check the path"
            " (is the disk or bucket that holds the volume there yet?), or run 'sealfs init'"
            " to create a new volume"
        ) from None
    if not data.startswith(MAGIC):
        # A web server given as the S3 endpoint answers every GET with a page: the
        # header's own check said only "volume header is 34 bytes, too short".
        raise FormatError(
            f"{store.describe()}: {HEADER_NAME} is not a sealfs volume header: check the"
            " store URL (of an S3 store, the endpoint too: --s3-endpoint), or restore"
            f" {HEADER_NAME} from a backup"
        )
    return data


def open_volume(store: ObjectStore, secret: Secret) -> Loaded:
    """Unlock and load the newest committed state. Raises WrongKeyError, IntegrityError,
    FormatError, NotAVolumeError, StoreError."""
    return load_unlocked(store, unlock(read_header(store), secret))


def load_unlocked(store: ObjectStore, unlocked: Unlocked) -> Loaded:
    """Load the newest committed state of a volume whose header is already unlocked."""
    header = unlocked.header
    ring = KeyRing(header.data_epoch, unlocked.subkeys, open_retired(header, unlocked.master_key))
    volume_id = header.volume_id
    with collector_paused():
        base, state = _load_snapshot(store, ring, volume_id)
        tail: list[LoggedSegment] = []
        _replay_log(store, ring, volume_id, state, tail)
    if state.generation == 0:
        # init writes generation 1 (the root directory) before the header, so a header
        # alone is a store that lost its metadata. Loaded, it had no root: the mount
        # "succeeded" on a mountpoint that did not exist, and committed a new log there.
        raise IntegrityError(
            f"{store.describe()} holds a volume header but no metadata (no snapshot in"
            f" {SNAPSHOT_PREFIX}, no log segment in {SEGMENT_PREFIX}), so none of its files can"
            f" be read: restore {SNAPSHOT_PREFIX} and {SEGMENT_PREFIX} from a backup"
        )
    return Loaded(store, header, ring, state, base, tail)


def _replay_log(
    store: ObjectStore, ring: KeyRing, volume_id: bytes, state: MetaState, tail: list[LoggedSegment]
) -> None:
    """Replay onto state every log segment after its generation, appending each to tail.

    Both a mount's load and a claim that lost the generation race (catching up
    with what the writer committed meanwhile) come here.
    """
    previous = b""  # the sealed bytes of the segment before, once one was read
    with contextlib.closing(_segments_after(store, ring, volume_id, state)) as segments:
        for name, sealed, logged in segments:
            _replay_one(state, name, logged, previous)
            tail.append(logged)
            previous = sealed


def fetch_new_segments(
    loaded: Loaded, limit: int, past_a_gap: bool = False
) -> list[tuple[str, LoggedSegment]]:
    """Up to limit segments after the live state's generation, each opened and checked.

    For a read-only mount following the writer: it runs in a worker thread while
    the state stands still, and replay_new_segment applies them on the FUSE loop.
    The segments before one that fails are returned; the next call raises its error.
    past_a_gap: if the next segment is not there, look for later ones too (see
    _past_a_gap); one found is returned alone, and its replay names the gap.
    """
    got: list[tuple[str, LoggedSegment]] = []
    state = loaded.live
    names = _new_segment_names(loaded.store, state.generation + 1, limit)
    if not names and past_a_gap:
        names = _past_a_gap(loaded.store, state.generation + 1, limit)
    if not names:
        return got  # nothing new, as at most looks
    with contextlib.closing(
        _opened_segments(loaded.store, loaded.keys, loaded.volume_id, state, names)
    ) as segments:
        try:
            for name, _, logged in segments:
                got.append((name, logged))
        except SealfsError:
            if not got:
                raise
    return got


def segment_digest(loaded: Loaded, generation: int) -> bytes | None:
    """The SHA-256 of the payload of l/<generation> (at most the loaded generation) as
    the store holds it: what the segment after it chains onto. None if it does not
    open, or is gone.

    For the host's record of what it saw committed (sealfs.cli.seen): a copy of the
    volume written separately holds another segment of that generation, as authentic.
    """
    if generation == loaded.live.generation:
        return loaded.live.head_hash
    for logged in loaded.tail:
        if logged.segment.generation == generation:
            return logged.digest
    try:  # older than the snapshot loaded: the log keeps every segment
        sealed = loaded.store.get(segment_name(generation), MAX_SEALED_METADATA)
        return decode_segment(loaded.keys, loaded.volume_id, generation, sealed).digest
    except (ObjectNotFoundError, IntegrityError, FormatError):
        return None


def replay_new_segment(state: MetaState, name: str, logged: LoggedSegment) -> None:
    """Apply one segment fetch_new_segments returned; IntegrityError naming the fix if
    it does not extend the log this state holds."""
    _replay_one(state, name, logged, b"")


def _new_segment_names(store: ObjectStore, first: int, limit: int) -> list[str]:
    """The names of up to limit segments from generation first on, for a follower's look.

    Found by stats, never by listing l/: segments are never deleted, and a local
    store's listing reads all of l/, so a look that listed whenever the writer had
    committed cost more the older the volume (25 ms of a core at 25,000 segments,
    0.8 s at 300,000), every interval while the writer works. The writer creates
    each segment after the one before, so where they end is found by stats that
    double the distance, then halve it: about 2 log2(n) stats for n new segments
    (a round trip each on S3, where a stat per segment would be n). A store that
    hides one segment and keeps later ones shows the look nothing from it on (its
    fetch fails, the next look finds it missing), as one that hides every new
    segment would, until a look asks for _past_a_gap.
    """
    found = 0  # the segments first .. first + found - 1 are there
    past = limit + 1  # the count at which one is known missing, or past the limit
    doubling = True
    while past - found > 1:
        probe = min(max(1, 2 * found), past - 1) if doubling else (found + past) // 2
        if _exists(store, segment_name(first + probe - 1)):
            found = probe
        else:
            past, doubling = probe, False
    return [segment_name(first + k) for k in range(found)]


def _past_a_gap(store: ObjectStore, first: int, limit: int) -> list[str]:
    """[The name of a segment after generation first], if the store holds one and not
    first's; else [].

    Stats at 1, 2, 4, ... generations past first, below limit: a look finds new
    segments by stats from first on, so a store that lost or hides that one segment
    but keeps the later ones showed a follower nothing, for good, where a listing
    named the gap. A few stats, which a follower makes only now and then, find any
    gap the writer has since committed about as much again past. The writer creates
    each segment after the one before, so first, asked for again once a later one is
    seen, is there unless the store lacks it.
    """
    distance = 1
    while distance < limit:
        if _exists(store, segment_name(first + distance)):
            return [] if _exists(store, segment_name(first)) else [segment_name(first + distance)]
        distance *= 2
    return []


def _segments_after(
    store: ObjectStore, ring: KeyRing, volume_id: bytes, state: MetaState
) -> Generator[tuple[str, bytes, LoggedSegment], None, None]:
    """(name, sealed bytes, opened segment) of each segment after state's generation.

    Lazily: an error names its fix from the state as replayed up to it.
    """
    names = store.list(SEGMENT_PREFIX, start_after=segment_name(state.generation))
    names = _up_to_a_listing_gap(store, names, state.generation + 1)
    yield from _opened_segments(store, ring, volume_id, state, names)


def _opened_segments(
    store: ObjectStore, ring: KeyRing, volume_id: bytes, state: MetaState, names: list[str]
) -> Generator[tuple[str, bytes, LoggedSegment], None, None]:
    """(name, sealed bytes, opened segment) of each of names, which follow state's
    generation in order. Lazily, as _segments_after."""
    with contextlib.closing(_fetch_in_order(store, names)) as fetched:  # no thread outlives it
        for name, sealed in fetched:
            gen = parse_generation(name)
            try:
                logged = decode_segment(ring, volume_id, gen, sealed)
            except NewerEpochError as exc:
                raise _rekeyed_meanwhile(
                    store, f"log segment {name}", exc, _log_fix(name, state)
                ) from None
            except (IntegrityError, FormatError) as exc:
                # The fix a gap or a broken chain names: the log before name is whole.
                fix = "" if isinstance(exc, UnsupportedVersionError) else _log_fix(name, state)
                raise type(exc)(
                    f"log segment {name} is damaged: {exc}{f'; {fix}' if fix else ''}"
                ) from None
            yield name, sealed, logged


def _up_to_a_listing_gap(store: ObjectStore, names: list[str], first: int) -> list[str]:
    """names (a listing of l/ from generation first on), cut before a segment it lacks
    that the store holds now.

    A directory read need not show what is created while it runs, nor leave out all of
    it: a listing taken while the writer commits can lack a segment and hold a later
    one (on ext4, a follower beside a writer fsyncing as fast as it could saw 1310 and
    1311 left out and 1312 listed, and stopped for good, calling the log damaged). A
    segment still missing once asked for alone is the store's gap: replay names it.
    """
    for k, name in enumerate(names):
        expected = segment_name(first + k)
        if name != expected:
            return names[:k] if _exists(store, expected) else names
    return names


def _replay_one(state: MetaState, name: str, logged: LoggedSegment, previous: bytes) -> None:
    """Apply segment name; previous: the sealed bytes of the one before, if read."""
    try:
        replay_segment(state, logged)
    except IntegrityError as exc:
        if previous and logged.segment.prev_hash == hashlib.sha256(previous).digest():
            raise _older_chain(name) from None
        raise IntegrityError(f"{exc}; {_log_fix(name, state)}") from None


def _rekeyed_meanwhile(
    store: ObjectStore, what: str, exc: NewerEpochError, fix: str
) -> SealfsError:
    """The error for an object sealed under a key epoch newer than the header read.

    A rekey (`sealfs rekey`, or the writer adopting one) between this command's
    read of the header and its load re-seals the log under the next epoch: that
    is no damage, and moving the object out (what a damaged log's error says)
    would lose what it holds. The header as it is now tells the two apart.
    """
    try:
        now = decode_header(read_header(store)).data_epoch
    except SealfsError:
        now = None
    if now is not None and now >= exc.epoch:
        return VolumeChangedError(
            f"{what} is sealed under key epoch {exc.epoch}, newer than the header this command"
            " read: the volume was rekeyed meanwhile (its header has changed): run the command"
            " again"
        )
    return IntegrityError(
        f"{what} is sealed under key epoch {exc.epoch}, which the volume's header does not"
        " name: if the volume was being rekeyed, run the command again; if this recurs, it is"
        f" damaged: {fix}"
    )


def _older_chain(name: str) -> UnsupportedVersionError:
    """A segment chained to the SHA-256 of the sealed bytes before it, not of the payload.

    sealfs builds before key epochs (commit 390f534) wrote their logs so, under the same
    format version. A store cannot forge that link (the segment is authenticated), so
    this is an older build's volume, not tampering: moving segments out, the fix for a
    broken chain, would lose its files, and the build that made it still reads it.
    """
    return UnsupportedVersionError(
        f"log segment {name} was written by an older sealfs build (its hash chain covers"
        " sealed bytes, as before key epochs), which this build does not read: mount the"
        " volume with that build, nothing was changed, and copy its files to a new volume"
    )


def _log_fix(name: str, state: MetaState) -> str:
    """The fix for a gap or a broken hash chain at segment name: errors name their fix.

    A restore under a live mount leaves such a log (the mount's next commit
    lands after the restored log's end), and so does a store that hid or
    swapped a segment. Either way the generations before name are whole, and
    they mount once the segments from name on are gone.
    """
    if state.generation == 0:  # nothing before it: without its segments, no root
        return "restore the store from a complete copy"
    return (
        f"restore the store from a complete copy, or move {name} and the segments after it"
        f" out of the store to mount generation {state.generation} (what they hold is lost)"
    )


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No cyclic garbage collection inside (nests; re-enabled as it was on leaving).

    Loading makes a few objects per inode, all long-lived and none of them
    cyclic garbage, so every collection their allocation triggers scans them
    in vain: about half of the load of a volume of 100,000 files went there.
    A process that keeps the state should gc.freeze() before enabling the
    collector again (see mount), or its first collections scan it all once more.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _fetch_in_order(
    store: ObjectStore, names: list[str]
) -> Generator[tuple[str, bytes], None, None]:
    """(name, bytes) of each object, in order, fetched LOAD_WORKERS at a time.

    On S3 one GET at a time would make a mount latency-bound. The pool's
    threads are all gone when this returns (or raises): a mount forks next.
    """
    if len(names) < 2:
        for name in names:
            yield name, store.get(name, MAX_SEALED_METADATA)
        return
    pool = ThreadPoolExecutor(max_workers=LOAD_WORKERS, thread_name_prefix="sealfs-load")
    try:
        pending: collections.deque[tuple[str, Future[bytes]]] = collections.deque()
        queue = iter(names)
        for name in itertools.islice(queue, LOAD_AHEAD):
            pending.append((name, pool.submit(store.get, name, MAX_SEALED_METADATA)))
        while pending:
            name, future = pending.popleft()
            data = future.result()
            for more in itertools.islice(queue, 1):
                pending.append((more, pool.submit(store.get, more, MAX_SEALED_METADATA)))
            yield name, data
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _load_snapshot(
    store: ObjectStore, ring: KeyRing, volume_id: bytes
) -> tuple[Snapshot | None, MetaState]:
    """The newest snapshot that the volume's keys open, and the state it holds.

    One sealed under a retired key epoch is passed over for the one before it (or for
    the whole log): a writer that had lost the volume wrote it after the new writer's
    rekey had re-sealed the snapshots, under the key that rekey then retired. The log
    is never deleted, so replayed from an older snapshot it gives the same state.
    """
    below = None  # pass over this snapshot and every newer one
    while True:
        found = _read_newest_snapshot(store, below)
        if found is None:
            return None, MetaState()
        name, sealed = found
        gen = parse_generation(name)
        try:
            return (gen, sealed), decode_snapshot(ring, volume_id, gen, sealed)
        except NewerEpochError as exc:
            fix = f"restore the store from a complete copy, or move {name} out of the store"
            raise _rekeyed_meanwhile(store, f"snapshot {name}", exc, fix) from None
        except RetiredEpochError as exc:
            log.warning(
                "snapshot %s passed over: %s (written by a writer taken over after a rekey);"
                " replaying the log from an older one",
                name, exc,
            )  # fmt: skip
            below = name
        except (IntegrityError, FormatError) as exc:
            raise type(exc)(f"snapshot {name} is damaged: {exc}") from None


def _read_newest_snapshot(store: ObjectStore, below: str | None) -> tuple[str, bytes] | None:
    """(name, sealed bytes) of the newest snapshot named before below, or None."""
    attempt = 0
    while True:
        attempt += 1
        names = [n for n in store.list(SNAPSHOT_PREFIX) if below is None or n < below]
        if not names:
            return None
        try:
            return names[-1], store.get(names[-1], MAX_SEALED_METADATA)
        except ObjectNotFoundError:
            # A writer deletes a snapshot once two newer ones are written: list again. Still
            # missing the third time, it is not that (an object listed but unreadable).
            if attempt == 3:
                raise


def check_writer(loaded: Loaded, *, takeover: bool) -> None:
    """Refuse to write while another writer may be live. Raises WriterConflictError.

    takeover applies only to a writer on another host, which this one cannot
    see: a live writer on this host would be fenced, and the writes it had
    acknowledged since its last commit lost, for a mount someone forgot.
    """
    prev = loaded.live.writer
    if prev is None or prev.released:
        return
    since = datetime.fromtimestamp(prev.since_ns / 1e9, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    if prev.host == socket.gethostname():
        if writer_alive(prev):
            if sealfs_command(prev.pid) == "rekey":  # an offline rekey writes the volume
                raise WriterConflictError(
                    f"volume is being rekeyed by 'sealfs rekey' (pid {prev.pid}) on this host"
                    f" since {since}: wait for it to finish, then run this again"
                )
            hint = " (--takeover is for a writer on another host)" if takeover else ""
            raise WriterConflictError(
                f"volume is mounted read-write by pid {prev.pid} on this host since {since}:"
                f" unmount it first, or mount with --read-only{hint}"
            )
        return  # that writer died without releasing: nothing can still write
    if takeover:
        return
    raise WriterConflictError(
        f"volume is mounted read-write by host {prev.host} pid {prev.pid} since {since}:"
        " unmount it there, or if that writer crashed, mount with --takeover"
    )


def claim_writer(loaded: Loaded) -> WriterInfo:
    """Commit a segment naming this process as the writer, purging orphaned inodes.

    Called by the process that will write (after a daemon forks, by the
    daemon). A writer that commits between the load and the claim (a busy one
    being taken over) wins the generation's create: the claim replays what it
    committed and tries again, CLAIM_ATTEMPTS times in all. Raises
    WriterConflictError if a new writer claimed the volume meanwhile, or if
    the writer kept committing first.
    """
    checked = loaded.live.writer  # the writer that check_writer let this mount replace
    info = WriterInfo(socket.gethostname(), os.getpid(), os.urandom(16), time.time_ns(), False)
    for _ in range(CLAIM_ATTEMPTS):
        if _try_claim(loaded, info):
            loaded.writer = info
            return info
        with collector_paused():
            _replay_log(loaded.store, loaded.keys, loaded.volume_id, loaded.live, loaded.tail)
        now = loaded.live.writer
        if now is not None and not now.released and now != checked:
            raise WriterConflictError(
                f"host {now.host} pid {now.pid} claimed the volume while this mount was"
                " starting: it is the writer now; unmount it there first, or mount with"
                " --read-only"
            )
    prev = loaded.live.writer
    who = "its writer" if prev is None else f"its writer (host {prev.host} pid {prev.pid})"
    raise WriterConflictError(
        f"could not claim the volume: {who} committed first at each of {CLAIM_ATTEMPTS}"
        " tries, so it is still running and writing: unmount it there first (--takeover is"
        " for a writer that crashed), then mount again"
    )


def _try_claim(loaded: Loaded, info: WriterInfo) -> bool:
    """Create the next generation's segment naming info as the writer; False if another
    writer created that generation first."""
    state = loaded.live
    records = [ops.writer(info)]
    records += [ops.del_inode(ino) for ino, inode in state.inodes.items() if inode.nlink == 0]
    segment = Segment(state.generation + 1, state.head_hash, time.time_ns(), records)
    with loaded.keys.sealing() as keys:
        sealed, digest = encode_segment(keys, loaded.volume_id, segment)
        try:
            loaded.store.put_if_absent(segment_name(segment.generation), sealed)
        except ObjectExistsError:
            return False
    loaded.store.sync()
    logged = LoggedSegment(segment, digest, len(sealed))
    replay_segment(state, logged)
    loaded.tail.append(logged)
    return True


def release_record(loaded: Loaded) -> ops.Op:
    """The record a clean unmount commits last: the writer lets go of the volume."""
    assert loaded.writer is not None
    w = loaded.writer
    return ops.writer(WriterInfo(w.host, w.pid, w.mount_id, w.since_ns, True))


def writer_alive(writer: WriterInfo) -> bool:
    """Whether the writer's process (on this host) still runs.

    Its pid alone may have been reused since it died: a process that started
    after the writer claimed the volume is not that writer.
    """
    if not pid_alive(writer.pid):
        return False
    started = process_start_ns(writer.pid)
    if started is None or started <= writer.since_ns + START_TIME_SLACK_NS:
        return True
    # The start time is read against the wall clock of now, since_ns was taken on the
    # wall clock of then: a clock stepped forward since (NTP after boot, a VM resumed)
    # makes the live writer look as if it started after its claim. Taking it for dead
    # would let a plain mount fence it. A sealfs process is never taken for a reused pid
    # (at worst another sealfs command holds it, and a refusal only waits for it).
    return _is_sealfs_process(writer.pid)


def _is_sealfs_process(pid: int) -> bool:
    """Whether the process's command line names sealfs (unknown: True)."""
    argv = _argv(pid)
    return argv is None or any(b"sealfs" in arg for arg in argv)


_SEALFS_ARGV = frozenset({b"sealfs", b"sealfs.cli.main"})  # run as a script, or with -m


def sealfs_command(pid: int) -> str | None:
    """The sealfs command a process runs ("mount", "rekey"), from its command line; None
    if unknown. An offline rekey holds the volume as a mount does, and a second rekey
    or a mount meanwhile was told to unmount a mount that did not exist."""
    argv = _argv(pid) or []
    start = next((k for k, arg in enumerate(argv) if os.path.basename(arg) in _SEALFS_ARGV), None)
    if start is None:
        return None
    command = next((arg for arg in argv[start + 1 :] if not arg.startswith(b"-")), None)
    return command.decode(errors="replace") if command else None


def _argv(pid: int) -> list[bytes] | None:
    """The process's arguments from /proc; None if unreadable (gone, or hidden)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return None


START_TIME_SLACK_NS = 2_000_000_000  # /proc's boot time is whole seconds; ticks are 10 ms


def process_start_ns(pid: int) -> int | None:
    """When the process started (ns since the epoch), from /proc; None if unknown."""
    fields = _proc_stat(pid)
    try:
        with open("/proc/stat", "rb") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
        ticks = int(fields[19])  # field 22 of proc(5); fields here start at field 3
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return (boot * 1_000_000_000) + ticks * 1_000_000_000 // os.sysconf("SC_CLK_TCK")


def _proc_stat(pid: int) -> list[bytes]:
    """The fields of /proc/PID/stat from the third (the state) on; [] if unreadable.

    Split after the last ") ": the command name before it may hold spaces and ")".
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b") ", 1)[-1].split()
    except OSError:
        return []


def pid_alive(pid: int) -> bool:
    """Whether another live (not zombie) process has this pid."""
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return _proc_stat(pid)[:1] != [b"Z"]  # a zombie holds no mount


def _exists(store: ObjectStore, name: str) -> bool:
    try:
        store.stat(name)
    except ObjectNotFoundError:
        return False
    return True
