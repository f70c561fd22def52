"""Operation records: the physical changes that log segments carry.

Each record is a msgpack-ready list whose first item is an opcode. They are
physical (set this attribute, add this entry) rather than logical (rename),
so replay needs none of the engine's POSIX rules and cannot disagree with it.
apply() is the single place where records change a MetaState.
"""

from __future__ import annotations

import stat
from collections.abc import Callable
from itertools import pairwise
from typing import Any

from sealfs.chunking.similarity import FEATURE_SIZE, MAX_FEATURES
from sealfs.crypto.ids import CHUNK_ID_SIZE
from sealfs.errors import FormatError
from sealfs.meta.extents import Extent, ExtentMap, extent_from_wire
from sealfs.meta.model import ChunkInfo, Inode, MetaState, WriterInfo

Op = list[Any]

PUT_INODE = 1
DEL_INODE = 2
LINK = 3
UNLINK = 4
DATA = 5
SET_XATTR = 6
DEL_XATTR = 7
CHUNK = 8
WRITER = 9


def inode_fields(inode: Inode) -> list[Any]:
    return [
        inode.ino, inode.mode, inode.uid, inode.gid, inode.nlink, inode.size,
        inode.atime_ns, inode.mtime_ns, inode.ctime_ns, inode.rdev, inode.parent, inode.target,
    ]  # fmt: skip


INODE_FIELD_NAMES = (
    "ino", "mode", "uid", "gid", "nlink", "size",
    "atime_ns", "mtime_ns", "ctime_ns", "rdev", "parent", "target",
)  # fmt: skip
_FIELD_INDEX = {name: k + 1 for k, name in enumerate(INODE_FIELD_NAMES)}


def put_inode(inode: Inode, **changes: Any) -> Op:
    """A record of inode's attributes, with the named fields changed."""
    op: Op = [PUT_INODE, *inode_fields(inode)]
    for name, value in changes.items():
        op[_FIELD_INDEX[name]] = value
    return op


def wire_size(op: Op) -> int:
    """About how many bytes a record takes in a segment, never much less: its byte
    strings, nine per other field (msgpack's largest integer), 64 per extent row.

    What bounds the records awaiting a commit (a change waits past the bound): a
    segment a mount cannot read would lose the volume, so an estimate a little high
    is the safe side.
    """
    size = 1
    for value in op:
        if type(value) is bytes:
            size += len(value) + 5
        elif type(value) is list:
            size += 64 * len(value)  # a DATA record's extent rows
        else:
            size += 9
    return size


def size_set_by(op: Op) -> int | None:
    """The file size a PUT_INODE or DATA record leaves its inode with; None for others."""
    if op[0] == PUT_INODE:
        size: int = op[_FIELD_INDEX["size"]]
        return size
    if op[0] == DATA:
        size = op[5]
        return size
    return None


def new_inode_record(**fields: Any) -> Op:
    """A record that creates an inode; every field of INODE_FIELD_NAMES must be given."""
    return [PUT_INODE, *(fields[name] for name in INODE_FIELD_NAMES)]


def del_inode(ino: int) -> Op:
    return [DEL_INODE, ino]


def link(parent: int, name: bytes, ino: int) -> Op:
    return [LINK, parent, name, ino]


def unlink(parent: int, name: bytes) -> Op:
    return [UNLINK, parent, name]


def data(ino: int, start: int, end: int, extents: list[Extent], size: int) -> Op:
    """Bytes [start, end) of ino are now exactly extents (holes elsewhere in the range)."""
    return [
        DATA,
        ino,
        start,
        end,
        [[e.start, e.length, e.chunk, e.chunk_offset] for e in extents],
        size,
    ]


def set_xattr(ino: int, name: bytes, value: bytes) -> Op:
    return [SET_XATTR, ino, name, value]


def del_xattr(ino: int, name: bytes) -> Op:
    return [DEL_XATTR, ino, name]


def chunk(chunk_id: bytes, info: ChunkInfo) -> Op:
    return [CHUNK, chunk_id, *chunk_row(info)]


def chunk_row(info: ChunkInfo) -> list[Any]:
    """A chunk table row after its id: the short form unless the chunk has features or a
    base (a small chunk has neither, and most chunks of many small files are small)."""
    if info.features or info.base:
        return [info.plain_size, info.stored_size, info.features, info.base]
    return [info.plain_size, info.stored_size]


