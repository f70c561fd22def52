"""Writing a new file's bytes past the page cache (O_DIRECT), for large objects.

The daemon never reads a chunk file it has just written (it keeps plaintext
in its own cache), so copying every written byte into the page cache buys
nothing, and it is the dearest step of a streaming write: fresh page-cache
pages cost 1.6-2.9 s of kernel CPU per GiB on a VM whose host reclaims freed
guest memory (free page reporting), against 0.7-0.9 s through O_DIRECT,
which moves the bytes from one reused buffer (docs/design.md, "Local store").

O_DIRECT wants the buffer, offset and length aligned to the device's logical
block: the bytes are copied into a page-aligned buffer (one per thread,
reused), all whole 4 KiB blocks are written directly, and the tail is written
through the page cache after O_DIRECT is switched off on the descriptor. The
buffer holds at most WINDOW bytes: a larger object (a big snapshot) goes
through it a window at a time, or every worker thread that ever wrote one
would keep a copy of its size for as long as it lives. No padding ever
reaches the file. A file system that refuses O_DIRECT (EINVAL) gets the
plain write instead; the caller remembers that and stops trying.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import threading

ALIGN = 4096  # a multiple of every common logical block size (512 B and 4 KiB)
_GROW = 1 << 20  # buffers grow in whole MiB, so a run of sizes does not remap each time
# The most a thread's buffer holds: every chunk (at most 4 MiB sealed, plus a few bytes)
# in one write, and an object larger than this in pieces of this size.
WINDOW = 8 << 20

_local = threading.local()


class DirectIOUnsupported(Exception):
    """The file system refused O_DIRECT; nothing was written to the file."""


def _aligned_buffer(size: int) -> mmap.mmap:
    """This thread's page-aligned buffer of at least size bytes (anonymous, reused)."""
    buf: mmap.mmap | None = getattr(_local, "buf", None)
    if buf is None or len(buf) < size:
        if buf is not None:
            buf.close()
        buf = _local.buf = mmap.mmap(-1, -(-size // _GROW) * _GROW)
    return buf


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
        buf = _aligned_buffer(min(whole, WINDOW))
        with memoryview(buf) as out:
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
                    _direct_off(fd)
                    raise DirectIOUnsupported(exc.strerror or "EINVAL") from None
                # A short direct write left an unaligned offset: the rest goes buffered.
    _direct_off(fd)
    rest = view[done:]
    while rest:
        rest = rest[os.write(fd, rest) :]


def _direct_off(fd: int) -> None:
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
