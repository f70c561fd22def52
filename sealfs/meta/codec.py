"""Log segments and snapshots as sealed objects: names, payloads, hash chain.

A segment carries the records of one commit and the SHA-256 of the payload
of the segment before it, so the log is a hash chain: a reader that has seen
generation N can tell whether a later store still extends it. The chain
hashes payloads, not sealed bytes, so that a rekey can re-seal the log under
a new key epoch without breaking it. A
snapshot carries the whole MetaState as of one generation, so mount need
not replay the log from the beginning.
"""

from __future__ import annotations

import hashlib
import stat
from dataclasses import dataclass
from typing import Any, NoReturn

import msgpack

from sealfs.chunking.compress import decompress, maybe_compress
from sealfs.crypto.envelope import (
    ENVELOPE_OVERHEAD,
    FLAG_ZSTD,
    ObjectKind,
    generation_binding,
    open_object,
    seal_object,
)
from sealfs.crypto.keyring import KeyRing
from sealfs.crypto.subkeys import Subkeys
from sealfs.errors import FormatError, MetadataTooLargeError
from sealfs.meta import ops
from sealfs.meta.extents import ExtentMap
from sealfs.meta.model import ChunkInfo, Inode, MetaState

SEGMENT_PREFIX = "l/"
SNAPSHOT_PREFIX = "s/"
_GEN_WIDTH = 16
MAX_METADATA_SIZE = 1 << 31  # decompression bound for one segment or snapshot
# No segment or snapshot that opens is larger sealed: a bigger object is refused unread.
MAX_SEALED_METADATA = MAX_METADATA_SIZE + ENVELOPE_OVERHEAD
_LEVEL = 3


def segment_name(generation: int) -> str:
    return f"{SEGMENT_PREFIX}{generation:0{_GEN_WIDTH}d}"


def snapshot_name(generation: int) -> str:
    return f"{SNAPSHOT_PREFIX}{generation:0{_GEN_WIDTH}d}"


def parse_generation(name: str) -> int:
    """The generation in a segment or snapshot name; FormatError for a foreign name."""
    digits = name.rpartition("/")[2]
    if len(digits) != _GEN_WIDTH or not digits.isdigit():
        raise FormatError(
            f"unexpected object name {name!r} in the store (sealfs names these {_GEN_WIDTH}"
            " digits): move it out of the store"
        )
    return int(digits)


SealKeys = tuple[int, Subkeys]  # the epoch to seal under and its subkeys


@dataclass(frozen=True)
class Segment:
    generation: int
    prev_hash: bytes
    time_ns: int
    ops: list[ops.Op]


@dataclass(frozen=True)
class LoggedSegment:
    """A committed segment as the log keeps it in memory."""

    segment: Segment
    digest: bytes  # SHA-256 of its payload: what the next segment records as prev
    size: int  # of its sealed object


def encode_segment(keys: SealKeys, volume_id: bytes, segment: Segment) -> tuple[bytes, bytes]:
    """Seal a segment; return (sealed bytes, payload digest for the chain)."""
    payload = {
        "gen": segment.generation,
        "prev": segment.prev_hash,
        "time": segment.time_ns,
        "ops": segment.ops,
    }
    return _seal(keys, volume_id, ObjectKind.SEGMENT, segment.generation, payload)


def decode_segment(
    ring: KeyRing, volume_id: bytes, generation: int, sealed: bytes
) -> LoggedSegment:
    """Open and parse l/<generation>. Raises IntegrityError, FormatError."""
    payload, digest = _open(ring, volume_id, ObjectKind.SEGMENT, generation, sealed)
    gen, prev, time_ns, records = _fields(payload, ("gen", int), ("prev", bytes), ("time", int),
                                          ("ops", list))  # fmt: skip
    if gen != generation or len(prev) != 32:
        raise FormatError(f"log segment {generation} is inconsistent with its name")
    return LoggedSegment(Segment(gen, prev, time_ns, records), digest, len(sealed))


def encode_snapshot(keys: SealKeys, volume_id: bytes, state: MetaState) -> bytes:
    payload = {
        "gen": state.generation,
        "head": state.head_hash,
        "time": state.committed_ns,
        "next_ino": state.next_ino,
        "writer": None if state.writer is None else ops.writer(state.writer)[1:],
        "inodes": [_inode_row(inode) for inode in state.inodes.values()],
        "chunks": [[cid, *ops.chunk_row(c)] for cid, c in state.chunks.items()],
    }
    return _seal(keys, volume_id, ObjectKind.SNAPSHOT, state.generation, payload, bounded=True)[0]


