"""The files that hold objects and records on a local disk: opened, read and made safely.

For the local store, the chunk cache and the host's record of generations seen
(sealfs.cli.seen): whoever can write where such files live could leave a FIFO, a
device or a file grown without bound there, and a reader must neither block, act
on a device nor take it all into memory. Knows nothing of object names or stores.
"""

from __future__ import annotations

import hashlib
import io
import os
import stat
import time
from pathlib import Path

from sealfs.store.direct import read_direct


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


def read_regular_file(
    path: Path | str, max_size: int | None = None, *, direct_from: int | None = None
) -> bytes:
    """The bytes of the regular file at path (a symlink is followed).

    direct_from: read a file of at least this many bytes past the page cache
    (sealfs.store.direct says when that pays).

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
        if direct_from is not None and size >= direct_from:
            data = read_direct(f, size)
        else:
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
