"""The in-memory metadata of a volume: inodes, the chunk table and the writer.

The volume engine changes this state only by applying operation records
(sealfs.meta.ops), the same records that replay applies at mount, so the
live state and the state rebuilt from the log cannot drift apart. The one
exception is a write's size and times: the engine sets them in memory and
records them at the next commit's cut, together with the bytes.
"""

from __future__ import annotations

import stat
from collections import Counter
from dataclasses import dataclass, field

from sealfs.chunking.similarity import split_features
from sealfs.meta.extents import ExtentMap

ROOT_INO = 1


@dataclass(slots=True, eq=False)
class Inode:
    """One file, directory, symlink or special node.

    extents is set for regular files only, entries for directories only.
    parent is the containing directory of a directory (for ".."), else 0.
    """

    ino: int
    mode: int
    uid: int
    gid: int
    nlink: int
    size: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    rdev: int = 0
    parent: int = 0
    target: bytes = b""
    xattrs: dict[bytes, bytes] = field(default_factory=dict)
    extents: ExtentMap | None = None
    entries: dict[bytes, int] | None = None

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)

    @property
    def is_reg(self) -> bool:
        return stat.S_ISREG(self.mode)


@dataclass(frozen=True, slots=True)
class WriterInfo:
    """Who holds (or last held) the volume for writing."""

    host: str
    pid: int
    mount_id: bytes
    since_ns: int
    released: bool


# Features that must name a chunk before a new chunk is compressed against it.
MIN_VOTES = 2


@dataclass(frozen=True, slots=True)
class ChunkInfo:
    """Sizes of one chunk, advisory, for statistics (extents are authoritative), and
    what a writer needs to store a similar chunk as a difference from it.

    features: the chunk's similarity features (sealfs.chunking.similarity), or b"".
    base: the id of the chunk this one is stored as a difference from, or b"".
    """

    plain_size: int
    stored_size: int
    features: bytes = b""
    base: bytes = b""


@dataclass(slots=True)
class MetaState:
    """Everything a snapshot holds: the state of the volume as of generation."""

    inodes: dict[int, Inode] = field(default_factory=dict)
    chunks: dict[bytes, ChunkInfo] = field(default_factory=dict)
    # The sum of the chunks' stored sizes, kept by put_chunk and set_chunks so that
    # statfs need not add up a million rows on the FUSE loop each time df asks.
    chunks_stored_bytes: int = 0
    # Each feature of the chunk table's rows to the chunk a new chunk sharing it would
    # be stored as a difference from: the row's base, or the row's chunk where it has
    # none (a difference is never taken from a difference). Later rows win.
    similar: dict[bytes, bytes] = field(default_factory=dict)
    generation: int = 0
    head_hash: bytes = bytes(32)
    committed_ns: int = 0
    writer: WriterInfo | None = None
    next_ino: int = ROOT_INO + 1

    def put_chunk(self, chunk_id: bytes, info: ChunkInfo) -> None:
        """Record a chunk's sizes (a rekey re-seals a chunk in place: replace its row)."""
        previous = self.chunks.get(chunk_id)
        self.chunks[chunk_id] = info
        self.chunks_stored_bytes += info.stored_size - (previous.stored_size if previous else 0)
        self._index(chunk_id, info)

    def set_chunks(self, table: dict[bytes, ChunkInfo]) -> None:
        """Replace the whole chunk table, as a snapshot holds it."""
        self.chunks = table
        self.chunks_stored_bytes = sum(info.stored_size for info in table.values())
        self.similar = {}
        for chunk_id, info in table.items():
            self._index(chunk_id, info)

    def _index(self, chunk_id: bytes, info: ChunkInfo) -> None:
        root = info.base or chunk_id
        for feature in split_features(info.features):
            self.similar[feature] = root

    def similar_roots(self, features: bytes) -> list[bytes]:
        """The chunks a chunk with these features may be stored as a difference from: at
        most two, each named by two features or more, the one most name first. Safe to
        call from a worker thread (dictionary lookups only).

        One feature alone is one piece of a few KiB, and text repeats in passages that
        long: with pieces of 2-8 KiB, 40 chunks of the benchmark's fresh 1 GiB JSON
        checkpoint shared a piece with an earlier chunk of the same file, none of them
        anything more, and each such try cost a base read and a compression (0.65 s
        of CPU per GiB written).
        """
        named = (self.similar.get(f) for f in split_features(features))
        votes = Counter(root for root in named if root is not None)
        return [root for root, n in votes.most_common(2) if n >= MIN_VOTES]

    def note_ino(self, ino: int) -> None:
        """Keep next_ino above every inode number seen, so none is ever reused."""
        if ino >= self.next_ino:
            self.next_ino = ino + 1