def chunk_info(fields: list[Any]) -> ChunkInfo:
    """ChunkInfo from a row's fields after its id, their types checked already.

    FormatError if features or base has a size no writer gives it.
    """
    info = ChunkInfo(*fields)
    features = len(info.features)
    if (
        features % FEATURE_SIZE
        or features > MAX_FEATURES * FEATURE_SIZE
        or len(info.base) not in (0, CHUNK_ID_SIZE)
    ):
        raise FormatError("malformed chunk record in metadata (features or base)")
    return info


def writer(info: WriterInfo) -> Op:
    return [WRITER, info.host, info.pid, info.mount_id, info.since_ns, info.released]


def new_inode(fields: list[Any], body: ExtentMap | dict[bytes, int] | None = None) -> Inode:
    """Build an inode from its wire fields (already type-checked), with its contents."""
    inode = Inode(*fields)
    if stat.S_ISREG(inode.mode):
        inode.extents = body if isinstance(body, ExtentMap) else ExtentMap()
    elif stat.S_ISDIR(inode.mode):
        inode.entries = body if isinstance(body, dict) else {}
    return inode


def apply(state: MetaState, op: Op, *, live: bool = False) -> None:
    """Apply one record to state. Raises FormatError if it is malformed or inconsistent.

    live=True is the engine applying a record it produced itself. A DATA
    record's inode size is then already the logical size (which may include
    newer, still-buffered writes) and must not be set back; a CHUNK record that
    replaces a row keeps the row's place (MetaState.put_chunk).
    """
    check(op)
    _APPLY[op[0]](state, op, live)


def _inode(state: MetaState, ino: int) -> Inode:
    try:
        return state.inodes[ino]
    except KeyError:
        raise FormatError(f"metadata refers to missing inode {ino}") from None


def _dir(state: MetaState, ino: int) -> dict[bytes, int]:
    entries = _inode(state, ino).entries
    if entries is None:
        raise FormatError(f"metadata uses inode {ino} as a directory")
    return entries


def _apply_put_inode(state: MetaState, op: Op, live: bool) -> None:
    fields = op[1:]
    old = state.inodes.get(fields[0])
    if old is None:
        state.inodes[fields[0]] = new_inode(fields)
        state.note_ino(fields[0])
        return
    if stat.S_IFMT(old.mode) != stat.S_IFMT(fields[1]):
        raise FormatError(f"metadata changes the type of inode {old.ino}")
    (_, old.mode, old.uid, old.gid, old.nlink, old.size, old.atime_ns, old.mtime_ns,
     old.ctime_ns, old.rdev, old.parent, old.target) = fields  # fmt: skip
    if old.extents is not None:
        old.extents.truncate(old.size)


def _apply_del_inode(state: MetaState, op: Op, live: bool) -> None:
    state.inodes.pop(op[1], None)


def _apply_link(state: MetaState, op: Op, live: bool) -> None:
    _inode(state, op[3])
    _dir(state, op[1])[op[2]] = op[3]


def _apply_unlink(state: MetaState, op: Op, live: bool) -> None:
    _dir(state, op[1]).pop(op[2], None)


def _apply_data(state: MetaState, op: Op, live: bool) -> None:
    inode = _inode(state, op[1])
    if inode.extents is None:
        raise FormatError(f"metadata writes data to non-file inode {inode.ino}")
    start, end = op[2], op[3]
    extents = [extent_from_wire(row) for row in op[4]]
    if any(e.start < start or e.end > end for e in extents):
        raise FormatError(f"data record for inode {inode.ino} strays outside its range")
    if any(a.end > b.start for a, b in pairwise(extents)):
        raise FormatError(f"data record for inode {inode.ino} has overlapping extents")
    inode.extents.replace(start, end, extents)
    if not live:
        inode.size = op[5]
        inode.extents.truncate(inode.size)


def _apply_set_xattr(state: MetaState, op: Op, live: bool) -> None:
    _inode(state, op[1]).xattrs[op[2]] = op[3]


def _apply_del_xattr(state: MetaState, op: Op, live: bool) -> None:
    _inode(state, op[1]).xattrs.pop(op[2], None)


def _apply_chunk(state: MetaState, op: Op, live: bool) -> None:
    state.put_chunk(op[1], chunk_info(op[2:]), keep_place=live)


def _apply_writer(state: MetaState, op: Op, live: bool) -> None:
    state.writer = WriterInfo(*op[1:])


