"""The in-memory metadata of a volume: inodes, the chunk table and the writer.

The volume engine changes this state only by applying operation records
(sealfs.meta.ops), the same records that replay applies at mount, so the
live state and the state rebuilt from the log cannot drift apart. The one
exception is a write's size and times: the engine sets them in memory and
records them at the next commit's cut, together with the bytes.
"""

from __future__ import annotations

import stat
from dataclasses import dataclass, field

from sealfs.meta.extents import ExtentMap
from sealfs.meta.similar import DEFAULT_LIMIT, FeatureIndex

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
    # The features of the chunk table's newest rows (sealfs.meta.similar), kept by a
    # writer only (index_features).
    similar: FeatureIndex | None = None
    # The chunks that rows name as their base: written again, such a chunk must be stored
    # whole, whether or not it has a row (a difference kept from another writer names
    # a base that may have none).
    bases: set[bytes] = field(default_factory=set)
    generation: int = 0
    head_hash: bytes = bytes(32)
    committed_ns: int = 0
    writer: WriterInfo | None = None
    next_ino: int = ROOT_INO + 1

    def put_chunk(self, chunk_id: bytes, info: ChunkInfo, *, keep_place: bool = False) -> None:
        """Record a chunk's sizes and features. A chunk written again (whole, over a
        damaged copy) replaces its row, which moves to the end: the table is in the
        order rows were last put, and a writer's index begins from its end
        (index_features), so the chunk repaired is offered as a base before the
        differences put earlier that still name the damaged one.

        keep_place: the engine's own records. Its index already takes the chunk as
        the newest, and its worker threads look rows up (dedup, bases) while the
        event loop puts them: a row taken out for a moment would mislead them.
        """
        previous = self.chunks.get(chunk_id)
        if previous is not None and not keep_place:
            del self.chunks[chunk_id]
        self.chunks[chunk_id] = info
        self.chunks_stored_bytes += info.stored_size - (previous.stored_size if previous else 0)
        self._index(chunk_id, info)

    def set_chunks(self, table: dict[bytes, ChunkInfo]) -> None:
        """Replace the whole chunk table, as a snapshot holds it. An index of features
        kept already begins again from the new table: left as it was, it would offer
        the old table's chunks."""
        self.chunks = table
        self.chunks_stored_bytes = sum(info.stored_size for info in table.values())
        self.bases = {info.base for info in table.values() if info.base}
        if self.similar is not None:
            self.index_features(self.similar.limit)

    def index_features(self, limit: int = DEFAULT_LIMIT) -> None:
        """Keep, from now on, the index a writer looks up the chunk to store a new one as a
        difference from, beginning with the table's newest rows that fit in it.

        Only a writer stores chunks: a read-only mount and compaction's throwaway states
        never build the index. Built from the whole table, it cost 0.43 s of CPU for
        200,000 chunks of 1 MiB, most of whose features the bound then dropped, and it
        holds up to about 40 MiB.
        """
        index = FeatureIndex(limit)
        rows = reversed(self.chunks.items())
        index.fill((info.features, info.base or cid) for cid, info in rows if info.features)
        self.similar = index

    def _index(self, chunk_id: bytes, info: ChunkInfo) -> None:
        if info.features and self.similar is not None:
            self.similar.add(info.features, info.base or chunk_id)
        if info.base:
            self.bases.add(info.base)

    def is_base(self, chunk_id: bytes) -> bool:
        """Whether a row names chunk_id as its base. Safe to call from a worker thread."""
        return chunk_id in self.bases

    def base_of(self, chunk_id: bytes) -> bytes:
        """The base chunk_id's row names (b"" if it is whole or has no row). Safe to
        call from a worker thread."""
        row = self.chunks.get(chunk_id)
        return row.base if row is not None else b""

    def similar_roots(self, features: bytes) -> list[bytes]:
        """The chunks a chunk with these features may be stored as a difference from
        (FeatureIndex.roots), each a whole chunk of the table: a read of a difference
        takes its base and nothing more. Safe to call from a worker thread."""
        index = self.similar
        if index is None:
            return []
        rows = ((root, self.chunks.get(root)) for root in index.roots(features))
        return [root for root, row in rows if row is not None and not row.base]

    def note_ino(self, ino: int) -> None:
        """Keep next_ino above every inode number seen, so none is ever reused."""
        if ino >= self.next_ino:
            self.next_ino = ino + 1
