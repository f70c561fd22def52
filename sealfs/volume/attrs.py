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


def attr_of(inode: Inode) -> Attr:
    return Attr(
        inode.ino, inode.mode, inode.nlink, inode.uid, inode.gid, inode.rdev, inode.size,
        (inode.size + 511) // 512, inode.atime_ns, inode.mtime_ns, inode.ctime_ns,
    )  # fmt: skip


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
