"""The Volume: POSIX-like operations on an unlocked, loaded volume.

Every change is made by recording a metadata operation (applied to the live
state and queued for the next commit), so that what the engine shows and
what a remount replays are the same thing; a write's size and times alone
change in memory first, and are recorded at the next commit's cut with its
bytes. Permission checks are the kernel's (the FUSE mount uses
default_permissions); POSIX structure rules (ENOTEMPTY, EISDIR, rename into a
subtree, name lengths) are enforced here.
Raises FsError for POSIX failures and StoreError/IntegrityError for storage.
"""

from __future__ import annotations

import errno
import itertools
import logging
import mmap
import os
import stat
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from functools import partial

import trio

from sealfs.chunking.fastcdc import Chunker
from sealfs.crypto.subkeys import derive_subkeys
from sealfs.errors import (
    FencedError,
    FsError,
    IntegrityError,
    NoSpaceError,
    SealfsError,
    TransientStoreError,
    WriterStoppedError,
)
from sealfs.keys.header import decode_header, verify_header_mac
from sealfs.keys.rekey import open_retired
from sealfs.meta import ops
from sealfs.meta.codec import LoggedSegment
from sealfs.meta.extents import ExtentMap
from sealfs.meta.model import ROOT_INO, Inode, MetaState
from sealfs.volume import xattrs
from sealfs.volume.attrs import BLOCK_SIZE, Attr, DirEntry, StatFs, attr_of
from sealfs.volume.buffers import BlockPool
from sealfs.volume.chunks import RESERVED_WORKERS, Chunks
from sealfs.volume.committer import Committer, RetryLog, pause_after_failure
from sealfs.volume.filedata import FileData
from sealfs.volume.follower import Follower, UnlockAgain
from sealfs.volume.leftovers import clear_crash_leftovers
from sealfs.volume.loader import Loaded, read_header, release_record, replay_new_segment
from sealfs.volume.options import VolumeOptions
from sealfs.volume.rekey import Rekeyer

log = logging.getLogger("sealfs.volume")


NAME_MAX = 255
# Records after which a directory's listing is no longer its names (op[1] names it).
_LISTING_CHANGES = (ops.LINK, ops.UNLINK, ops.DEL_INODE)
_ATTR_CHANGES = (ops.PUT_INODE, ops.DATA)  # records that change an inode's attributes
_NAME_CHANGES = (ops.LINK, ops.UNLINK)  # records that change where a name leads
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2


@dataclass(eq=False)
class Handle:
    ino: int
    flags: int


@dataclass(eq=False)
class DirHandle:
    """An open directory: the listing a pass of readdir pages through."""

    ino: int
    # In listing order; each is looked up when its page is served. None until a pass
    # begins: at offset 0, or at whatever offset the handle's first readdir asks for.
    names: list[bytes] | None = None


