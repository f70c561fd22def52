"""LocalStore: each object is a file under a root directory (the embedded default).

Object "c/ab/xyz" lives at root/c/ab/xyz; parent directories are created lazily.
Every write goes to a hidden ".tmp-*" file in the target directory first and is
then renamed (put) or hard-linked (put_if_absent) into place, so readers never
see a partial object; put(replace=False) renames with RENAME_NOREPLACE (a hard
link where the file system lacks it). New objects written by put (chunks) are not fsynced one
by one: the store remembers which files it wrote and which directories' entries
it changed since the last sync() (puts come from several threads), and sync()
fdatasyncs exactly those files, then fsyncs each of those directories once, with
the parents of the directories it created. So a sync waits for this store's
writes only, not for whatever else is dirty on the file system. Above
SYNCFS_ABOVE paths it calls syncfs(2) once instead, unless the root is on a FUSE
file system, where syncfs flushes nothing. Exclusive creates and replacements
fdatasync their temp file before publishing it: their name may reach the disk
before the next sync (see put and put_if_absent). sealfs never removes a
directory of the store.

This module owns the mapping of OS errors to store errors; it never retries
(RetryingStore does) and knows nothing of what the bytes mean.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import os
import secrets
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sealfs.errors import (
    FormatError,
    NoSpaceError,
    ObjectExistsError,
    ObjectNotFoundError,
    PreconditionFailedError,
    StoreError,
    SyncFailedError,
    TransientStoreError,
)
from sealfs.store.base import (
    ObjectInfo,
    is_valid_name,
    object_too_large,
    validate_name,
    validate_prefix,
)
from sealfs.store.direct import DirectIOUnsupported, open_direct, write_direct
from sealfs.store.files import (
    FileTooLargeError,
    NotARegularFileError,
    is_stale_temp,
    make_dirs,
    read_regular_file,
    regular_file_etag,
    write_all,
)

log = logging.getLogger("sealfs.store")

# Hidden names: they never match validate_name, so list() can never return them.
TEMP_PREFIX = ".tmp-"
LOCK_NAME = ".lock"
_FILE_MODE = 0o600  # the header holds keyslots: keep offline guessing to the owner
_NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})
# Errors a local disk (or an NFS mount under it) may clear on its own.
_TRANSIENT = frozenset({errno.EAGAIN, errno.EBUSY, errno.ETIMEDOUT, errno.EINTR})
_MISSING = (FileNotFoundError, NotADirectoryError, IsADirectoryError)
_DENIED = frozenset({errno.EACCES, errno.EPERM})
# Above this many files and directories to flush, sync() calls syncfs(2) instead.
# Every fsync waits for a disk cache flush (and a journal commit), so flushing by
# path costs more the more paths there are; syncfs costs one commit, plus writing
# back everything else that is dirty on the file system, whoever wrote it.
# Measured with benchmarks/sync_threshold.py (docs/design.md, "Local store").
SYNCFS_ABOVE = 64
FLUSH_INLINE = 4  # up to this many paths, flushed one after the other in the caller's thread
FLUSH_THREADS = 16  # beyond it, flushes in flight at once
# Objects at least this big are written and read with O_DIRECT (sealfs.store.direct says
# why). Below it a direct write's wait for the device costs more than the page cache saves.
DIRECT_FROM = 256 << 10


def _libc_function(name: str, *argtypes: type) -> Callable[..., int] | None:
    """libc's function name, returning an int, or None where the C library lacks it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # the C library the interpreter runs on
    except OSError:
        return None
    fn = getattr(libc, name, None)
    if fn is None:
        return None
    fn.argtypes = list(argtypes)
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


# statfs(2)'s f_type of every FUSE file system (sshfs, gocryptfs, rclone, sealfs...).
FUSE_SUPER_MAGIC = 0x65735546


_fstatfs = _libc_function("fstatfs", ctypes.c_int, ctypes.c_char_p)