_APPLY: dict[int, Callable[[MetaState, Op, bool], None]] = {
    PUT_INODE: _apply_put_inode,
    DEL_INODE: _apply_del_inode,
    LINK: _apply_link,
    UNLINK: _apply_unlink,
    DATA: _apply_data,
    SET_XATTR: _apply_set_xattr,
    DEL_XATTR: _apply_del_xattr,
    CHUNK: _apply_chunk,
    WRITER: _apply_writer,
}

# Integers on the wire are msgpack's: a natural number is at most U64_MAX, and a
# time (nanoseconds since the epoch) may also be negative, down to TIME_MIN_NS.
# Anything outside would fail to encode at commit time, after the operation
# that made it had already succeeded.
U64_MAX = 2**64 - 1
TIME_MIN_NS = -(2**63)
TIME_MAX_NS = U64_MAX


class _Time:
    """Marker in _SHAPES for a time field, the one kind of signed integer."""


# Wire types of each record's fields after the opcode (int means a natural number).
_N, _B, _T = int, bytes, _Time
_SHAPES: dict[int, tuple[type, ...]] = {
    PUT_INODE: (_N,) * 6 + (_T,) * 3 + (_N,) * 2 + (_B,),
    DEL_INODE: (_N,),
    LINK: (_N, _B, _N),
    UNLINK: (_N, _B),
    DATA: (_N, _N, _N, list, _N),
    SET_XATTR: (_N, _B, _B),
    DEL_XATTR: (_N, _B),
    CHUNK: (_B, _N, _N),
    WRITER: (str, _N, _B, _N, bool),
}
# Records that may also come in a longer form: a chunk with features or a base.
_LONG_SHAPES: dict[int, tuple[type, ...]] = {CHUNK: (_B, _N, _N, _B, _B)}
# Positions of atime, mtime and ctime among the inode fields.
_TIME_FIELDS = tuple(k for k, kind in enumerate(_SHAPES[PUT_INODE]) if kind is _Time)

# Inode fields that the kernel and the stat module hold in 32 bits: mode, uid, gid.
_U32_FIELDS = (1, 2, 3)
_U32_MAX = 0xFFFF_FFFF


def clamp_time(ns: int) -> int:
    """ns limited to the times the format can hold (about 1677 to 2554).

    Linux clamps every file system's times to what it can store rather than
    failing the call, so a far-off time set through the mount does the same.
    """
    return min(max(ns, TIME_MIN_NS), TIME_MAX_NS)


def check_inode_fields(fields: list[Any]) -> None:
    """The fast path of check() for the 12 inode fields of a snapshot row.

    Decoded msgpack cannot exceed its own integer range, so only the sign of
    the naturals needs checking here.
    """
    if type(fields[11]) is not bytes:
        raise FormatError("malformed inode record in metadata")
    for k in range(11):
        value = fields[k]
        if type(value) is not int or (value < 0 and k not in _TIME_FIELDS):
            raise FormatError("malformed inode record in metadata")
    _check_u32_fields(fields)


def _check_u32_fields(fields: list[Any]) -> None:
    # A larger mode would make the stat module raise OverflowError, not FormatError.
    if any(fields[k] > _U32_MAX for k in _U32_FIELDS):
        raise FormatError("malformed inode record in metadata (mode, uid or gid too large)")


def check(op: object) -> None:
    """FormatError unless op is a known record with fields of the right types and ranges."""
    if type(op) is not list or not op or type(op[0]) is not int or op[0] not in _SHAPES:
        raise FormatError("unknown operation record in metadata")
    shape = _SHAPES[op[0]]
    if len(op) != len(shape) + 1:
        shape = _LONG_SHAPES.get(op[0], shape)
    if len(op) != len(shape) + 1:
        raise FormatError(f"malformed operation record (opcode {op[0]}) in metadata")
    for kind, value in zip(shape, op[1:], strict=True):
        # One loop, no call per field: this runs for every operation the engine makes.
        # type() rather than isinstance(): True is not a number here.
        if kind is int:
            fits = type(value) is int and 0 <= value <= U64_MAX
        elif kind is _Time:
            fits = type(value) is int and TIME_MIN_NS <= value <= TIME_MAX_NS
        else:
            fits = type(value) is kind
        if not fits:
            raise FormatError(f"malformed operation record (opcode {op[0]}) in metadata")
    if op[0] == PUT_INODE:
        _check_u32_fields(op[1:])