class Volume:
    """One mounted volume. Use `async with volume.running():` around all calls."""

    def __init__(
        self, loaded: Loaded, options: VolumeOptions, unlock_again: UnlockAgain | None = None
    ) -> None:
        """unlock_again: how a read-only mount unlocks the header of a rekey by itself
        (None: it cannot, and stops following at a rekey; see sealfs.volume.follower)."""
        self.loaded = loaded
        self.options = options
        self.meta: MetaState = loaded.live
        self.store = loaded.store
        self._limiter = trio.CapacityLimiter(options.io_threads + RESERVED_WORKERS)
        self.chunks = Chunks(
            loaded.store,
            loaded.volume_id,
            loaded.keys,
            self._limiter,
            self.meta,
            options.chunk_cache_bytes,
        )
        self._chunker = Chunker(loaded.keys.current.chunker_seed)
        # Blocks worth keeping hold up to back-pressure plus one FUSE write.
        pool = BlockPool(options.max_buffered + (1 << 20))
        self.files = FileData(self.meta, self.chunks, self._chunker, self._spawn, pool)
        if options.read_only:
            # The segments since the last snapshot, kept for the writer's next snapshot: a
            # read-only mount writes none, and held them unused (11.5 MiB for the 50,000
            # records a log may grow to between snapshots, more than the state of 10,000
            # files).
            loaded.tail.clear()
        elif options.index_similar:
            self.meta.index_features()
        self.commits = Committer(loaded, self.files, self._limiter, options.commit_interval)
        self.read_only = options.read_only
        self._nursery: trio.Nursery | None = None
        self._handles: dict[int, Handle | DirHandle] = {}
        self._next_fh = 1
        self._lookups: dict[int, int] = {}
        # Handles open on each inode, directories' too: what the writer deletes while one
        # is open on a follower stays there until it is closed, as on the writer's mount.
        self._opens: dict[int, int] = {}
        # Sorted names of each directory listed since it last changed: the listing every
        # pass of readdir that begins meanwhile takes (see readdir), one copy for them all.
        self._listings: dict[int, list[bytes]] = {}
        self._relieving = False
        # While early flushes fail because the store's disk is full (ENOSPC) or the store
        # was given up on after --store-timeout (EIO): writers past max_buffered get this
        # errno instead of waiting, unkillably, for space only a commit can free.
        self._flush_errno: int | None = None
        self._flush_log = RetryLog("early flush", logging.WARNING)
        self.rekey: Rekeyer | None = None
        self._rekey_scope = trio.CancelScope()
        self._rekey_stopped = trio.Event()
        # A read-only mount follows the writer's commits; one that was writable never
        # does (turned read-only, fenced, it holds changes the log does not).
        self.follower = (
            Follower(
                loaded, self._limiter, options.commit_interval, self._adopt_followed, unlock_again
            )
            if self.read_only
            else None
        )
        # Files (and directories) open here, or named in the kernel's cache, that the
        # writer deleted since: readable until closed and forgotten, as an unlinked file
        # is on the writer's own mount.
        self._detached: dict[int, Inode] = {}
        # Files a replayed commit shrank that the kernel holds, as they were before it,
        # while the kernel may still believe their old size (see read).
        self._before_shrink: dict[int, Inode] = {}
        # Given the inodes a replay changed that the kernel holds (set by the FUSE layer,
        # which tells the kernel to drop their attributes: it keeps them for a second).
        # And the names it changed in directories the kernel holds, which it is told to
        # drop: the inodes they led to stay valid until it forgets them (_adopt_followed).
        self.on_followed: Callable[[list[int], list[tuple[int, bytes]]], None] | None = None

    # -- lifecycle ---------------------------------------------------------------------

    @asynccontextmanager
    async def running(self) -> AsyncIterator[Volume]:
        """Run the background commit loop; on exit commit everything and release the volume."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self.commits.start()
            if not self.read_only:
                nursery.start_soon(self.commits.loop)
                nursery.start_soon(clear_crash_leftovers, self.store, self._limiter)
                if self.loaded.keys.retired_epoch is not None:
                    self._start_rekey()  # one was interrupted: carry on
            elif self.follower is not None:
                nursery.start_soon(self.follower.loop)
            try:
                yield self
                if not self.read_only:
                    await self._stop_rekey()
                    await self.close()
            finally:
                nursery.cancel_scope.cancel()

    async def close(self) -> None:
        """Commit everything, marking the writer released. Raises StoreError on failure,
        unless the release was all that was left to commit: then nothing is lost."""
        if self.read_only:
            return
        release = release_record(self.loaded)
        try:
            await self.commits.commit(extra=[release])
        except SealfsError as exc:
            # Judged after the failure, not before the call: a commit in flight then
            # (the loop retrying against a failing store) had taken every pending record
            # and dirty byte, and its failure put them back into this commit.
            if self.commits.has_work(besides=release):
                raise
            self.read_only = True
            if isinstance(exc, FencedError):
                return  # taken over, said when it was found: the release is not ours to write
            # A store that failed to flush stopped this writer too, but no other holds the
            # volume: the release is still ours, and a mount elsewhere needs --takeover.
            # Reporting it as lost data (as a failed final commit is) alarmed for nothing.
            log.warning(
                "could not record at unmount that this mount stopped writing: %s. Nothing"
                " is lost; a mount on another host will need --takeover",
                exc,
            )
            return
        self.read_only = True
        if self.commits.snapshot_due(closing=True):
            try:
                await self.commits.snapshot()
            except SealfsError as exc:  # everything is committed; only the next mount is slower
                log.warning("snapshot at unmount failed: %s", exc)

    # -- rekey -------------------------------------------------------------------------

    def _start_rekey(self) -> None:
        assert self._nursery is not None
        self.rekey = rekey = Rekeyer(self.loaded, self.commits, self._limiter, self._chunk_in_use)
        # Fresh each time: a rekey that stopped (a damaged object) may be started again.
        self._rekey_scope = scope = trio.CancelScope()
        self._rekey_stopped = stopped = trio.Event()

        async def run() -> None:
            try:
                with scope:
                    await rekey.run()
            finally:
                stopped.set()

        self._nursery.start_soon(run)

    def _chunk_in_use(self, chunk_id: bytes) -> bool:
        """Whether a file here, or one deleted and still open, has bytes in chunk_id, or in
        a chunk stored as a difference from it."""
        wanted = {chunk_id}
        if self.meta.is_base(chunk_id):  # else no row to look through on the event loop
            wanted.update(cid for cid, info in self.meta.chunks.items() if info.base == chunk_id)
        files = itertools.chain(self.meta.inodes.values(), self._detached.values())
        return any(
            not wanted.isdisjoint(inode.extents.chunk_ids())
            for inode in files
            if inode.extents is not None
        )

    async def _stop_rekey(self) -> None:
        """Let the rekey stop between objects before the writer lets go of the volume."""
        if self.rekey is not None:
            self._rekey_scope.cancel()
            await self._rekey_stopped.wait()

    async def adopt_rekey(self, master_key: bytes) -> None:
        """Seal under the new key epoch the header names, and re-seal the old epoch's objects.

        `sealfs rekey` wrote the header (it holds the secrets the slots need)
        and hands over the new master key. It is taken only if the header in
        the store verifies under it and wraps this volume's current key as the
        retired one. Raises FsError(EINVAL) otherwise. Asking again while the
        rekey runs, or after it switched, is harmless.
        """
        self._writable()
        ring = self.loaded.keys
        data = await trio.to_thread.run_sync(read_header, self.store, limiter=self._limiter)
        header = decode_header(data)
        if len(master_key) != 32 or header.volume_id != self.loaded.volume_id:
            raise FsError(errno.EINVAL)
        new = derive_subkeys(master_key, header.volume_id)
        try:
            verify_header_mac(data, new.header_mac_key)
            retired = open_retired(header, master_key)
        except IntegrityError:
            raise FsError(errno.EINVAL) from None
        if header.data_epoch == ring.epoch and new == ring.current:
            stopped = self.rekey is None or self.rekey.ended.is_set()
            if ring.retired_epoch is not None and stopped:
                self._start_rekey()  # never started, or stopped: `sealfs rekey` asks again
            return
        if (
            retired is None
            or retired != (ring.epoch, ring.current)
            or ring.retired_epoch is not None
        ):
            raise FsError(errno.EINVAL)
        ring.advance(header.data_epoch, new)
        self._chunker.reseed(new.chunker_seed)
        self.loaded.header = header
        log.info("key epoch %d: new objects are sealed under it from now on", header.data_epoch)
        self._start_rekey()

    async def take_new_key(self) -> None:
        """A read-only mount takes a rekey's new key now, not when its next look or a read
        meets the rekey: after an idle writer's rekey, that was at the first read."""
        if self.follower is not None:
            await self.follower.notice_rekey(self.loaded.keys.epoch)

    def _spawn(self, fn: partial[object] | object) -> None:
        if self._nursery is not None:
            self._nursery.start_soon(fn)  # type: ignore[arg-type]

    def _writable(self) -> None:
        if self.commits.stopped is not None or self.read_only:
            raise FsError(errno.EROFS)

    async def _may_change(self) -> None:
        """Before a request changes anything: wait while the records awaiting a commit
        pass max_pending_records, then refuse a read-only or stopped volume (EROFS).

        Records are metadata, which the writers' back-pressure never bounded: an agent
        setting 64 KiB xattrs through the mount outran the commits, whose segments grew
        to 147 MB, 506 MB, then 1.9 GB within 40 s (the daemon at 8.8 GB of RSS), and
        the next would have passed the 2 GiB a mount reads (codec.MAX_METADATA_SIZE):
        its fsync succeeded, and every later mount failed. The request waits as an
        fsync does, and fails as one (EIO, ENOSPC), having changed nothing, if that
        commit fails.
        """
        while self.commits.pending_record_bytes > self.options.max_pending_records:
            await self.fsync()
        self._writable()

    def _record(self, op: ops.Op) -> None:
        self.commits.record(op)
        if self.commits.pending_record_bytes > self.options.max_pending_records // 2:
            self.commits.kick()  # a commit under way before changes have to wait
        if op[0] in _LISTING_CHANGES:
            self._listings.pop(op[1], None)  # a directory whose names changed, or is gone

    def _adopt_followed(self, name: str, logged: LoggedSegment) -> None:
        """Apply the writer's next commit, whole (no await inside).

        An inode the commit deletes stays valid while the kernel holds it, as FUSE has
        it: open here, or a name the kernel cached (a lookup not yet forgotten), and the
        kernel is told to drop the names the commit changed (on_followed), so that its
        next walk finds the new inode. Dropped at once, an agent reading its checkpoint
        by name while the writer replaced it several times a second met ESTALE in
        readlink and open (98 in 7 s): the kernel looks a name up again once after
        ESTALE, and the inode it found then was often replaced again by the next commit
        before the request reached it.
        """
        deleted = {op[1] for op in logged.segment.ops if op[0] == ops.DEL_INODE}
        # A file as the last generation left it, with no links: the records of the
        # commit deleting it may leave it in no state a generation held (a size whose
        # data the writer dropped with the file, read as zeros). A directory as the
        # commit leaves it: empty.
        held = {
            ino: _file_as_it_is(inode, nlink=0) if inode.is_reg else inode
            for ino in deleted
            if self._kernel_holds(ino) and (inode := self.meta.inodes.get(ino)) is not None
        }
        self._keep_before_shrink(logged.segment.ops)
        try:
            replay_new_segment(self.meta, name, logged)
        finally:
            self._listings.clear()  # any directory may have changed
            for ino, inode in held.items():
                if ino not in self.meta.inodes:
                    self._detached[ino] = inode
            self.commits.followed()
            if self.on_followed is not None:
                records = logged.segment.ops
                changed = {op[1] for op in records if op[0] in _ATTR_CHANGES}
                names = {
                    (op[1], op[2])
                    for op in records
                    if op[0] in _NAME_CHANGES and (op[1] == ROOT_INO or op[1] in self._lookups)
                }
                self.on_followed(sorted(changed.intersection(self._lookups)), sorted(names))

    def _keep_before_shrink(self, records: list[ops.Op]) -> None:
        """Keep, for read, the version before this commit of each file it shrinks that the
        kernel holds (a copy of its inode: chunks are never deleted).

        A READ the kernel sent for the old size, answered after the replay, came back
        short; the kernel then zero-filled the rest of its pages and kept the old size
        (the attributes invalidated by the replay made it ignore the short read), so a
        reader got the new bytes and then zeros up to the old size: bytes no
        generation holds. An agent compacting its log with ftruncate, read on a
        follower, read NUL runs and torn lines.
        """
        sizes: dict[int, int] = {}  # each file's size after the commit: its last record's
        for op in records:
            size = ops.size_set_by(op)
            if size is not None:
                sizes[op[1]] = size
        for ino, size in sizes.items():
            inode = self.meta.inodes.get(ino)
            if inode is None or inode.extents is None:
                continue
            if size < inode.size and self._kernel_holds(ino):
                self._before_shrink[ino] = _file_as_it_is(inode)
            elif size >= self._before_shrink.get(ino, inode).size:
                self._before_shrink.pop(ino, None)  # grown past it: no read asks for it

    def _attr(self, inode: Inode) -> Attr:
        return attr_of(inode, self.files.buffered_in(inode.ino))

    # -- lookups -----------------------------------------------------------------------

    def inode(self, ino: int) -> Inode:
        inode = self.meta.inodes.get(ino) or self._detached.get(ino)
        if inode is None:
            # A follower's kernel may still hold a name of a file the writer has since
            # replaced (its entries live a second): ENOENT failed the open of a file that
            # exists; ESTALE makes the kernel look the name up again, and open that.
            raise FsError(errno.ESTALE if self.follower is not None else errno.ENOENT)
        return inode

    def parent_of(self, ino: int) -> int:
        """The directory ".." in directory ino names: its parent, or itself at the root and
        once the parent is gone (on a follower, a directory open there that the writer
        removed with its parent; a listing of it failed on "..")."""
        parent = self.inode(ino).parent or ino
        return parent if parent in self.meta.inodes or parent in self._detached else ino

    def _dir(self, ino: int) -> Inode:
        inode = self.inode(ino)
        if inode.entries is None:
            raise FsError(errno.ENOTDIR)
        return inode

    def note_lookup(self, ino: int) -> None:
        """The kernel now holds one more reference to ino (an entry reply)."""
        self._lookups[ino] = self._lookups.get(ino, 0) + 1

    async def lookup(self, parent: int, name: bytes) -> Attr:
        _check_name(name)
        entries = self._dir(parent).entries
        assert entries is not None
        ino = entries.get(name)
        if ino is None:
            raise FsError(errno.ENOENT)
        self.note_lookup(ino)
        return self._attr(self.inode(ino))

    async def getattr(self, ino: int) -> Attr:
        return self._attr(self.inode(ino))

    async def forget(self, items: list[tuple[int, int]]) -> None:
        for ino, count in items:
            left = self._lookups.get(ino, 0) - count
            if left > 0:
                self._lookups[ino] = left
            else:
                self._lookups.pop(ino, None)
                self._maybe_delete(ino)

    async def readlink(self, ino: int) -> bytes:
        inode = self.inode(ino)
        if not stat.S_ISLNK(inode.mode):
            raise FsError(errno.EINVAL)
        return inode.target

    # -- creating nodes ----------------------------------------------------------------

    async def _new_node(
        self,
        parent: int,
        name: bytes,
        mode: int,
        uid: int,
        gid: int,
        *,
        rdev: int = 0,
        target: bytes = b"",
    ) -> Inode:
        await self._may_change()
        _check_name(name)
        pdir = self._dir(parent)
        assert pdir.entries is not None
        if name in pdir.entries:
            raise FsError(errno.EEXIST)
        if pdir.mode & stat.S_ISGID:
            gid = pdir.gid
            if stat.S_ISDIR(mode):
                mode |= stat.S_ISGID
        now = time.time_ns()
        is_dir = stat.S_ISDIR(mode)
        ino = self.meta.next_ino
        self._record(ops.new_inode_record(
            ino=ino, mode=mode, uid=uid, gid=gid, nlink=2 if is_dir else 1,
            size=len(target), atime_ns=now, mtime_ns=now, ctime_ns=now, rdev=rdev,
            parent=parent if is_dir else 0, target=target,
        ))  # fmt: skip
        self._record(ops.link(parent, name, ino))
        self._record(ops.put_inode(pdir, mtime_ns=now, ctime_ns=now, nlink=pdir.nlink + is_dir))
        self.note_lookup(ino)
        return self.meta.inodes[ino]

    async def mknod(
        self, parent: int, name: bytes, mode: int, rdev: int, uid: int, gid: int
    ) -> Attr:
        if stat.S_IFMT(mode) not in (
            stat.S_IFREG,
            stat.S_IFIFO,
            stat.S_IFSOCK,
            stat.S_IFCHR,
            stat.S_IFBLK,
        ):
            raise FsError(errno.EINVAL)
        return self._attr(await self._new_node(parent, name, mode, uid, gid, rdev=rdev))

    async def mkdir(self, parent: int, name: bytes, mode: int, uid: int, gid: int) -> Attr:
        node = await self._new_node(parent, name, stat.S_IFDIR | (mode & 0o7777), uid, gid)
        return self._attr(node)

    async def symlink(self, parent: int, name: bytes, target: bytes, uid: int, gid: int) -> Attr:
        if len(target) > 4095:
            raise FsError(errno.ENAMETOOLONG)
        return self._attr(
            await self._new_node(parent, name, stat.S_IFLNK | 0o777, uid, gid, target=target)
        )

    async def create(
        self, parent: int, name: bytes, mode: int, flags: int, uid: int, gid: int
    ) -> tuple[int, Attr]:
        inode = await self._new_node(parent, name, stat.S_IFREG | (mode & 0o7777), uid, gid)
        return self._open_handle(inode.ino, flags), self._attr(inode)

    async def link(self, ino: int, new_parent: int, new_name: bytes) -> Attr:
        await self._may_change()
        _check_name(new_name)
        inode = self.inode(ino)
        if inode.is_dir:
            raise FsError(errno.EPERM)
        pdir = self._dir(new_parent)
        assert pdir.entries is not None
        if new_name in pdir.entries:
            raise FsError(errno.EEXIST)
        now = time.time_ns()
        self._record(ops.link(new_parent, new_name, ino))
        self._record(ops.put_inode(inode, nlink=inode.nlink + 1, ctime_ns=now))
        self._record(ops.put_inode(pdir, mtime_ns=now, ctime_ns=now))
        self.note_lookup(ino)
        return self._attr(inode)

    # -- removing nodes ----------------------------------------------------------------

    async def unlink(self, parent: int, name: bytes) -> None:
        await self._remove(parent, name, want_dir=False)

    async def rmdir(self, parent: int, name: bytes) -> None:
        await self._remove(parent, name, want_dir=True)

    async def _remove(self, parent: int, name: bytes, *, want_dir: bool) -> None:
        await self._may_change()
        _check_name(name)
        pdir = self._dir(parent)
        assert pdir.entries is not None
        ino = pdir.entries.get(name)
        if ino is None:
            raise FsError(errno.ENOENT)
        victim = self.inode(ino)
        self._check_replaceable(victim, want_dir)
        now = time.time_ns()
        self._record(ops.unlink(parent, name))
        self._drop_link(victim, now)
        self._record(
            ops.put_inode(pdir, mtime_ns=now, ctime_ns=now, nlink=pdir.nlink - victim.is_dir)
        )

    def _check_replaceable(self, victim: Inode, want_dir: bool) -> None:
        if want_dir and not victim.is_dir:
            raise FsError(errno.ENOTDIR)
        if not want_dir and victim.is_dir:
            raise FsError(errno.EISDIR)
        if victim.entries:
            raise FsError(errno.ENOTEMPTY)

    def _drop_link(self, victim: Inode, now: int) -> None:
        """One name of victim is gone; delete it once nothing refers to it."""
        nlink = 0 if victim.is_dir else victim.nlink - 1
        self._record(ops.put_inode(victim, nlink=nlink, ctime_ns=now))
        self._maybe_delete(victim.ino)

    def _kernel_holds(self, ino: int) -> bool:
        """Whether the kernel may still send a request for ino: open, or looked up and
        not yet forgotten."""
        return bool(self._opens.get(ino) or self._lookups.get(ino))

    def _maybe_delete(self, ino: int) -> None:
        if self._kernel_holds(ino):
            return  # an orphan, or a follower's detached inode, until the kernel lets go
        self._detached.pop(ino, None)
        self._before_shrink.pop(ino, None)
        inode = self.meta.inodes.get(ino)
        if inode is None or inode.nlink > 0 or ino == ROOT_INO or self.read_only:
            return
        self._record(ops.del_inode(ino))
        self.files.forget(ino)

    # -- rename ------------------------------------------------------------------------

    async def rename(
        self, old_parent: int, old_name: bytes, new_parent: int, new_name: bytes, flags: int = 0
    ) -> None:
        await self._may_change()
        _check_name(old_name)
        _check_name(new_name)
        if (
            flags & ~(RENAME_NOREPLACE | RENAME_EXCHANGE)
            or flags == RENAME_NOREPLACE | RENAME_EXCHANGE
        ):
            raise FsError(errno.EINVAL)
        src_dir, dst_dir = self._dir(old_parent), self._dir(new_parent)
        assert src_dir.entries is not None and dst_dir.entries is not None
        src_ino = src_dir.entries.get(old_name)
        if src_ino is None:
            raise FsError(errno.ENOENT)
        dst_ino = dst_dir.entries.get(new_name)
        if flags & RENAME_NOREPLACE and dst_ino is not None:
            raise FsError(errno.EEXIST)
        if flags & RENAME_EXCHANGE:
            if dst_ino is None:
                raise FsError(errno.ENOENT)
            self._exchange(src_dir, old_name, src_ino, dst_dir, new_name, dst_ino)
            return
        src = self.inode(src_ino)
        if src.is_dir:
            self._check_not_inside(src_ino, new_parent)
        if dst_ino == src_ino:
            return  # two names of one inode: POSIX says do nothing
        now = time.time_ns()
        victim_dir = False
        if dst_ino is not None:
            victim = self.inode(dst_ino)
            self._check_replaceable(victim, src.is_dir)
            victim_dir = victim.is_dir
            self._record(ops.unlink(new_parent, new_name))
            self._drop_link(victim, now)
        self._record(ops.unlink(old_parent, old_name))
        self._record(ops.link(new_parent, new_name, src_ino))
        self._record(ops.put_inode(src, ctime_ns=now, parent=new_parent if src.is_dir else 0))
        moved = int(src.is_dir and old_parent != new_parent)
        self._touch_dir(src_dir, now, -moved - (victim_dir and src_dir is dst_dir))
        if dst_dir is not src_dir:
            self._touch_dir(dst_dir, now, moved - victim_dir)

    def _touch_dir(self, directory: Inode, now: int, nlink_delta: int) -> None:
        self._record(
            ops.put_inode(
                directory, mtime_ns=now, ctime_ns=now, nlink=directory.nlink + nlink_delta
            )
        )

    def _exchange(
        self, a_dir: Inode, a_name: bytes, a_ino: int, b_dir: Inode, b_name: bytes, b_ino: int
    ) -> None:
        a, b = self.inode(a_ino), self.inode(b_ino)
        if a.is_dir:
            self._check_not_inside(a_ino, b_dir.ino)
        if b.is_dir:
            self._check_not_inside(b_ino, a_dir.ino)
        now = time.time_ns()
        self._record(ops.link(a_dir.ino, a_name, b_ino))
        self._record(ops.link(b_dir.ino, b_name, a_ino))
        self._record(ops.put_inode(a, ctime_ns=now, parent=b_dir.ino if a.is_dir else 0))
        self._record(ops.put_inode(b, ctime_ns=now, parent=a_dir.ino if b.is_dir else 0))
        if a_dir is b_dir:
            self._touch_dir(a_dir, now, 0)
        else:
            self._touch_dir(a_dir, now, b.is_dir - a.is_dir)
            self._touch_dir(b_dir, now, a.is_dir - b.is_dir)

    def _check_not_inside(self, dir_ino: int, target_parent: int) -> None:
        """EINVAL if target_parent is dir_ino or lies below it (a cycle otherwise)."""
        ino = target_parent
        while True:
            if ino == dir_ino:
                raise FsError(errno.EINVAL)
            if ino == ROOT_INO:
                return
            ino = self.inode(ino).parent

    # -- attributes --------------------------------------------------------------------

    async def setattr(
        self,
        ino: int,
        *,
        mode: int | None = None,
        uid: int | None = None,
        gid: int | None = None,
        size: int | None = None,
        atime_ns: int | None = None,
        mtime_ns: int | None = None,
    ) -> Attr:
        await self._may_change()
        inode = self.inode(ino)
        now = time.time_ns()
        if size is not None:
            await self._truncate(inode, size, now)
        changes: dict[str, int] = {"ctime_ns": now}
        if mode is not None:
            changes["mode"] = stat.S_IFMT(inode.mode) | (mode & 0o7777)
        for key, value in (
            ("uid", uid),
            ("gid", gid),
            ("atime_ns", None if atime_ns is None else ops.clamp_time(atime_ns)),
            ("mtime_ns", None if mtime_ns is None else ops.clamp_time(mtime_ns)),
        ):
            if value is not None:
                changes[key] = value
        self._record(ops.put_inode(inode, **changes))
        return self._attr(inode)

    async def _truncate(self, inode: Inode, size: int, now: int, **changes: int) -> None:
        """Cut the file to size; changes: more fields of the same inode record."""
        if inode.is_dir:
            raise FsError(errno.EISDIR)
        if not inode.is_reg:
            raise FsError(errno.EINVAL)
        await self.files.wait_idle(inode.ino)
        # No await from here on: a flush must not start between the wait and the cut.
        self.files.truncate_buffers(inode.ino, size)
        self._record(ops.put_inode(inode, size=size, mtime_ns=now, ctime_ns=now, **changes))

    # -- files -------------------------------------------------------------------------

    def _open_handle(self, ino: int, flags: int) -> int:
        fh = self._next_fh
        self._next_fh += 1
        self._handles[fh] = Handle(ino, flags)
        self._opens[ino] = self._opens.get(ino, 0) + 1
        return fh

    def _handle(self, fh: int) -> Handle:
        handle = self._handles.get(fh)
        if not isinstance(handle, Handle):
            raise FsError(errno.EBADF)
        return handle

    async def open(self, ino: int, flags: int, *, kill_priv: bool = False) -> int:
        """kill_priv: the caller lacks CAP_FSETID, so O_TRUNC clears set-ID bits."""
        inode = self.inode(ino)
        if inode.is_dir:
            raise FsError(errno.EISDIR)
        if flags & os.O_TRUNC and inode.is_reg:
            # As Linux does: whatever the access mode (the kernel checked for write
            # permission), and mtime and ctime change even if the file was empty.
            await self._may_change()
            # The kernel hands O_TRUNC to the daemon (atomic_o_trunc) and, unlike for
            # truncate(2), clears no set-ID bit itself: as should_remove_suid does,
            # set-user-ID always, set-group-ID when group-executable.
            mode = _without_set_id(inode.mode) if kill_priv else inode.mode
            await self._truncate(inode, 0, time.time_ns(), mode=mode)
        elif flags & os.O_ACCMODE != os.O_RDONLY:
            self._writable()
        return self._open_handle(ino, flags)

    async def read(self, fh: int, offset: int, size: int) -> memoryview:
        """File bytes as a read-only view (see FileData.read: often a slice of a chunk)."""
        inode = self.inode(self._handle(fh).ino)
        if not inode.is_reg:
            raise FsError(errno.EINVAL)
        before = self._before_shrink.get(inode.ino)
        if before is not None and offset + size > _page_end(inode.size):
            # Past the page that holds the end: the kernel reads by the size it believes,
            # a page at a time, so it still believes the size before a shrink it has not
            # seen yet. Answered from that version, not short (see _keep_before_shrink).
            inode = before
        tried_under = self.loaded.keys.epoch
        try:
            return await self.files.read(inode, offset, size)
        except IntegrityError:
            # A follower's look may not meet a rekey for a while: the read that fails does.
            if self.follower is None or not await self.follower.notice_rekey(tried_under):
                raise
        return await self.files.read(inode, offset, size)  # under the key just taken

    async def write(self, fh: int, offset: int, data: bytes) -> int:
        handle = self._handle(fh)
        self._writable()
        inode = self.inode(handle.ino)
        if self._flush_errno is not None and self.files.buffered_bytes > self.options.max_buffered:
            raise FsError(self._flush_errno)  # refused before buffering: nothing was written
        if not data:
            # POSIX: no other results. Linux sends none through FUSE, but a write of no
            # bytes past the end must not grow the file, nor touch its times, in memory
            # alone: with no bytes for a commit to record, a remount would undo both.
            return 0
        if handle.flags & os.O_APPEND:
            offset = inode.size
        self.files.write(inode, offset, data)
        inode.mtime_ns = inode.ctime_ns = time.time_ns()  # recorded at the commit's cut
        await self._apply_backpressure()
        if handle.flags & os.O_DSYNC:  # O_SYNC includes it
            # The kernel sends FSYNC after a synchronous write to such a file, but not
            # after an asynchronous O_DIRECT one (libaio, io_uring): it completes that
            # on our reply. The FSYNC that follows a synchronous write finds nothing left.
            await self.fsync()
        return len(data)

    def _over_files(self) -> bool:
        """Whether more files hold unsealed bytes than a commit should carry.

        max_buffered bounds the memory of small files, not the time a commit takes
        to store them: a chunk each, a PUT each on S3. 64 MiB of a tree copy's files
        is about 8,000 of them, and behind 30 ms per request each commit took 36-58 s
        (an fsync, which waits for the commit in flight and the next, up to 156 s)
        while the copy itself went no faster than the uploads.
        """
        return self.files.dirty_files > self.options.max_dirty_files

    async def _apply_backpressure(self) -> None:
        over_bytes = self.files.buffered_bytes > self.options.flush_threshold
        if (over_bytes or self._over_files()) and not self._relieving:
            self._relieving = True
            self._spawn(self._relieve)
        while self.files.buffered_bytes > self.options.max_buffered or self._over_files():
            if self.commits.stopped is not None:
                raise FsError(errno.EROFS)  # nothing buffered will be committed now
            if self._flush_errno is not None:
                return  # this write's bytes are buffered: the next write gets the error
            await self.files.space.wait()

    async def _relieve(self) -> None:
        """Flush early until buffered bytes are down to half the threshold.

        A failure is retried, as the commit loop retries: writers blocked at
        max_buffered wait for this, and the commit loop may not run for a whole
        interval. Once a flush fails on a full disk (ENOSPC), on a store that
        stayed unreachable for --store-timeout or refuses the write (EIO, as an
        fsync gets), they get the error instead: none clears soon, and a write
        blocked in the kernel cannot even be killed. A transient failure is
        retried while they wait; every failed flush is retried, and the first
        that succeeds lets writers in again.
        Once the writer has stopped (fenced, or its store failed to
        flush) nothing will be committed: the stop wakes the blocked writers,
        which fail with EROFS.
        """
        try:
            while (
                self.files.buffered_bytes > self.options.flush_threshold // 2 or self._over_files()
            ):
                try:
                    if await self.commits.relieve_pressure():
                        # Only a flush or commit of its own proves the store takes data
                        # again: a wait for the commit loop's flush (failing as well on a
                        # full disk) "succeeded", and flapped writers and the log.
                        self._flush_errno = None
                        self._flush_log.succeeded()
                except WriterStoppedError:
                    return
                except SealfsError as exc:
                    self._flush_log.failed(exc)
                    if self._flush_errno is None and _gives_up(exc):
                        self._flush_errno = (
                            errno.ENOSPC if isinstance(exc, NoSpaceError) else errno.EIO
                        )
                        # Each time, not through the retry log: it repeats a failure of the
                        # same kind only every ten minutes, and writers got errors unexplained.
                        log.error(
                            "writes past the buffer limit fail with %s until the store takes"
                            " data again: %s",
                            errno.errorcode[self._flush_errno],
                            exc,
                        )
                        self.files.wake_space_waiters()  # blocked writers: the error from now on
                    await pause_after_failure(min(self.options.commit_interval, 1.0))
            self._flush_errno = None  # buffered bytes went down: something was committed
        finally:
            self._relieving = False

    async def flush(self, fh: int) -> None:
        """close(2) on a descriptor: commits first only with --sync-on-close."""
        handle = self._handle(fh)
        if self.options.sync_on_close and handle.flags & os.O_ACCMODE != os.O_RDONLY:
            await self.fsync()

    async def release(self, fh: int) -> None:
        handle = self._handles.pop(fh, None)
        if isinstance(handle, Handle):
            self._closed(handle.ino)

    def _closed(self, ino: int) -> None:
        """A handle on ino (a file's or a directory's) was released."""
        left = self._opens.get(ino, 0) - 1
        if left > 0:
            self._opens[ino] = left
        else:
            self._opens.pop(ino, None)
            self._maybe_delete(ino)

    async def fsync(self) -> None:
        """fsync, fdatasync, syncfs: everything recorded before the call is committed."""
        if self.read_only:
            return
        try:
            await self.commits.sync()
        except FencedError:
            raise FsError(errno.EROFS) from None

    # -- directories -------------------------------------------------------------------

    async def opendir(self, ino: int) -> int:
        self._dir(ino)
        fh = self._next_fh
        self._next_fh += 1
        self._handles[fh] = DirHandle(ino)
        self._opens[ino] = self._opens.get(ino, 0) + 1
        return fh

    async def readdir(self, fh: int, start: int, limit: int | None = None) -> list[DirEntry]:
        """Entries from index start of the listing (names the directory still holds).

        A pass starts at index 0 and takes the listing then: rewinddir(3) must show
        the directory as it is now (the listing taken at opendir showed a poller
        the names of its first pass forever). So does a handle's first readdir at
        any offset: a directory opened again to resume where an earlier handle
        stopped (as ext4's cookies allow) read as ending there. At most limit
        entries: a caller that takes a page at a time must not pay for the rest of
        the directory on every page (quadratic in its size).

        The listing fixes only the order (so offsets stay stable); each name is
        looked up again when its page is served. The kernel makes a dentry of every
        entry (readdirplus): a name renamed or unlinked since the pass began, served
        from the listing, came back as a dentry of the old inode, so that
        open(name, "w") truncated the renamed file instead of creating a new one.
        """
        handle = self._handles.get(fh)
        if not isinstance(handle, DirHandle):
            raise FsError(errno.EBADF)
        directory = self.meta.inodes.get(handle.ino)  # gone if removed while open
        entries = (directory.entries if directory is not None else None) or {}
        if start == 0 or handle.names is None:
            handle.names = self._listing(handle.ino) if entries else []
        names = handle.names
        out = []
        for index in range(start, len(names)):
            name = names[index]
            ino = entries.get(name)  # None: renamed or removed since the pass began
            inode = self.meta.inodes.get(ino) if ino is not None else None
            if inode is not None:
                out.append(DirEntry(name, self._attr(inode), index + 1))
                if limit is not None and len(out) >= limit:
                    break
        return out

    def _listing(self, ino: int) -> list[bytes]:
        """The sorted names of directory ino as they are now, shared and never changed.

        Each pass used to sort a copy of its own and keep it while the handle stayed
        open: 500 handles on a directory of 200,000 entries took 770 MB of memory. A
        record that links or unlinks a name in the directory drops its listing.
        """
        names = self._listings.get(ino)
        if names is None:
            entries = self._dir(ino).entries
            assert entries is not None
            names = self._listings[ino] = sorted(entries)
        return names

    async def releasedir(self, fh: int) -> None:
        handle = self._handles.pop(fh, None)
        if isinstance(handle, DirHandle):
            self._closed(handle.ino)

    # -- extended attributes -----------------------------------------------------------

    async def getxattr(self, ino: int, name: bytes) -> bytes:
        xattrs.check_name(name)
        value = self.inode(ino).xattrs.get(name)
        if value is None:
            raise xattrs.no_such(name)
        return value

    async def listxattr(self, ino: int, *, privileged: bool = True) -> list[bytes]:
        """A file's xattr names. trusted.* ones only for a privileged caller (standing for
        CAP_SYS_ADMIN), as ext4 lists them: the kernel refuses anyone else a read of one
        (ENODATA), and rsync -X by a user failed on the names it was shown."""
        names = sorted(self.inode(ino).xattrs)
        if privileged:
            return names
        return [name for name in names if not name.startswith(xattrs.XATTR_TRUSTED)]

    async def setxattr(self, ino: int, name: bytes, value: bytes, flags: int = 0) -> None:
        await self._may_change()
        inode = self.inode(ino)
        xattrs.check_name(name)
        if len(value) > xattrs.XATTR_SIZE_MAX:
            raise FsError(errno.E2BIG)
        if name == xattrs.POSIX_ACL_ACCESS:
            self._chmod_by_acl(inode, value)
            return
        xattrs.check_set(inode.xattrs, name, value, flags)
        self._record(ops.set_xattr(ino, name, value))
        self._record(ops.put_inode(inode, ctime_ns=time.time_ns()))

    def _chmod_by_acl(self, inode: Inode, value: bytes) -> None:
        """Apply an access ACL that only restates permission bits, as a chmod (nothing is
        stored, as on ext4). cp -a sets modes this way and falls back to chmod only when
        refused: a request per file saved. Raises FsError(EOPNOTSUPP) for any other ACL.

        The kernel checked ownership and the ACL's validity. ext4 also clears S_ISGID when
        the caller is outside the file's group and lacks CAP_FSETID; the daemon cannot
        tell, so set-group-ID files are refused too and get the kernel-checked chmod.
        """
        bits = xattrs.mode_of_acl(value)
        if bits is None or inode.mode & stat.S_ISGID:
            raise FsError(errno.EOPNOTSUPP)
        mode = (inode.mode & ~0o777) | bits
        self._record(ops.put_inode(inode, mode=mode, ctime_ns=time.time_ns()))

    async def removexattr(self, ino: int, name: bytes) -> None:
        await self._may_change()
        inode = self.inode(ino)
        xattrs.check_name(name)
        if name in xattrs.POSIX_ACL_XATTRS:
            return  # there is never one to remove, and ext4 succeeds then too
        if name not in inode.xattrs:  # one an older build stored can still be removed
            raise xattrs.no_such(name)
        self._record(ops.del_xattr(ino, name))
        self._record(ops.put_inode(inode, ctime_ns=time.time_ns()))

    # -- whole volume ------------------------------------------------------------------

    async def statfs(self) -> StatFs:
        free = self.loaded.free_bytes()
        used = self.meta.chunks_stored_bytes
        files = len(self.meta.inodes)
        return StatFs(
            BLOCK_SIZE, (used + free) // BLOCK_SIZE, free // BLOCK_SIZE, free // BLOCK_SIZE,
            files + 1_000_000, 1_000_000, NAME_MAX,
        )  # fmt: skip


