"""CachingStore: a read-through, write-through disk cache of chunk objects.

Only names under "c/" are cached: a chunk's content never changes, and the one
replacement of a chunk (a rekey re-sealing it in place) goes through this
store, which updates the copy. A fetch that a write overlaps does not fill the
cache (it may hold the bytes from before the write). The header, log segments
and snapshots always go to the store. The cache holds exactly the sealed
bytes the store holds (file cache_dir/c/ab/id for object c/ab/id), never
plaintext. Size is bounded by LRU eviction, counting what each file takes on
disk (whole blocks, as du counts), not its length; the index (sizes and
access order) lives in memory and is rebuilt from the directory, ordered by
mtime, on start.

A cache failure never fails an operation: a cache write that fails (a full
disk, any OSError) logs a warning (at most one per ten minutes) and the
operation carries on uncached; a cached file that reads back with the wrong
length is dropped and fetched again.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import stat
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from sealfs.errors import ConfigError, FormatError, IntegrityError, SealfsError
from sealfs.store.base import (
    ObjectInfo,
    ObjectStore,
    StoreWrapper,
    is_valid_name,
    validate_name,
)
from sealfs.store.files import (
    PRIVATE_DIR_MODE,
    is_stale_temp,
    make_dirs,
    read_regular_file,
    write_all,
)

log = logging.getLogger("sealfs.store")

CACHED_PREFIX = "c/"
TEMP_PREFIX = ".tmp-"
_STALE_TEMP_AGE = 3600.0  # younger temp files may belong to another live process
_WARN_INTERVAL = 600.0  # a full cache disk fails every write: say so once, not per chunk


def is_cached_name(name: str) -> bool:
    """Whether objects of this name are cached (chunks only)."""
    return name.startswith(CACHED_PREFIX)


class CachingStore(StoreWrapper):
    """Wrap an ObjectStore with a bounded on-disk cache of chunks. Thread-safe.

    Raises what the inner store raises; never raises because of the cache,
    except ConfigError from the constructor when cache_dir cannot be created or
    written.
    """

    def __init__(
        self, inner: ObjectStore, cache_dir: Path, max_bytes: int, private_root: Path | None = None
    ) -> None:
        """private_root: the highest directory to make the owner's only if missing (the
        cache directory when None); those above it are made as mkdir -p makes them."""
        self.inner = inner
        self.cache_dir = Path(os.path.abspath(cache_dir))  # the daemon changes directory
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        # Fetches in flight per name, and the names a write overlapped while fetched.
        self._fills: Counter[str] = Counter()
        self._stale: set[str] = set()
        # name -> (length, bytes it takes on disk), oldest first
        self._entries: OrderedDict[str, tuple[int, int]] = OrderedDict()
        self._total = 0
        self._last_warning: float | None = None
        try:
            make_dirs(self.cache_dir, Path(os.path.abspath(private_root or cache_dir)))
        except OSError as exc:
            raise ConfigError(
                f"cannot create cache directory {self.cache_dir}: {exc.strerror}: choose"
                " another with --cache-dir"
            ) from exc
        if not os.access(self.cache_dir, os.W_OK | os.X_OK):
            # Taken before: every fill failed, with one warning in the daemon's log per
            # ten minutes and "disk cache 0 B" in status (a directory left by root, say).
            raise ConfigError(
                f"cache directory {self.cache_dir} is not writable by you: make it yours"
                " (chown) or choose another with --cache-dir"
            )
        self._rebuild()

    def cache_bytes(self) -> int:
        """What the cached objects take on disk."""
        with self._lock:
            return self._total

    def _path(self, name: str) -> Path:
        return self.cache_dir / validate_name(name)

    # -- index -------------------------------------------------------------

    def _rebuild(self) -> None:
        """Index the files already in the cache, least recently used (oldest mtime) first."""
        found: list[tuple[float, str, int, int]] = []
        root = self.cache_dir / CACHED_PREFIX.rstrip("/")
        for dirpath, _dirs, files in os.walk(root):
            _owner_only(Path(dirpath))
            for file in files:
                path = Path(dirpath) / file
                try:
                    st = path.lstat()
                    if file.startswith(TEMP_PREFIX):
                        if is_stale_temp(st.st_mtime, _STALE_TEMP_AGE):
                            path.unlink()  # left by a crash
                        continue
                except OSError:
                    continue
                name = path.relative_to(self.cache_dir).as_posix()
                if is_valid_name(name) and is_cached_name(name):
                    found.append((st.st_mtime, name, st.st_size, _footprint(st)))
        found.sort()
        with self._lock:
            for _mtime, name, size, footprint in found:
                self._entries[name] = (size, footprint)
                self._total += footprint
            self._evict_locked()

    def _evict_locked(self) -> None:
        while self._total > self.max_bytes and self._entries:
            name, (_, footprint) = self._entries.popitem(last=False)
            self._total -= footprint
            with contextlib.suppress(OSError):
                os.unlink(self.cache_dir / name)

    def _forget(self, name: str) -> None:
        with self._lock:
            self._overlap_fetches(name)
            entry = self._entries.pop(name, None)
            if entry is None:
                return
            self._total -= entry[1]
            with contextlib.suppress(OSError):
                os.unlink(self.cache_dir / name)

    def discard(self, name: str) -> None:
        """Drop the cached copy of name, if any (e.g. after it failed authentication)."""
        if is_cached_name(name):
            self._forget(validate_name(name))

    # -- cache I/O ---------------------------------------------------------

    def _read_cached(self, name: str, max_size: int | None) -> bytes | None:
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                return None
            self._entries.move_to_end(name)
            size = entry[0]
        path = self._path(name)
        try:
            data = read_regular_file(path, max_size)
        except OSError as exc:  # a FIFO or device left in the cache too: fetched again
            if not isinstance(exc, FileNotFoundError):
                log.warning("cache read of %s failed: %s; fetching from the store", name, exc)
            self._forget(name)
            return None
        if len(data) != size:
            log.warning("cached %s has %d bytes, not %d; dropping it", name, len(data), size)
            self._forget(name)
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # so that the LRU order survives a restart
        return data

    def _store(self, name: str, data: bytes, *, fill: bool = False) -> None:
        """Put a copy in the cache; on any OSError, warn (see _warn_write_failed) and carry
        on uncached.

        fill: data was fetched by get, and is dropped if a write overlapped that fetch.
        """
        size = len(data)
        if size > self.max_bytes:
            return
        path = self._path(name)
        tmp = path.parent / f"{TEMP_PREFIX}{secrets.token_hex(8)}"
        try:
            footprint = _write_file(tmp, data, self.cache_dir)
            if footprint > self.max_bytes:  # its blocks alone pass the bound
                os.unlink(tmp)
                return
            with self._lock:
                if fill and name in self._stale:
                    os.unlink(tmp)  # a write overlapped this fetch: the data may be older
                    return
                os.replace(tmp, path)
                old = self._entries.pop(name, None)
                self._total += footprint - (old[1] if old is not None else 0)
                self._entries[name] = (size, footprint)
                self._evict_locked()
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            self._warn_write_failed(exc)

    def _warn_write_failed(self, exc: OSError) -> None:
        now = time.monotonic()
        with self._lock:
            if self._last_warning is not None and now - self._last_warning < _WARN_INTERVAL:
                return
            self._last_warning = now
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            log.warning("cache disk full at %s; continuing without caching", self.cache_dir)
        else:
            reason = exc.strerror or type(exc).__name__
            log.warning(
                "cache write failed at %s: %s; continuing without caching", self.cache_dir, reason
            )

    # -- ObjectStore -------------------------------------------------------

    def get(self, name: str, max_size: int | None = None) -> bytes:
        """Return a chunk from the cache if there, else from the store (and cache it)."""
        if not is_cached_name(name):
            return self.inner.get(name, max_size)
        validate_name(name)
        data = self._read_cached(name, max_size)
        if data is None:
            with self._lock:
                self._fills[name] += 1
            try:
                data = self.inner.get(name, max_size)
                self._store(name, data, fill=True)
            finally:
                with self._lock:
                    self._fills[name] -= 1
                    if not self._fills[name]:
                        del self._fills[name]
                        self._stale.discard(name)
        return data

    def get_stored(self, name: str, max_size: int | None = None) -> bytes:
        """The store's own copy of name, past the cache (which it leaves as it is)."""
        return self.inner.get(name, max_size)

    def cached_head(self, name: str, size: int) -> bytes | None:
        """Up to size first bytes of the cached copy of name, None if none is cached.
        Leaves the copy and its place in the LRU order as they are."""
        if not is_cached_name(name):
            return None
        with self._lock:
            if validate_name(name) not in self._entries:
                return None
        flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(self._path(name), flags)
        except OSError:
            return None
        try:
            return os.read(fd, size) if stat.S_ISREG(os.fstat(fd).st_mode) else None
        except OSError:
            return None
        finally:
            os.close(fd)

    def stat(self, name: str) -> ObjectInfo:
        """Delegate: the etag is the store's to give."""
        return self.inner.stat(name)

    def put(self, name: str, data: bytes, *, replace: bool = True) -> None:
        """Put through to the store; keep a copy of a chunk it wrote.

        replace=False that finds the object keeps any cached copy: it is the store's.
        """
        if replace:
            self._before_write(name)
        self.inner.put(name, data, replace=replace)
        self._after_write(name, data)

    def put_if_absent(self, name: str, data: bytes) -> None:
        """put_if_absent through to the store; keep a copy of a chunk it created."""
        self.inner.put_if_absent(name, data)
        self._after_write(name, data)

    def put_if_match(self, name: str, data: bytes, etag: str) -> None:
        """put_if_match through to the store; keep a copy of a chunk it replaced."""
        self._before_write(name)
        self.inner.put_if_match(name, data, etag)
        self._after_write(name, data)

    def _before_write(self, name: str) -> None:
        # A replace that fails halfway must not leave the old bytes cached.
        if is_cached_name(name):
            self._forget(validate_name(name))

    def _after_write(self, name: str, data: bytes) -> None:
        if is_cached_name(name):
            with self._lock:
                self._overlap_fetches(name)
            self._store(name, data)

    def _overlap_fetches(self, name: str) -> None:
        """A write or removal of name (lock held): fetches of it in flight may hold
        the bytes from before it, so they must not fill the cache."""
        if name in self._fills:
            self._stale.add(name)

    def delete(self, name: str) -> None:
        """Delete from the store, then drop the cached copy."""
        self.inner.delete(name)
        self.discard(name)

    def list(self, prefix: str, start_after: str = "") -> list[str]:
        """Delegate."""
        return self.inner.list(prefix, start_after)

    def sync(self) -> None:
        """Delegate: the cache needs no durability (it can always be refetched)."""
        self.inner.sync()