def syncfs_reaches(fd: int) -> bool:
    """Whether syncfs(2) flushes the file system fd is on: not a FUSE one.

    The kernel passes syncfs on to no FUSE file system but virtiofs, and returns
    success without writing anything there; fsync and fdatasync do reach it.
    """
    if _fstatfs is None:
        return True
    buf = ctypes.create_string_buffer(256)  # struct statfs: f_type (a long) comes first
    if _fstatfs(fd, buf) != 0:
        return True  # cannot tell: as before
    return ctypes.c_ulong.from_buffer(buf).value & 0xFFFFFFFF != FUSE_SUPER_MAGIC


# Module-level so that tests can exercise the os.sync fallback and watch the calls.
_syncfs = _libc_function("syncfs", ctypes.c_int)
_fdatasync = os.fdatasync
_fsync = os.fsync


def _unlink_quietly(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


_renameat2 = _libc_function(
    "renameat2", ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint
)
_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
# What renameat2 fails with where the kernel or the file system cannot keep RENAME_NOREPLACE.
_NO_NOREPLACE = frozenset({errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP})


def _rename_noreplace(src: Path, dst: Path) -> None:
    """Rename src to dst unless dst exists (FileExistsError).

    One step where renameat2 keeps RENAME_NOREPLACE; else a hard link, which creates
    as exclusively, and the removal of src.
    """
    if _renameat2 is not None:
        done = _renameat2(
            _AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE
        )
        if done == 0:
            return
        err = ctypes.get_errno()
        if err not in _NO_NOREPLACE:
            raise OSError(err, os.strerror(err), str(dst))
    os.link(src, dst)
    _unlink_quietly(src)  # a leftover temp file is a crash leftover: removed at a mount


def _dir_id(path: Path) -> tuple[int, int] | None:
    """(device, inode) of a directory, or None if there is none at path."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def _same_device(path: Path, device: int) -> bool:
    try:
        return os.lstat(path).st_dev == device
    except OSError:
        return False


def _may_hold(dir_name: str, prefix: str, start_after: str) -> bool:
    """Whether some name under directory dir_name can match prefix and sort after start_after."""
    under = dir_name + "/"
    if not (prefix.startswith(under) or under.startswith(prefix)):
        return False
    # Every name under the directory sorts before start_after unless start_after
    # is itself inside it or sorts before the directory.
    return start_after < under or start_after.startswith(under)


def _walk(directory: Path, rel: str, prefix: str, start_after: str, out: list[str]) -> None:
    """Append to out the object names under directory (named rel) that match."""
    try:
        entries = os.scandir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return
    with entries:
        for entry in entries:
            if not is_valid_name(entry.name):
                continue  # temp files, the lock file, strays
            full = f"{rel}/{entry.name}" if rel else entry.name
            if entry.is_dir(follow_symlinks=False):
                if _may_hold(full, prefix, start_after):
                    _walk(Path(entry.path), full, prefix, start_after, out)
            elif full.startswith(prefix) and full > start_after and entry.is_file():
                out.append(full)


class _Unsynced:
    """The files written and the directories changed since the last sync, and the size of
    each object created since then (to check that it is still there). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.files: set[str] = set()
        self.dirs: set[str] = set()
        self.created: dict[str, int] = {}
        # What this store did since the last take to a path: the size it holds now, or
        # None if deleted. A sync in flight checks what it took against this, not the
        # sizes it took: a delete or a re-seal may land while it flushes.
        self.changed: dict[str, int | None] = {}

    def add(self, file: str | None, directory: str, created: tuple[str, int] | None) -> None:
        with self._lock:
            if file is not None:
                self.files.add(file)
            self.dirs.add(directory)
            if created is not None:
                self.created[created[0]] = created[1]
                self.changed[created[0]] = created[1]

    def replaced(self, path: str, size: int) -> None:
        """path, created since the last sync, was replaced (a rekey re-sealed it)."""
        with self._lock:
            if path in self.created:
                self.created[path] = size
            self.changed[path] = size

    def removed(self, path: str) -> None:
        """path was deleted by this store: nothing is expected of it any more."""
        with self._lock:
            self.created.pop(path, None)
            self.changed[path] = None

    def take(self) -> tuple[set[str], set[str], dict[str, int]]:
        """Everything recorded so far, leaving the record empty."""
        with self._lock:
            taken = self.files, self.dirs, self.created
            self.files, self.dirs, self.created = set(), set(), {}
            self.changed = {}
        return taken

    def expected(self, path: str, size: int) -> int | None:
        """The size path, taken with size, should have now (None: this store deleted it)."""
        with self._lock:
            return self.changed.get(path, size)

    def give_back(self, files: set[str], dirs: set[str], created: dict[str, int]) -> None:
        """Put back what a failed sync took, so that the next sync covers it again."""
        with self._lock:
            self.files |= files
            self.dirs |= dirs
            # What came since is newer; what was deleted since expects nothing.
            kept = {path: self.changed.get(path, size) for path, size in created.items()}
            mine = {path: size for path, size in kept.items() if size is not None}
            self.created = {**mine, **self.created}


class LocalStore:
    """An ObjectStore in a local directory. Thread-safe and safe across processes.

    Raises ObjectNotFoundError, ObjectExistsError, PreconditionFailedError,
    NoSpaceError (disk or quota full), TransientStoreError (EAGAIN-like errors)
    or StoreError (any other OS error), each with a one-line message. Never retries.
    """

    def __init__(self, root: Path, *, direct_reads: bool = True) -> None:
        """direct_reads: read large objects past the page cache. A read-only mount
        turns it off: it drops the kernel's cache of its files at every open (to see
        the writer's changes), so the page cache of the chunk files is the only one
        its re-reads find beyond the daemon's own."""
        # Absolute: a mount's daemon leaves the directory it was started from.
        self.root = Path(os.path.abspath(root))
        self._unsynced = _Unsynced()
        self._sync_lock = threading.Lock()  # one sync at a time: a later one waits for it
        self._sync_failed: SyncFailedError | None = None  # then every later sync fails too
        # Directories whose own entry (in their parent) is known to be durable.
        self._durable_dirs: set[str] = set()
        self._top = os.path.dirname(os.path.abspath(self.root))  # holds the root's own entry
        self._root_id = _dir_id(self.root)  # None until init makes the root
        # Resolved once: the status of a mount gives it on the FUSE event loop, where a
        # path walk on a slow disk would hold every request; and writes stay in the
        # directory found here (_check_root), whatever a symlink names later.
        self._location = f"local store at {os.path.realpath(self.root)}"
        self._direct = True  # until the file system refuses O_DIRECT
        self._direct_reads = direct_reads
        self._syncfs_works: bool | None = None  # known at the first sync
        self._direct_lock = threading.Lock()
        # Held across a delete or a replacement and its record in _unsynced, so that a
        # sync's check never sees the one without the other.
        self._changing = threading.Lock()

    def _written(self, path: Path, *, file: bool = True, created: int | None = None) -> None:
        """Remember that path's directory entry changed (and, if file, its data) for sync();
        created: the size of the object that path newly holds, for sync() to check."""
        full = os.path.abspath(path)
        made = None if created is None else (full, created)
        self._unsynced.add(full if file else None, os.path.dirname(full), made)

    def _path(self, name: str) -> Path:
        return self.root / validate_name(name)

    def _error(self, exc: OSError, what: str, *, reading: bool = False) -> StoreError:
        """The StoreError for exc; reading: a read or a listing, which a read-only mount
        needs too (so "mount it --read-only" is no fix for its EACCES)."""
        if exc.errno in _NO_SPACE:
            # Deleting files inside the volume frees nothing there (nothing is collected
            # yet), which "free space and retry" left users to find out.
            return NoSpaceError(
                f"store disk full at {self.root}: free space on the disk that holds it (deleting"
                " files in the volume frees none) and retry"
            )
        reason = exc.strerror or type(exc).__name__
        message = f"local store at {self.root}: {what} failed: {reason}"
        if exc.errno in _DENIED and reading:
            message += ": run sealfs as a user who may read the store (its owner, or root)"
        elif exc.errno in _DENIED:  # most often a mount or init run as the wrong user
            message += (
                ": run sealfs as a user who may read and write the store (one who may only"
                " read it can mount it --read-only)"
            )
        if exc.errno in _TRANSIENT:
            return TransientStoreError(message)
        return StoreError(message)

    def _flush_failed(self, exc: OSError, what: str) -> SyncFailedError:
        reason = exc.strerror or type(exc).__name__
        return SyncFailedError(
            f"local store at {self.root}: {what} failed ({reason}): objects written since"
            " the last commit may not be on disk, so sealfs commits nothing more through"
            " this store (a mount turns read-only); check the disk, then mount again"
        )

    def _not_regular(self, name: str) -> FormatError:
        return FormatError(
            f"object {name} in {self.describe()} is not a regular file (a FIFO, device"
            " or socket, which sealfs never writes): remove it, then restore the object"
            " from a copy of the store"
        )

    def _not_found(self, name: str) -> ObjectNotFoundError:
        return ObjectNotFoundError(f"object {name} not found in {self.describe()}")

    def _write_temp(self, path: Path, name: str, data: bytes, *, durable: bool = False) -> Path:
        """Write data to a new hidden temp file beside path; remove it again on failure.

        durable: flush the bytes before returning, for a temp file whose name
        may become durable before the next sync (see put and put_if_absent).
        """
        self._check_root()
        tmp = path.parent / f"{TEMP_PREFIX}{secrets.token_hex(8)}"
        try:
            fd, direct = self._create(tmp, direct=self._direct and len(data) >= DIRECT_FROM)
            try:
                self._write_new(fd, data, direct=direct)
                if durable:
                    _fdatasync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            _unlink_quietly(tmp)
            raise self._error(exc, f"write {name}") from exc
        return tmp

    def _create(self, tmp: Path, *, direct: bool) -> tuple[int, bool]:
        """Create tmp; (descriptor, whether it was opened with O_DIRECT)."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        try:
            return self._open_new(tmp, flags, direct)
        except FileNotFoundError:
            self._make_dirs(tmp.parent)  # directories come lazily
            return self._open_new(tmp, flags, direct)

    def _open_new(self, path: Path, flags: int, direct: bool) -> tuple[int, bool]:
        if direct:
            try:
                return open_direct(str(path), flags, _FILE_MODE), True
            except DirectIOUnsupported as exc:
                self._no_direct(exc)
        return os.open(path, flags, _FILE_MODE), False

    def _write_new(self, fd: int, data: bytes, *, direct: bool) -> None:
        """Write data into a new, empty file (past the page cache, if it was opened so)."""
        if direct:
            try:
                write_direct(fd, data)
            except DirectIOUnsupported as exc:
                self._no_direct(exc)
            else:
                return
        write_all(fd, data)

    def _no_direct(self, exc: DirectIOUnsupported) -> None:
        with self._direct_lock:  # puts come from several threads: one line, not one each
            if not self._direct:
                return
            self._direct = False
            log.info(
                "local store at %s: the file system refuses O_DIRECT (%s);"
                " writing through the page cache",
                self.root,
                exc,
            )

    def _make_dirs(self, path: Path) -> None:
        """mkdir -p, remembering the highest directory made above the root: its entry
        must be flushed too, or a volume created under a new path can vanish whole in
        a power cut right after init (sync used to stop at the root's parent).

        Never remakes a root that went away or was replaced (its disk unmounted):
        objects would go on into a new, empty directory on whatever file system is
        underneath, and fsync would report commits that the store never sees.
        """
        self._check_root()
        highest = make_dirs(path, self.root)
        holder = os.path.dirname(os.path.abspath(highest))
        if self._top.startswith(os.path.join(holder, "")):  # made above the root's parent
            self._top = holder
        if self._root_id is None:
            self._root_id = _dir_id(self.root)

    def _check_root(self) -> None:
        """Raise StoreError if the root is no longer the directory this store started with.

        Checked before every change, not only where directories are made: a root
        replaced by another volume's store (another disk mounted on the path, a
        symlink pointed elsewhere) already has l/ and c/ directories, and a commit
        went into that volume, corrupting it, while fsync reported success here.
        """
        if self._root_id is not None and _dir_id(self.root) != self._root_id:
            raise StoreError(
                f"local store at {self.root}: the store directory is gone or was replaced"
                " (its disk unmounted?): nothing is written until the same directory is"
                " back at that path"
            )

    def get(self, name: str, max_size: int | None = None) -> bytes:
        """Return the object's bytes. Raises ObjectNotFoundError."""
        path = self._path(name)
        direct = self._direct and self._direct_reads
        try:
            return read_regular_file(path, max_size, direct_from=DIRECT_FROM if direct else None)
        except _MISSING:
            raise self._not_found(name) from None
        except FileTooLargeError as exc:
            assert max_size is not None
            raise object_too_large(name, exc.size, max_size, self.describe()) from None
        except NotARegularFileError:
            raise self._not_regular(name) from None
        except OSError as exc:
            raise self._error(exc, f"read {name}", reading=True) from exc

    def stat(self, name: str) -> ObjectInfo:
        """Return size and etag (hex SHA-256: this reads the object). Raises ObjectNotFoundError."""
        size, etag = self._etag(name)
        return ObjectInfo(name=name, size=size, etag=etag)

    def _etag(self, name: str) -> tuple[int, str]:
        """Size and etag, hashed a block at a time: never the whole object in memory."""
        try:
            return regular_file_etag(self._path(name))
        except _MISSING:
            raise self._not_found(name) from None
        except NotARegularFileError:
            raise self._not_regular(name) from None
        except OSError as exc:
            raise self._error(exc, f"read {name}", reading=True) from exc

    def put(self, name: str, data: bytes, *, replace: bool = True) -> None:
        """Create or replace the object atomically (temp file, then rename).

        replace=False: see _create_only.

        A replacement flushes the new bytes before the rename: a crash could
        otherwise keep the rename and lose the bytes, and the object (a header,
        a chunk a rekey re-sealed) would be empty where it used to be whole.
        ext4 happens to flush on such renames; other file systems need not.
        """
        path = self._path(name)
        if not replace:
            self._create_only(path, name, data)
            return
        replacing = os.path.lexists(path)
        tmp = self._write_temp(path, name, data, durable=replacing)
        with self._changing if replacing else contextlib.nullcontext():
            try:
                os.replace(tmp, path)
            except OSError as exc:
                _unlink_quietly(tmp)
                raise self._error(exc, f"rename into {name}") from exc
            if replacing:
                self._unsynced.replaced(os.path.abspath(path), len(data))
        # A replaced object (the header) may be replaced again by another process (a key
        # change) before the next sync: only a new one is this store's to check.
        self._written(path, created=None if replacing else len(data))

    def _create_only(self, path: Path, name: str, data: bytes) -> None:
        """Create the object unless it exists; its bytes are flushed at the next sync.

        Raises ObjectExistsError, and then makes the next sync flush the object found,
        which a process that died before its sync may have written.
        """
        tmp = self._write_temp(path, name, data)
        try:
            _rename_noreplace(tmp, path)
        except FileExistsError:
            _unlink_quietly(tmp)
            self._written(path)
            raise ObjectExistsError(f"object {name} already exists in {self.describe()}") from None
        except OSError as exc:
            _unlink_quietly(tmp)
            raise self._error(exc, f"rename into {name}") from exc
        self._written(path, created=len(data))

    def put_if_absent(self, name: str, data: bytes) -> None:
        """Create the object unless it exists (hard link: an atomic exclusive create).

        Raises ObjectExistsError. The bytes are flushed before the link: the new
        name (a log segment) may reach the disk with a later journal commit
        that someone else's fsync forces, and an empty newest segment would
        make the volume fail to mount.
        """
        path = self._path(name)
        tmp = self._write_temp(path, name, data, durable=True)
        try:
            os.link(tmp, path)
        except FileExistsError:
            # Maybe written by a process that died before syncing it: the caller
            # may now rely on it (identical bytes are its own), so sync it too.
            self._written(path)
            raise ObjectExistsError(f"object {name} already exists in {self.describe()}") from None
        except OSError as exc:
            raise self._error(exc, f"link into {name}") from exc
        finally:
            _unlink_quietly(tmp)
        # Its bytes are on disk already; its entry is not.
        self._written(path, file=False, created=len(data))

    def put_if_match(self, name: str, data: bytes, etag: str) -> None:
        """Replace the object if its etag is still etag, under an exclusive flock on root/.lock.

        Raises PreconditionFailedError, or ObjectNotFoundError if it is missing.
        """
        validate_name(name)
        with self._exclusive_lock(name):
            if self._etag(name)[1] != etag:
                raise PreconditionFailedError(f"object {name} changed since etag {etag[:12]}")
            self.put(name, data)

    @contextlib.contextmanager
    def _exclusive_lock(self, name: str) -> Iterator[None]:
        # flock locks belong to the open file description, so this excludes
        # other threads of this process as well as other processes.
        try:
            fd = os.open(self.root / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, _FILE_MODE)
        except FileNotFoundError:
            raise self._not_found(name) from None  # no root yet, so no object
        except OSError as exc:
            raise self._error(exc, "open lock file") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def delete(self, name: str) -> None:
        """Delete the object; a missing object is not an error."""
        path = self._path(name)
        self._check_root()
        with self._changing:
            try:
                os.unlink(path)
            except _MISSING:
                return
            except OSError as exc:
                raise self._error(exc, f"delete {name}") from exc
            self._unsynced.removed(os.path.abspath(path))
        self._written(path, file=False)

    def list(self, prefix: str, start_after: str = "") -> list[str]:
        """Sorted names under prefix after start_after; walks only directories prefix can match."""
        validate_prefix(prefix)
        head, _, _ = prefix.rpartition("/")
        names: list[str] = []
        try:
            _walk(self.root / head, head, prefix, start_after, names)
        except OSError as exc:
            raise self._error(exc, f"list {prefix!r}", reading=True) from exc
        names.sort()
        return names

    def sync(self) -> None:
        """Make every earlier put, put_if_absent and delete durable, directory entries included.

        fdatasyncs the files written since the last sync and fsyncs the
        directories whose entries changed (and the parents of new ones); above
        SYNCFS_ABOVE paths, one syncfs(2) of the root's file system instead.
        Raises SyncFailedError if a flush itself fails, or an object created since
        the last sync is gone or of another size once flushed (the file system lost
        it), and again at every later sync: the kernel may have dropped what it
        could not write, so a later success would not prove those objects reached
        the disk. Other failures
        (opening a path) raise StoreError and hand the paths to the next sync.
        Never retries.
        """
        with self._sync_lock:
            if self._sync_failed is not None:
                raise self._sync_failed
            files, dirs, created = self._unsynced.take()
            try:
                self._check_root()  # else the paths name another store's files, or none
                self._sync_paths(files, dirs)
                self._check_created(created)
            except SyncFailedError as exc:
                self._sync_failed = exc
                raise
            except BaseException:
                self._unsynced.give_back(files, dirs, created)
                raise

    def _check_created(self, created: dict[str, int]) -> None:
        """Raise SyncFailedError unless every object created since the last sync is still
        there, whole, now that it was flushed.

        A flush finds nothing to do for a path that is gone, and flushes a file emptied
        by the file system as readily as a whole one. Both are what a power cut of the
        store's disk leaves of objects not yet flushed, when the disk comes back (is
        mounted again) while the mount lives: the objects' bytes are no longer in memory,
        and the next commit published a segment naming chunks that were lost, its fsync
        reporting success. Checked after the flush: an object still whole then was
        flushed whole, and survives a cut that comes later.
        """
        for path, taken in sorted(created.items()):
            found = self._size(path)
            if found == taken:
                continue
            with self._changing:  # a delete or a re-seal of it since the take is no loss
                size = self._unsynced.expected(path, taken)
                if size is None:
                    continue
                found = self._size(path)
            if found != size:
                now = "gone" if found is None else f"{found} bytes, not {size}"
                raise SyncFailedError(
                    f"local store at {self.root}: {self._relative(path)}, written since the"
                    f" last commit, is {now}: the store's file system lost writes (its disk"
                    " cut off, then mounted again?), so sealfs commits nothing more through"
                    " this store (a mount turns read-only); check the disk, then mount again"
                )

    def _size(self, path: str) -> int | None:
        """path's size, None if it is gone."""
        try:
            return os.stat(path).st_size
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise self._error(exc, f"stat {self._relative(path)} after sync") from exc

    def _sync_paths(self, files: set[str], dirs: set[str]) -> None:
        dirs = self._with_new_parents(dirs)
        if not self._syncfs_reaches_disk():
            # Nor may syncfs stand in for a path we may not open (the directory holding
            # the root, on sshfs): that one is skipped, every other one flushed.
            self._flush_all(sorted(files), sorted(dirs), skip_denied=True)
        elif len(files) + len(dirs) > SYNCFS_ABOVE:
            self._syncfs()
        else:
            try:
                self._flush_all(sorted(files), sorted(dirs))
            except PermissionError:
                self._syncfs()  # a parent above the root we may not open
        self._durable_dirs |= dirs

    def _syncfs_reaches_disk(self) -> bool:
        """Whether the root's file system honours syncfs(2). On a FUSE file system (a
        store on sshfs, gocryptfs or another sealfs mount) syncfs is a no-op: a commit
        of more than SYNCFS_ABOVE paths then made its segment durable and not its
        chunks, and a power cut of the disk below lost them."""
        if self._syncfs_works is None:
            try:
                fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError:
                return True  # not made yet: nothing to flush; asked again next time
            try:
                self._syncfs_works = syncfs_reaches(fd)
            finally:
                os.close(fd)
            if not self._syncfs_works:
                log.info("local store at %s is on a FUSE file system: synced by path", self.root)
        return self._syncfs_works

    def _flush_all(
        self, files: Sequence[str], dirs: Sequence[str], *, skip_denied: bool = False
    ) -> None:
        """fdatasync the files, then fsync the directories; raises the first error
        (skip_denied: but for paths we may not open, left as they are).

        Each flush waits for a journal commit or a disk cache flush. A few are
        cheapest one after the other; more run FLUSH_THREADS at a time, so that
        they share commits and cache flushes instead of queueing for their own.
        """
        jobs = [(files, os.O_RDONLY, _fdatasync), (dirs, os.O_RDONLY | os.O_DIRECTORY, _fsync)]
        if len(files) + len(dirs) <= FLUSH_INLINE:
            for paths, flags, flush in jobs:
                for path in paths:
                    self._flush(path, flags, flush, skip_denied)
            return
        with ThreadPoolExecutor(FLUSH_THREADS, thread_name_prefix="sealfs-sync") as pool:
            for paths, flags, flush in jobs:  # every file before any directory
                futures = [
                    pool.submit(self._flush, path, flags, flush, skip_denied) for path in paths
                ]
                for future in futures:
                    future.result()

    def _with_new_parents(self, dirs: set[str]) -> set[str]:
        """dirs plus the parents of those that may be new, up to the one holding the root.

        A directory made since the last sync (by mkdir in _create) is a new entry
        in its parent, which must be flushed too. A directory flushed once stays
        (nothing removes them), so its own entry is durable and its parents need
        nothing.
        """
        out: set[str] = set()
        for changed in dirs:
            out.add(changed)
            path = changed
            while path not in self._durable_dirs and path != self._top:
                path = os.path.dirname(path)
                if path in out:
                    break  # its parents were walked already
                out.add(path)
        return out

    def _flush(
        self, path: str, flags: int, flush: Callable[[int], None], skip_denied: bool = False
    ) -> None:
        """Open path and flush it; a path removed since needs nothing.

        Raises PermissionError as it is (the caller falls back to syncfs), unless
        skip_denied (where syncfs would do nothing): then the path is left as it is.
        """
        try:
            fd = os.open(path, flags | os.O_CLOEXEC)
        except FileNotFoundError:
            return
        except PermissionError:
            if skip_denied:
                log.debug("sync: may not open %s, left unsynced", path)
                return
            raise
        except OSError as exc:
            raise self._error(exc, f"open {self._relative(path)} for sync") from exc
        try:
            flush(fd)
        except OSError as exc:
            raise self._flush_failed(exc, f"fsync of {self._relative(path)}") from exc
        finally:
            os.close(fd)

    def _relative(self, path: str) -> str:
        return os.path.relpath(path, self.root)

    def _syncfs(self) -> None:
        """One syncfs(2) on the root's file system (os.sync where libc lacks syncfs)."""
        try:
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            return  # nothing was ever written
        except OSError as exc:
            raise self._error(exc, "open root for sync") from exc
        try:
            if _syncfs is None:
                os.sync()
            elif _syncfs(fd) != 0:
                err = ctypes.get_errno()
                raise self._flush_failed(OSError(err, os.strerror(err)), "syncfs")
        finally:
            os.close(fd)

    def remove_crash_leftovers(self, older_than: float) -> int:
        """Remove temp files left by a crash: dated more than older_than seconds from now.

        Returns how many were removed. Younger ones may belong to a live writer.
        One dated that far in the future is a leftover too: it was written before
        the clock was set back (a VM that booted with its clock ahead, then NTP),
        and would otherwise stay until the clock caught up, years for a bad clock.
        Looks in the root and the directories named as objects are, on the root's
        file system only: nothing else under the root is the store's.
        """
        removed = 0
        try:
            device = os.stat(self.root).st_dev  # the root may be a symlink to the store
        except FileNotFoundError:
            return 0
        for dirpath, dirs, files in os.walk(self.root):
            # Only where objects are written: directories named as object names are, on
            # the store's own file system. Not into whatever else lies under the root (a
            # plaintext view or another disk mounted there), whose own files were removed.
            dirs[:] = [
                d for d in dirs if is_valid_name(d) and _same_device(Path(dirpath) / d, device)
            ]
            for file in files:
                if file.startswith(TEMP_PREFIX) and self._remove_if_stale(
                    Path(dirpath) / file, older_than
                ):
                    removed += 1
        return removed

    def _remove_if_stale(self, path: Path, older_than: float) -> bool:
        try:
            if not is_stale_temp(path.lstat().st_mtime, older_than):
                return False
            path.unlink()
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise self._error(exc, f"remove temp file {path.name}") from exc
        return True

    def free_bytes(self) -> int:
        """Bytes available to this user on the root's file system (0 if it is missing)."""
        path = self.root
        while not path.exists() and path != path.parent:
            path = path.parent
        try:
            st = os.statvfs(path)
        except OSError:
            return 0
        return st.f_bavail * st.f_frsize

    def location(self) -> str:
        """The root's real path: one directory, however a symlink named it."""
        return self._location

    def describe(self) -> str:
        """Return "local store at ROOT"."""
        return f"local store at {self.root}"

    def close(self) -> None:
        """Nothing to release: no descriptor outlives a call."""
