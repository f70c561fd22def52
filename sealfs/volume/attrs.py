"""Plain values the engine hands to front ends: attributes, directory entries, statfs."""

from __future__ import annotations

from dataclasses import dataclass

from sealfs.meta.model import Inode

BLOCK_SIZE = 4096
IO_SIZE = 128 * 1024


@dataclass(frozen=True, slots=True)
class Attr:
    ino: int
    mode: int
    nlink: int
    uid: int
    gid: int
    rdev: int
    size: int
    blocks: int  # 512-byte units
    atime_ns: int
    mtime_ns: int
    ctime_ns: int


def attr_of(inode: Inode, buffered: int = 0) -> Attr:
    """inode's attributes; buffered: how many bytes of it wait in memory to be sealed."""
    return Attr(
        inode.ino, inode.mode, inode.nlink, inode.uid, inode.gid, inode.rdev, inode.size,
        _blocks(inode, buffered), inode.atime_ns, inode.mtime_ns, inode.ctime_ns,
    )  # fmt: skip


def _blocks(inode: Inode, buffered: int) -> int:
    """st_blocks: a regular file's bytes outside holes, so that du and cp see sparse files.

    Buffered bytes may overlap stored ones, so the sum is capped by the size.
    A non-empty file never reports 0: GNU tar --sparse archives such a file
    as all hole without reading it, and a file written through a shared
    mapping can hold bytes the kernel has not sent yet.
    """
    whole = (inode.size + 511) // 512
    if inode.extents is None or whole == 0:
        return whole
    return max(1, min(whole, (inode.extents.mapped_bytes() + buffered + 511) // 512))


@dataclass(frozen=True, slots=True)
class DirEntry:
    name: bytes
    attr: Attr
    next_index: int  # pass back to readdir to continue after this entry


@dataclass(frozen=True, slots=True)
class StatFs:
    block_size: int
    blocks: int
    blocks_free: int
    blocks_avail: int
    files: int
    files_free: int
    name_max: int
