"""pyfuse3 Operations over a Volume, and the one place errors become errno.

Every handler runs on pyfuse3's trio loop; an exception other than FUSEError
would end the loop, so the boundary catches everything: POSIX failures map
to their errno, integrity and missing objects to EIO with a log line naming
the object, a full store to ENOSPC, anything unexpected to EIO with a trace.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, ParamSpec, TypeVar

import pyfuse3
import trio

from sealfs.errors import (
    FencedError,
    FormatError,
    FsError,
    IntegrityError,
    NoSpaceError,
    ObjectNotFoundError,
    SealfsError,
    StoreError,
)
from sealfs.volume.attrs import IO_SIZE, Attr
from sealfs.volume.engine import Volume
from sealfs.volume.status import mounted_volume_status
from sealfs.volume.xattrs import POSIX_ACL_ACCESS

log = logging.getLogger("sealfs.fuse")

STATUS_XATTR = b"user.sealfs.status"
# Written on the root by `sealfs rekey` (value: the new master key) to hand the
# daemon a key epoch the store's header already names; never stored.
REKEY_XATTR = b"user.sealfs.rekey"
# Read on the root by `sealfs rekey` from a read-only mount of the volume: the mount takes
# the new key now (unlocking the new header itself), and answers with its status.
TAKE_KEY_XATTR = b"user.sealfs.take-new-key"
# Directory entries asked of the engine at a time. A reply holds about 25 (a page of
# readdirplus entries, 10 with 255-byte names): of the 256 asked before, each costing
# the engine 3.6 us, most were thrown away (docs/design.md, "POSIX details").
READDIR_BATCH = 32
# The kernel turns O_APPEND into write offsets itself, and it alone sees fcntl(F_SETFL)
# change the flag later: the engine must take its offsets as they come.
KERNEL_FLAGS = os.O_APPEND

P = ParamSpec("P")
R = TypeVar("R")


class RepeatedErrors:
    """Logs a request's error once, then the same error again only ten minutes later.

    Every request that fails logs why, but a store that stays broken fails every
    request alike: against a full store disk, each fsync of an agent checkpointing
    every second wrote the same line (3,600 an hour per agent, for as long as the
    disk stayed full). The commit loop's own failures are logged once already, and
    its success after them too (RetryLog). A line that comes again says how many
    times it was left out meanwhile. Only the newest MAX_KEPT distinct lines are
    remembered, so that errors naming many objects cannot grow this. A damaged or
    missing object is not one of these: each read it fails is logged (README).
    """

    REPEAT_AFTER = 600.0
    MAX_KEPT = 256

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._logged: dict[str, tuple[float, int]] = {}  # line: (logged at, left out since)

    def error(self, line: str) -> None:
        now = self._clock()
        logged = self._logged.pop(line, None)
        if logged is not None and now - logged[0] < self.REPEAT_AFTER:
            self._logged[line] = (logged[0], logged[1] + 1)
            return
        left_out = logged[1] if logged is not None else 0
        more = (
            f" (the same error {left_out} more times since it was last logged)" if left_out else ""
        )
        log.error("%s%s", line, more)
        self._logged[line] = (now, 0)
        if len(self._logged) > self.MAX_KEPT:
            del self._logged[next(iter(self._logged))]


_repeated = RepeatedErrors()


def _errno_of(exc: BaseException) -> int:
    if isinstance(exc, FsError):
        return exc.errno
    if isinstance(exc, FencedError):
        _repeated.error(str(exc))
        return errno.EROFS
    if isinstance(exc, NoSpaceError):
        _repeated.error(str(exc))
        return errno.ENOSPC
    if isinstance(exc, IntegrityError | FormatError | ObjectNotFoundError):
        log.error("I/O error: %s", exc)  # a damaged or missing object: each read says so
        return errno.EIO
    if isinstance(exc, StoreError | SealfsError):
        _repeated.error(f"I/O error: {exc}")
        return errno.EIO
    log.exception("unexpected error in a filesystem request", exc_info=exc)
    return errno.EIO


def _boundary(fn: Callable[P, Coroutine[Any, Any, R]]) -> Callable[P, Coroutine[Any, Any, R]]:
    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await fn(*args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except Exception as exc:
            raise pyfuse3.FUSEError(_errno_of(exc)) from None

    return wrapper


def _forget_changes(inodes: list[int], names: list[tuple[int, bytes]]) -> None:
    """Make the kernel ask again for the attributes of inodes a follower replayed, drop
    their pages, and look again for the names it changed.

    It kept a read-only mount's attributes for a second: a log the writer had appended
    to was read cut at its old size after the append was replayed. Attributes here:
    dropping pages waits for page locks a read in flight holds, and that read waits
    for this loop. The kernel drops a changed file's pages itself at its next read(2)
    (auto_inval_data), but an access to a page a program mapped is none: a mapping
    kept the old bytes for good. So pages are dropped too, mapped ones included, from
    a worker thread, while this loop answers the reads that hold them. Names go
    through pyfuse3's notification thread: the kernel takes the directory's lock to
    drop one, which a lookup waiting for this loop may hold. A name the kernel never
    cached is no error (ignore_enoent).
    """
    for ino in inodes:
        with contextlib.suppress(OSError):  # forgotten by the kernel meanwhile
            pyfuse3.invalidate_inode(ino, attr_only=True)
    for parent, name in names:
        pyfuse3.invalidate_entry_async(parent, name, ignore_enoent=True)
    if inodes:
        trio.lowlevel.spawn_system_task(_drop_pages, inodes)


class _PageDrops:
    """Whether worker threads may still have the kernel drop pages through the FUSE
    session, which pyfuse3.close() frees (see stop_dropping_pages); the lock is held
    while one does."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.closing = False