def _file_as_it_is(inode: Inode, nlink: int | None = None) -> Inode:
    """A copy of a file's inode (with nlink, if given) that replaying later records
    leaves alone: they change inodes and their extent maps in place. Chunks are never
    deleted."""
    assert inode.extents is not None
    extents = ExtentMap(list(inode.extents))
    return replace(inode, extents=extents, nlink=inode.nlink if nlink is None else nlink)


def _page_end(size: int) -> int:
    """Where the page that holds a file's last byte ends: the kernel's reads go no further."""
    return -(-size // mmap.PAGESIZE) * mmap.PAGESIZE


def _without_set_id(mode: int) -> int:
    """mode less the set-ID bits a write or truncation by an unprivileged caller clears."""
    mode &= ~stat.S_ISUID
    if mode & stat.S_IXGRP:
        mode &= ~stat.S_ISGID
    return mode


def _gives_up(exc: SealfsError) -> bool:
    """Whether an early flush's failure ends the wait of writers blocked at max_buffered.

    Every failure but a transient one (which the store retries up to --store-timeout,
    raising StoreUnavailableError then), as each fails an fsync at once too: a full
    disk, or a store that refuses the write (a local one: EACCES, EPERM, EROFS, EIO).
    Waiting on those held the writer in the kernel, unkillable, for as long as the
    store kept refusing.
    """
    return not isinstance(exc, TransientStoreError)


def _check_name(name: bytes) -> None:
    if len(name) > NAME_MAX:
        raise FsError(errno.ENAMETOOLONG)
    if not name or b"/" in name or b"\0" in name or name in (b".", b".."):
        raise FsError(errno.EINVAL)