def decode_snapshot(ring: KeyRing, volume_id: bytes, generation: int, sealed: bytes) -> MetaState:
    """Open and parse s/<generation> into a MetaState. Raises IntegrityError, FormatError."""
    payload, _ = _open(ring, volume_id, ObjectKind.SNAPSHOT, generation, sealed)
    gen, head, time_ns, next_ino, rows, chunk_rows = _fields(
        payload, ("gen", int), ("head", bytes), ("time", int), ("next_ino", int),
        ("inodes", list), ("chunks", list),
    )  # fmt: skip
    if gen != generation:
        raise FormatError(f"snapshot {generation} is inconsistent with its name")
    state = MetaState(generation=gen, head_hash=head, committed_ns=time_ns, next_ino=next_ino)
    writer = payload.get("writer")
    if writer is not None:
        ops.apply(state, [ops.WRITER, *_as_list(writer, "writer")])
    for row in rows:
        inode = _inode_from_row(row)
        state.inodes[inode.ino] = inode
        state.note_ino(inode.ino)
    state.set_chunks(dict(map(_chunk_from_row, chunk_rows)))
    return state


def _inode_row(inode: Inode) -> list[Any]:
    body: Any = None
    if inode.extents is not None:
        body = inode.extents.to_wire()
    elif inode.entries is not None:
        body = inode.entries
    return [*ops.inode_fields(inode), inode.xattrs, body]


def _inode_from_row(row: object) -> Inode:
    # The hot loop of mount: one call per inode, so checks are inlined and cheap.
    if type(row) is not list or len(row) != 14:
        _bad("inode")
    fields, xattrs, body = row[:12], row[12], row[13]
    ops.check_inode_fields(fields)
    if type(xattrs) is not dict or (
        xattrs and not all(type(k) is bytes and type(v) is bytes for k, v in xattrs.items())
    ):
        _bad("xattr")
    inode = Inode(*fields)
    inode.xattrs = xattrs
    if stat.S_ISREG(inode.mode):
        inode.extents = ExtentMap.from_wire(body)
    elif stat.S_ISDIR(inode.mode):
        if type(body) is not dict or not all(
            type(k) is bytes and type(v) is int for k, v in body.items()
        ):
            _bad("directory")
        inode.entries = body
    return inode


def _chunk_from_row(row: object) -> tuple[bytes, ChunkInfo]:
    if (
        type(row) is not list
        or len(row) not in (3, 5)
        or type(row[0]) is not bytes
        or type(row[1]) is not int
        or type(row[2]) is not int
        or (len(row) == 5 and not (type(row[3]) is bytes and type(row[4]) is bytes))
    ):
        _bad("chunk")
    return row[0], ops.chunk_info(row[1:])


def _seal(
    keys: SealKeys,
    volume_id: bytes,
    kind: ObjectKind,
    gen: int,
    payload: Any,
    *,
    bounded: bool = False,
) -> tuple[bytes, bytes]:
    """bounded: raise MetadataTooLargeError rather than seal a payload over the bound
    that _open enforces (a newest snapshot that does not open fails every mount)."""
    epoch, subkeys = keys
    raw = msgpack.packb(payload, use_bin_type=True)
    if bounded and len(raw) > MAX_METADATA_SIZE:
        raise MetadataTooLargeError(
            f"snapshot {gen} would hold {len(raw)} bytes of metadata, over the"
            f" {MAX_METADATA_SIZE} a mount reads: not written"
        )
    packed = maybe_compress(raw, _LEVEL)
    binding = generation_binding(volume_id, gen)
    digest = hashlib.sha256(raw).digest()
    if packed is None:
        return seal_object(subkeys.meta_key, kind, binding, raw, epoch=epoch), digest
    sealed = seal_object(subkeys.meta_key, kind, binding, packed, flags=FLAG_ZSTD, epoch=epoch)
    return sealed, digest


def _open(
    ring: KeyRing, volume_id: bytes, kind: ObjectKind, gen: int, sealed: bytes
) -> tuple[Any, bytes]:
    epoch, subkeys = ring.keys_for(sealed)
    binding = generation_binding(volume_id, gen)
    flags, body = open_object(subkeys.meta_key, kind, binding, sealed, epoch=epoch)
    if flags & FLAG_ZSTD:
        body = decompress(body, MAX_METADATA_SIZE)
    digest = hashlib.sha256(body).digest()
    try:
        payload = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise FormatError(f"undecodable metadata payload: {exc}") from None
    if not isinstance(payload, dict):
        _bad("payload")
    return payload, digest


def _fields(payload: dict[str, Any], *spec: tuple[str, type]) -> list[Any]:
    values = []
    for key, kind in spec:
        value = payload.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            _bad(key)
        values.append(value)
    return values


def _as_list(value: object, what: str) -> list[Any]:
    if not isinstance(value, list):
        _bad(what)
    return value


def _bad(what: str) -> NoReturn:
    raise FormatError(f"malformed {what} in metadata")