_drops = _PageDrops()


async def _drop_pages(inodes: list[int]) -> None:
    # Abandoned at the end of the loop: the kernel may wait for a page lock that a read
    # nobody answers any more holds (a loop stopped by a bug).
    await trio.to_thread.run_sync(_drop_pages_now, inodes, abandon_on_cancel=True)


def _drop_pages_now(inodes: list[int]) -> None:
    """Worker thread: the kernel's pages of inodes, mapped ones too (pyfuse3 lets go of
    the GIL while the kernel works)."""
    for ino in inodes:
        with _drops.lock:
            if _drops.closing:
                return
            with contextlib.suppress(OSError):
                pyfuse3.invalidate_inode(ino, attr_only=False)


def stop_dropping_pages(wait: float) -> None:
    """Before pyfuse3.close(): let a drop in the kernel end (up to wait seconds; at an
    unmount no file is open, so none waits for a read), and start no more, so that no
    thread uses the session once it is freed."""
    held = _drops.lock.acquire(timeout=wait)
    _drops.closing = True
    if held:
        _drops.lock.release()


class Operations(pyfuse3.Operations):
    """Requests from the kernel, answered by the engine."""

    supports_dot_lookup = True
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, volume: Volume, log_file: str | None = None) -> None:
        """log_file: where the daemon logs (None: its stderr), for status to name."""
        super().__init__()
        self.volume = volume
        self.log_file = log_file
        self._timeout = 1.0 if volume.read_only else 60.0
        self._dir_inodes: dict[int, int] = {}
        volume.on_followed = _forget_changes

    def _entry(self, attr: Attr) -> pyfuse3.EntryAttributes:
        entry = pyfuse3.EntryAttributes()
        entry.st_ino = attr.ino
        entry.generation = 0
        entry.entry_timeout = self._timeout
        entry.attr_timeout = self._timeout
        entry.st_mode = attr.mode
        entry.st_nlink = attr.nlink
        entry.st_uid = attr.uid
        entry.st_gid = attr.gid
        entry.st_rdev = attr.rdev
        entry.st_size = attr.size
        entry.st_blksize = IO_SIZE
        entry.st_blocks = attr.blocks
        entry.st_atime_ns = attr.atime_ns
        entry.st_mtime_ns = attr.mtime_ns
        entry.st_ctime_ns = attr.ctime_ns
        return entry

    def _file_info(self, fh: int) -> pyfuse3.FileInfo:
        # The kernel's page cache stays valid across opens: every change goes
        # through this mount. A read-only follower must revalidate.
        return pyfuse3.FileInfo(fh=fh, keep_cache=not self.volume.read_only)

    @_boundary
    async def lookup(
        self, parent_inode: int, name: bytes, ctx: Any = None
    ) -> pyfuse3.EntryAttributes:
        if name == b".":
            attr = await self.volume.getattr(parent_inode)
        elif name == b"..":
            attr = await self.volume.getattr(self.volume.parent_of(parent_inode))
        else:
            return self._entry(await self.volume.lookup(parent_inode, name))
        self.volume.note_lookup(attr.ino)
        return self._entry(attr)

    @_boundary
    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        await self.volume.forget(list(inode_list))

    @_boundary
    async def getattr(self, inode: int, ctx: Any = None) -> pyfuse3.EntryAttributes:
        return self._entry(await self.volume.getattr(inode))

    @_boundary
    async def setattr(
        self, inode: int, attr: Any, fields: Any, fh: int | None, ctx: Any
    ) -> pyfuse3.EntryAttributes:
        changed = await self.volume.setattr(
            inode,
            mode=attr.st_mode if fields.update_mode else None,
            uid=attr.st_uid if fields.update_uid else None,
            gid=attr.st_gid if fields.update_gid else None,
            size=attr.st_size if fields.update_size else None,
            atime_ns=attr.st_atime_ns if fields.update_atime else None,
            mtime_ns=attr.st_mtime_ns if fields.update_mtime else None,
        )
        return self._entry(changed)

    @_boundary
    async def readlink(self, inode: int, ctx: Any) -> bytes:
        return await self.volume.readlink(inode)

    @_boundary
    async def mknod(
        self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: Any
    ) -> pyfuse3.EntryAttributes:
        return self._entry(
            await self.volume.mknod(parent_inode, name, mode, rdev, ctx.uid, ctx.gid)
        )

    @_boundary
    async def mkdir(
        self, parent_inode: int, name: bytes, mode: int, ctx: Any
    ) -> pyfuse3.EntryAttributes:
        return self._entry(await self.volume.mkdir(parent_inode, name, mode, ctx.uid, ctx.gid))

    @_boundary
    async def unlink(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        await self.volume.unlink(parent_inode, name)

    @_boundary
    async def rmdir(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        await self.volume.rmdir(parent_inode, name)

    @_boundary
    async def symlink(
        self, parent_inode: int, name: bytes, target: bytes, ctx: Any
    ) -> pyfuse3.EntryAttributes:
        return self._entry(await self.volume.symlink(parent_inode, name, target, ctx.uid, ctx.gid))

    @_boundary
    async def rename(
        self,
        parent_inode_old: int,
        name_old: bytes,
        parent_inode_new: int,
        name_new: bytes,
        flags: int,
        ctx: Any,
    ) -> None:
        await self.volume.rename(parent_inode_old, name_old, parent_inode_new, name_new, flags)

    @_boundary
    async def link(
        self, inode: int, new_parent_inode: int, new_name: bytes, ctx: Any
    ) -> pyfuse3.EntryAttributes:
        return self._entry(await self.volume.link(inode, new_parent_inode, new_name))

    @_boundary
    async def open(self, inode: int, flags: int, ctx: Any) -> pyfuse3.FileInfo:
        # Only root is taken to hold CAP_FSETID: the request carries no capabilities.
        fh = await self.volume.open(inode, flags & ~KERNEL_FLAGS, kill_priv=ctx.uid != 0)
        return self._file_info(fh)

    @_boundary
    async def create(
        self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: Any
    ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        fh, attr = await self.volume.create(
            parent_inode, name, mode, flags & ~KERNEL_FLAGS, ctx.uid, ctx.gid
        )
        return self._file_info(fh), self._entry(attr)

    @_boundary
    async def read(self, fh: int, off: int, size: int) -> memoryview:  # type: ignore[override]
        # pyfuse3 replies from any contiguous buffer (its stub says bytes): a view of a
        # cached chunk goes to the kernel without a copy.
        return await self.volume.read(fh, off, size)

    @_boundary
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        return await self.volume.write(fh, off, buf)

    @_boundary
    async def flush(self, fh: int) -> None:
        if not self.volume.options.sync_on_close:
            # close() then waits for nothing, and the kernel handles locks itself (no
            # lock handlers): ENOSYS makes it stop sending FLUSH on this mount, one
            # request fewer per close(2) (cp -a of many small files: 1 in 10).
            raise pyfuse3.FUSEError(errno.ENOSYS)
        await self.volume.flush(fh)

    @_boundary
    async def release(self, fh: int) -> None:
        await self.volume.release(fh)

    @_boundary
    async def fsync(self, fh: int, datasync: bool) -> None:
        await self.volume.fsync()

    @_boundary
    async def opendir(self, inode: int, ctx: Any) -> int:
        fh = await self.volume.opendir(inode)
        self._dir_inodes[fh] = inode
        return fh

    @_boundary
    async def readdir(self, fh: int, start_id: int, token: Any) -> None:
        # Ids 0 and 1 are "." and ".." (no lookup counted, as pyfuse3 requires);
        # the engine's own indices follow, shifted by two.
        if start_id < 2:
            ino = self._dir_inodes[fh]
            dots = [(b".", ino), (b"..", self.volume.parent_of(ino))][start_id:]
            for offset, (name, dot_ino) in enumerate(dots, start=start_id + 1):
                attr = self._entry(await self.volume.getattr(dot_ino))
                if not pyfuse3.readdir_reply(token, name, attr, offset):
                    return
        start = max(0, start_id - 2)
        while True:  # a batch at a time: the reply buffer holds only so many
            batch = await self.volume.readdir(fh, start, READDIR_BATCH)
            for entry in batch:
                attr = self._entry(entry.attr)
                if not pyfuse3.readdir_reply(token, entry.name, attr, entry.next_index + 2):
                    return
                self.volume.note_lookup(entry.attr.ino)
            if len(batch) < READDIR_BATCH:
                return
            start = batch[-1].next_index

    @_boundary
    async def releasedir(self, fh: int) -> None:
        self._dir_inodes.pop(fh, None)
        await self.volume.releasedir(fh)

    @_boundary
    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        await self.volume.fsync()

    @_boundary
    async def statfs(self, ctx: Any) -> pyfuse3.StatvfsData:
        fs = await self.volume.statfs()
        out = pyfuse3.StatvfsData()
        out.f_bsize = out.f_frsize = fs.block_size
        out.f_blocks, out.f_bfree, out.f_bavail = fs.blocks, fs.blocks_free, fs.blocks_avail
        out.f_files, out.f_ffree, out.f_favail = fs.files, fs.files_free, fs.files_free
        out.f_namemax = fs.name_max
        return out

    @_boundary
    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx: Any) -> None:
        if inode == pyfuse3.ROOT_INODE and name == STATUS_XATTR:
            raise pyfuse3.FUSEError(errno.EPERM)
        if inode == pyfuse3.ROOT_INODE and name == REKEY_XATTR:
            if ctx.uid not in (0, os.getuid()):
                raise pyfuse3.FUSEError(errno.EPERM)  # only the mount's owner or root
            await self.volume.adopt_rekey(value)
            return
        await self.volume.setxattr(inode, name, value)
        if name == POSIX_ACL_ACCESS:
            # The engine applied it as a chmod, which the kernel does not know of (without
            # FUSE_POSIX_ACL it treats ACLs as opaque xattrs): its cached mode, used for
            # permission checks, must go. It holds nothing to drop if this fails.
            with contextlib.suppress(OSError):
                pyfuse3.invalidate_inode(inode, attr_only=True)

    @_boundary
    async def getxattr(self, inode: int, name: bytes, ctx: Any) -> bytes:
        if inode == pyfuse3.ROOT_INODE and name in (STATUS_XATTR, TAKE_KEY_XATTR):
            if name == TAKE_KEY_XATTR:
                if ctx.uid not in (0, os.getuid()):
                    raise pyfuse3.FUSEError(errno.EPERM)  # an unlock costs an Argon2id run
                await self.volume.take_new_key()
            status = await mounted_volume_status(self.volume) | {"log_file": self.log_file}
            return json.dumps(status).encode()
        return await self.volume.getxattr(inode, name)

    @_boundary
    async def listxattr(self, inode: int, ctx: Any) -> list[bytes]:
        # Only root is taken to hold CAP_SYS_ADMIN: the request carries no capabilities.
        return await self.volume.listxattr(inode, privileged=ctx.uid == 0)

    @_boundary
    async def removexattr(self, inode: int, name: bytes, ctx: Any) -> None:
        await self.volume.removexattr(inode, name)