def _owner_only(directory: Path) -> None:
    """Make a directory under the cache's root the owner's only, as make_dirs makes
    them now.

    Caches made before that kept directories that other local users could list
    (which chunks a mount read, and their sizes), and make_dirs leaves an existing
    directory as it is. The root itself is left alone: it holds only `c/`, and
    --cache-dir may name a directory that is not sealfs's to change (~, or /tmp,
    whose mode the whole system depends on).
    """
    with contextlib.suppress(OSError):  # not ours to change: the files stay 0600
        if stat.S_IMODE(directory.stat().st_mode) & 0o077:
            directory.chmod(PRIVATE_DIR_MODE)


def _write_file(path: Path, data: bytes, cache_dir: Path) -> int:
    """Create path exclusively and write data, creating parent directories lazily.
    Returns what the file takes on disk (see _footprint)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
    except FileNotFoundError:
        make_dirs(path.parent, cache_dir)
        fd = os.open(path, flags, 0o600)
    try:
        write_all(fd, data)
        return _footprint(os.fstat(fd))
    finally:
        os.close(fd)


def _footprint(st: os.stat_result) -> int:
    """What a cached file takes on disk: its blocks (du's count), at least its length.

    Counted by length alone, small chunks each took a whole 4 KiB block: an agent's
    small tool outputs made a cache under --cache-size 64M take 75 MB of disk, and
    chunks of 100 bytes would take 40 times the bound. Never less than the length,
    where a file system keeps small files inline or compressed (st_blocks says less).
    """
    return max(st.st_size, st.st_blocks * 512)


T = TypeVar("T")


def get_stored(store: ObjectStore, name: str, max_size: int | None = None) -> bytes:
    """The bytes the store itself holds under name, past any cache in front of it.

    For whoever must act on the store's copy (a rekey deciding what to re-seal): a
    cached copy may be newer than the store's, when the store was restored from a
    backup, or is a copy of the volume that shares the cache with the original.
    """
    fetch: Callable[[str, int | None], bytes] = getattr(store, "get_stored", store.get)
    return fetch(name, max_size)


def drop_cached_unless(
    store: ObjectStore, name: str, keep: Callable[[bytes], bool], head: int
) -> None:
    """Drop the cached copy of name, if a cache in front of store holds one, unless
    keep(its first head bytes): one it rejects, or raises a SealfsError on, is dropped.

    For a rekey that finds the store's copy already re-sealed: the cache may still
    hold the copy from before, under the key the rekey is there to retire.
    """
    peek: Callable[[str, int], bytes | None] | None = getattr(store, "cached_head", None)
    if peek is None:
        return
    data = peek(name, head)
    if data is None:
        return
    try:
        kept = keep(data)
    except SealfsError:
        kept = False
    if not kept:
        discard: Callable[[str], None] = getattr(store, "discard")  # noqa: B009
        discard(name)


def get_opened(
    store: ObjectStore, name: str, open_: Callable[[bytes], T], max_size: int | None = None
) -> T:
    """open_(the bytes of name); if open_ rejects a cached copy, the store's own copy.

    open_ authenticates (IntegrityError, FormatError). A cached copy that fails,
    damaged on the local disk or left by an earlier key epoch, must not hide a
    good object in the store: it is dropped and the store asked once more.
    """
    try:
        return open_(store.get(name, max_size))
    except (IntegrityError, FormatError):
        discard: Callable[[str], None] | None = getattr(store, "discard", None)
        if discard is None:  # no cache in front of this store
            raise
        discard(name)
        return open_(store.get(name, max_size))
