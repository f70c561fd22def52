"""The ObjectStore protocol every backend implements, and object-name rules.

Stores are synchronous and blocking: the volume engine calls them from worker
threads (trio.to_thread) so that a slow disk or network never stalls the FUSE
event loop. Implementations must be safe to call from several threads at once.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from sealfs.errors import ConfigError, FormatError

# Names are a fixed, small alphabet so that every backend (POSIX paths, S3
# keys) can hold them verbatim and so that no name can escape the store root.
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*(/[a-z0-9][a-z0-9._-]*)*$")
MAX_NAME_LENGTH = 200


def validate_name(name: str) -> str:
    """Return name unchanged, or raise ConfigError if it is not a valid object name."""
    if len(name) > MAX_NAME_LENGTH or not _NAME_RE.match(name) or ".." in name:
        raise ConfigError(f"invalid object name {name!r}")
    return name


def is_valid_name(name: str) -> bool:
    """Whether name is a valid object name: what a listing may return, as opposed to
    the temp files, lock file and strays beside the objects."""
    try:
        validate_name(name)
    except ConfigError:
        return False
    return True


# A list prefix is a name cut anywhere: same alphabet, may be empty or end in "/".
_PREFIX_RE = re.compile(r"^([a-z0-9][a-z0-9._-]*/)*([a-z0-9][a-z0-9._-]*)?$")


def validate_prefix(prefix: str) -> str:
    """Return prefix unchanged, or raise ConfigError if no valid name could start with it."""
    if len(prefix) > MAX_NAME_LENGTH or not _PREFIX_RE.match(prefix) or ".." in prefix:
        raise ConfigError(f"invalid object name prefix {prefix!r}")
    return prefix


def content_etag(data: bytes) -> str:
    """The etag the memory and local stores use: hex SHA-256 of the object's bytes.

    Callers must treat etags as opaque (an S3 store returns the server's ETag).
    """
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class ObjectInfo:
    """What a store can say about one object without reading it."""

    name: str
    size: int
    etag: str


class ObjectStore(Protocol):
    """A flat namespace of immutable-by-convention objects.

    Every method may raise TransientStoreError (worth retrying),
    StoreUnavailableError, NoSpaceError or another StoreError. None of them
    retries: the RetryingStore wrapper decides that, in one place.
    """

    def get(self, name: str, max_size: int | None = None) -> bytes:
        """Return the whole object. Raises ObjectNotFoundError.

        max_size: the most bytes an object of its kind can hold; a larger one is
        refused unread with FormatError (see object_too_large).
        """
        ...

    def stat(self, name: str) -> ObjectInfo:
        """Return size and etag. Raises ObjectNotFoundError."""
        ...

    def put(self, name: str, data: bytes) -> None:
        """Create or replace the object atomically: readers see old or new, never a mix."""
        ...

    def put_if_absent(self, name: str, data: bytes) -> None:
        """Create the object only if no object has that name. Raises ObjectExistsError.

        This is the generation race: of two writers, exactly one succeeds.
        """
        ...

    def put_if_match(self, name: str, data: bytes, etag: str) -> None:
        """Replace the object only if its current etag is etag. Raises PreconditionFailedError.

        A missing object raises ObjectNotFoundError (as S3 answers 404 NoSuchKey).
        """
        ...

    def delete(self, name: str) -> None:
        """Delete the object; deleting a missing object is not an error."""
        ...

    def list(self, prefix: str, start_after: str = "") -> list[str]:
        """All names that start with prefix and sort after start_after, in sorted order."""
        ...

    def sync(self) -> None:
        """Make every earlier put durable (a local store syncs its file system; S3 is a no-op).

        The engine calls this after uploading chunks and before creating the log
        segment that refers to them, and again after the segment.
        """
        ...

    def free_bytes(self) -> int:
        """Space left for new objects, for statfs (a large constant where unbounded)."""
        ...

    def describe(self) -> str:
        """A short human description for messages (never includes credentials)."""
        ...

    def close(self) -> None:
        """Release connections and file descriptors."""
        ...


def request_counts(store: object) -> dict[str, int] | None:
    """Requests sent per method by store (or the store it wraps), or None if it keeps no count.

    Optional: a backend that counts (S3Store) and the wrappers define
    request_counts(); the others do not.
    """
    method = getattr(store, "request_counts", None)
    if method is None:
        return None
    counts: dict[str, int] | None = method()
    return counts


def store_location(store: ObjectStore) -> str:
    """Where store's objects are, the same however a command line or environment named
    them; its description where the backend gives nothing more exact.

    Optional, as request_counts: the local and S3 stores and the wrappers define
    location(). Two processes compare it to tell one store from a copy of it, and the
    host keys its record of the generations it saw by it (sealfs.cli.seen).
    """
    method = getattr(store, "location", None)
    return str(method()) if method is not None else store.describe()


def write_all(fd: int, data: bytes) -> None:
    """Write all of data: os.write may write less, and a full disk raises on the next."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def is_stale_temp(mtime: float, age: float) -> bool:
    """Whether a temp file dated mtime was left by a crash: dated more than age from now.

    Either way: a writer's temp file lives for one write, so it is dated about now,
    whichever way the clock was stepped since earlier ones were written. Now is read
    for each file, not once per sweep: a file made during a long sweep is not "ahead".
    """
    return abs(time.time() - mtime) > age


def object_too_large(name: str, size: int, max_size: int, where: str) -> FormatError:
    """The error for an object larger than any that sealfs writes under its name.

    Whoever can write to the store (or the cache) could otherwise append junk without
    bound (a sparse file costs nothing) and have a reader take it all into memory:
    the mount daemon was killed for want of memory, losing what was not committed.
    """
    return FormatError(
        f"object {name} in {where} is {size} bytes, more than the {max_size} that an"
        " object of its kind can hold: restore it from a copy of the store"
    )


def refuse_too_large(name: str, size: int, max_size: int | None, where: str) -> None:
    """Raise object_too_large's error if size is over max_size (None: no bound)."""
    if max_size is not None and size > max_size:
        raise object_too_large(name, size, max_size, where)


class FileTooLargeError(OSError):
    """A file larger than the caller's bound (its size is in st_size)."""

    def __init__(self, size: int) -> None:
        super().__init__(f"file of {size} bytes is larger than expected")
        self.size = size


class NotARegularFileError(OSError):
    """An object's path holds a FIFO, device or socket: never an object sealfs wrote."""


def _open_regular(path: Path | str) -> tuple[io.FileIO, int]:
    """The regular file at path opened for reading, and its size (see read_regular_file).

    Looked at before it is opened: an O_PATH descriptor opens nothing, and the file
    is then opened through it. Opening a device can act (/dev/watchdog starts a
    watchdog that reboots the host when closed without its magic character, a tape
    rewinds), and O_NONBLOCK spares only a FIFO's wait.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
    probe = os.open(path, os.O_PATH | os.O_CLOEXEC)
    try:
        st = os.fstat(probe)
        _check_regular(path, st.st_mode)
        try:  # the very file looked at, even if path now names another
            fd = os.open(f"/proc/self/fd/{probe}", flags)
        except FileNotFoundError:  # no /proc: by its path, and looked at again
            fd = os.open(path, flags)
            try:
                st = os.fstat(fd)
                _check_regular(path, st.st_mode)
            except BaseException:
                os.close(fd)
                raise
    finally:
        os.close(probe)
    return io.FileIO(fd, "rb"), st.st_size


def _check_regular(path: Path | str, mode: int) -> None:
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(f"{path} is a directory")
    if not stat.S_ISREG(mode):
        raise NotARegularFileError(f"{path} is not a regular file")


HASH_BLOCK = 1 << 20


def regular_file_etag(path: Path | str) -> tuple[int, str]:
    """Size and content_etag of the regular file at path, read a block at a time.

    Raises what read_regular_file raises (but never FileTooLargeError): an etag
    needs every byte, and reading a file grown without bound whole (a sparse file
    costs nothing to make) took all memory.
    """
    digest, size = hashlib.sha256(), 0
    f, _ = _open_regular(path)
    with f:
        while block := f.read(HASH_BLOCK):
            digest.update(block)
            size += len(block)
    return size, digest.hexdigest()


def read_regular_file(path: Path | str, max_size: int | None = None) -> bytes:
    """The bytes of the regular file at path (a symlink is followed).

    Raises IsADirectoryError for a directory, NotARegularFileError for anything else
    that is not a regular file, FileTooLargeError for one of more than max_size bytes
    (not read), and what open(2) and read(2) raise. Whoever can write
    where objects live (the store's directory, a cache directory) could otherwise
    leave a FIFO there, whose open blocks until some writer comes (forever: a mount
    and its unmount hung), or a symlink to /dev/zero, read into memory without end.
    O_NONBLOCK makes opening a FIFO return at once; it changes nothing for a file.
    """
    f, size = _open_regular(path)
    with f:
        if max_size is not None and size > max_size:
            raise FileTooLargeError(size)
        data = f.readall()
        if max_size is not None and len(data) > max_size:  # grew since the fstat
            raise FileTooLargeError(len(data))
        return data


PRIVATE_DIR_MODE = 0o700  # other local users may neither list objects nor replace them


def make_dirs(path: Path, root: Path) -> Path:
    """mkdir -p of path: root and the directories under it the owner's only, whatever
    the umask (their names and sizes show what a volume holds and reads); those above
    root as mkdir -p makes them. Returns the highest directory that was missing.

    Raises FileExistsError if something other than a directory is in the way.
    """
    missing = [path]
    while not missing[-1].parent.exists():
        missing.append(missing[-1].parent)
    for directory in reversed(missing):
        ours = directory == root or root in directory.parents
        try:
            os.mkdir(directory, PRIVATE_DIR_MODE if ours else 0o777)
        except FileExistsError:  # fine if another thread made it meanwhile
            if not directory.is_dir():
                raise
    return missing[-1]


def remove_crash_leftovers(store: object, older_than: float) -> int:
    """Remove what crashed writers left in store (or the store it wraps); how many went.

    Optional: a backend that writes through temporary files (LocalStore) and the
    wrappers define remove_crash_leftovers(); the others leave nothing behind.
    """
    method = getattr(store, "remove_crash_leftovers", None)
    if method is None:
        return 0
    removed: int = method(older_than)
    return removed


class StoreWrapper:
    """What every wrapper (retrying, caching, fault-injecting) passes through unchanged
    to the store it wraps.

    In one place so that an optional method the backends gain reaches through every
    wrapper at once (location() came late, and was added to each wrapper by hand): a
    wrapper without it would hide it from status and the host's record of generations.
    """

    inner: ObjectStore

    def free_bytes(self) -> int:
        """The inner store's free space (statfs is not worth retrying or faking)."""
        return self.inner.free_bytes()

    def request_counts(self) -> dict[str, int] | None:
        """The inner store's requests per method, if it counts them."""
        return request_counts(self.inner)

    def remove_crash_leftovers(self, older_than: float) -> int:
        """The inner store's, if it leaves any."""
        return remove_crash_leftovers(self.inner, older_than)

    def location(self) -> str:
        """The inner store's location."""
        return store_location(self.inner)

    def describe(self) -> str:
        """The inner store's description: a wrapper is invisible to users."""
        return self.inner.describe()

    def close(self) -> None:
        """Close the inner store."""
        self.inner.close()
