"""Moving a large object's bytes past the page cache (O_DIRECT), both ways.

The daemon keeps what it needs in its own caches: plaintext of chunks it wrote,
a decrypted-chunk LRU, and above it the kernel's page cache of the mount's
files. A second copy of the sealed bytes in the page cache buys nothing, and
filling it is the dearest step of streaming through a local store: fresh
page-cache pages cost 1.6-2.9 s of kernel CPU per GiB written on a VM whose
host reclaims freed guest memory (free page reporting), against 0.7-0.9 s
through O_DIRECT, and a cold read of 1 GiB took 2.9-4.6 s of daemon CPU
through the page cache against 1.7-2.0 s past it (docs/design.md, "Local
store"). Both directions move the bytes through one page-aligned buffer per
thread, reused.

O_DIRECT wants the buffer, offset and length aligned to the device's logical
block. A write copies the bytes into the buffer, writes all whole 4 KiB blocks
directly and the tail through the page cache after O_DIRECT is switched off on
the descriptor, so no padding ever reaches the file. A read asks for whole
blocks past the end and stops at the short one. The buffer holds at most
WINDOW bytes: a larger object (a big snapshot) is written through it a window
at a time and read through the page cache, or every worker thread that ever
moved one would keep a copy of its size for as long as it lives. A file system
that refuses O_DIRECT (EINVAL) gets plain I/O instead.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import mmap
import os
import threading
from collections.abc import Iterator

ALIGN = 4096  # a multiple of every common logical block size (512 B and 4 KiB)
_GROW = 1 << 20  # buffers grow in whole MiB, so a run of sizes does not remap each time
# The most a thread's buffer holds: every chunk (at most 4 MiB sealed, plus a few bytes)
# in one write, and an object larger than this in pieces of this size.
WINDOW = 8 << 20

_local = threading.local()


class DirectIOUnsupported(Exception):
    """The file system refused O_DIRECT; nothing was written to the file."""


@contextlib.contextmanager
def _aligned_view(size: int) -> Iterator[memoryview]:
    """A view of this thread's page-aligned buffer of at least size bytes (anonymous,
    reused by the thread's later calls).

    The main thread gives its buffer back afterwards: it moves an object directly
    only while a mount loads (a snapshot), and then runs the FUSE loop for the
    mount's whole life, which would keep the buffer, up to WINDOW, all that time.
    """
    buf: mmap.mmap | None = getattr(_local, "buf", None)
    if buf is None or len(buf) < size:
        if buf is not None:
            buf.close()
        buf = _local.buf = mmap.mmap(-1, -(-size // _GROW) * _GROW)
    try:
        with memoryview(buf) as view:
            yield view
    finally:
        if threading.current_thread() is threading.main_thread():
            del _local.buf
            buf.close()


def open_direct(path: str, flags: int, mode: int) -> int:
    """os.open with O_DIRECT added. Raises DirectIOUnsupported (after removing a file
    that O_EXCL made: Linux creates it before it checks O_DIRECT) or OSError."""
    try:
        return os.open(path, flags | os.O_DIRECT, mode)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        if flags & os.O_CREAT and flags & os.O_EXCL:  # made by this call: take it back
            with contextlib.suppress(OSError):
                os.unlink(path)
        raise DirectIOUnsupported(exc.strerror or "EINVAL") from None


def write_direct(fd: int, data: bytes | memoryview) -> None:
    """Write all of data at the start of an empty file opened with open_direct.

    Raises DirectIOUnsupported if the device refuses the alignment (the file
    is left empty, with O_DIRECT off, for the caller's plain write), or OSError.
    """
    view = memoryview(data)
    whole = len(view) // ALIGN * ALIGN
    done = 0
    if whole:
        with _aligned_view(min(whole, WINDOW)) as out:
            try:
                while done < whole:
                    start, size = done, min(whole - done, WINDOW)
                    out[:size] = view[start : start + size]
                    while done < start + size:
                        done += os.write(fd, out[done - start : size])
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                if not done:
                    _set_direct(fd, False)
                    raise DirectIOUnsupported(exc.strerror or "EINVAL") from None
                # A short direct write left an unaligned offset: the rest goes buffered.
    _set_direct(fd, False)
    rest = view[done:]
    while rest:
        rest = rest[os.write(fd, rest) :]


def read_direct(f: io.FileIO, size: int) -> bytes:
    """All the bytes of f, a file opened for reading at offset 0 whose fstat said size.

    Read past the page cache where the file system allows it and the file fits
    the buffer; through it otherwise, and for the rest of the file after a read
    that was refused (EINVAL) or came up short before the end, or past the span
    read directly should the file have grown since the fstat. Leaves O_DIRECT off.
    """
    span = (size // ALIGN + 1) * ALIGN  # a block past the end: the last read comes up short
    fd = f.fileno()
    if span > WINDOW or not _set_direct(fd, True):
        return f.readall()
    done = 0
    try:
        with _aligned_view(span) as out:
            try:
                while done < span:
                    got = os.preadv(fd, [out[done:span]], done)
                    done += got
                    if not got or (done % ALIGN and done >= size):  # the end of the file
                        return bytes(out[:done])
                    if done % ALIGN:  # short before the end (NFS may): no longer aligned
                        break
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
            head = bytes(out[:done])
    finally:
        _set_direct(fd, False)
    # Refused (EINVAL) or cut short after done bytes, or the file grew past span: the
    # rest through the page cache.
    f.seek(done)
    return head + f.readall()


def _set_direct(fd: int, on: bool) -> bool:
    """Switch O_DIRECT on or off for fd; False if the file system refuses it (EINVAL)."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT if on else flags & ~os.O_DIRECT)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return False
    return True
