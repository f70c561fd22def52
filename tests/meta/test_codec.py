"""Segments and snapshots as sealed objects: round trips, tampering, names."""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
from typing import Any

import msgpack
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from sealfs.crypto.envelope import ObjectKind
from sealfs.crypto.keyring import KeyRing
from sealfs.crypto.subkeys import derive_subkeys
from sealfs.errors import FormatError, IntegrityError
from sealfs.meta import ops
from sealfs.meta.codec import (
    LoggedSegment,
    Segment,
    _seal,
    decode_segment,
    decode_snapshot,
    encode_segment,
    encode_snapshot,
    parse_generation,
    segment_name,
    snapshot_name,
)
from sealfs.meta.extents import Extent
from sealfs.meta.model import ROOT_INO, ChunkInfo, MetaState, WriterInfo
from sealfs.meta.replay import replay_segment

VOLUME_ID = bytes(range(16))
SUBKEYS = derive_subkeys(bytes(range(32)), VOLUME_ID)
KEYS = (0, SUBKEYS)
RING = KeyRing(0, SUBKEYS)


def state_signature(state: MetaState) -> dict[str, Any]:
    """Everything a MetaState holds, as plain comparable values."""
    return {
        "generation": state.generation,
        "head": state.head_hash,
        "time": state.committed_ns,
        "next_ino": state.next_ino,
        "writer": state.writer,
        "chunks": dict(state.chunks),
        "chunks_stored_bytes": state.chunks_stored_bytes,
        "inodes": {ino: inode_signature(inode) for ino, inode in state.inodes.items()},
    }


def inode_signature(inode: Any) -> tuple[Any, ...]:
    return (
        *ops.inode_fields(inode),
        dict(inode.xattrs),
        None if inode.extents is None else inode.extents.to_wire(),
        None if inode.entries is None else dict(inode.entries),
    )


def inode_record(ino: int, mode: int, *, nlink: int = 1, size: int = 0, parent: int = 0) -> ops.Op:
    return ops.new_inode_record(
        ino=ino, mode=mode, uid=1000, gid=1000, nlink=nlink, size=size, atime_ns=1,
        mtime_ns=2, ctime_ns=3, rdev=0, parent=parent, target=b"",
    )  # fmt: skip


def sample_records() -> list[ops.Op]:
    """A small volume: root, a directory, a file with two extents, a symlink, xattrs."""
    chunk_a, chunk_b = b"A" * 32, b"B" * 32
    link = ops.new_inode_record(
        ino=5, mode=stat.S_IFLNK | 0o777, uid=0, gid=0, nlink=1, size=3, atime_ns=1,
        mtime_ns=1, ctime_ns=1, rdev=0, parent=0, target=b"a/b",
    )  # fmt: skip
    return [
        inode_record(ROOT_INO, stat.S_IFDIR | 0o755, nlink=3, parent=ROOT_INO),
        inode_record(2, stat.S_IFDIR | 0o700, nlink=2, parent=ROOT_INO),
        ops.link(ROOT_INO, b"dir", 2),
        inode_record(3, stat.S_IFREG | 0o644, size=0),
        ops.link(2, b"file", 3),
        ops.chunk(chunk_a, ChunkInfo(100, 80)),
        ops.chunk(chunk_b, ChunkInfo(50, 60)),
        ops.data(3, 0, 150, [Extent(0, 100, chunk_a, 0), Extent(100, 50, chunk_b, 0)], 150),
        ops.set_xattr(3, b"user.k", b"v"),
        link,
        ops.link(ROOT_INO, b"sym", 5),
        ops.writer(WriterInfo("host", 42, b"m" * 16, 7, False)),
    ]


def build_segments(
    batches: list[list[ops.Op]], start_gen: int = 1
) -> list[tuple[LoggedSegment, bytes]]:
    """Seal consecutive segments with a correct hash chain."""
    out = []
    prev = bytes(32)
    state = MetaState()
    for k, batch in enumerate(batches):
        seg = Segment(start_gen + k, prev, 1000 + k, batch)
        sealed, digest = encode_segment(KEYS, VOLUME_ID, seg)
        logged = LoggedSegment(seg, digest, len(sealed))
        replay_segment(state, logged)
        prev = state.head_hash
        out.append((logged, sealed))
    return out


def test_segment_round_trip() -> None:
    seg = Segment(7, os.urandom(32), 123456789, sample_records())
    sealed, digest = encode_segment(KEYS, VOLUME_ID, seg)
    logged = decode_segment(RING, VOLUME_ID, 7, sealed)
    assert logged.segment == seg and logged.size == len(sealed)
    # The chain digest is SHA-256 of the msgpack payload (format.md section 9).
    payload = {"gen": 7, "prev": seg.prev_hash, "time": 123456789, "ops": seg.ops}
    assert logged.digest == digest == hashlib.sha256(msgpack.packb(payload)).digest()


@settings(max_examples=50)
@given(st.lists(st.binary(max_size=300), max_size=20))
def test_segment_round_trip_of_arbitrary_xattr_records(values: list[bytes]) -> None:
    records = [ops.set_xattr(2, b"user.%d" % k, v) for k, v in enumerate(values)]
    seg = Segment(3, bytes(32), 1, records)
    sealed = encode_segment(KEYS, VOLUME_ID, seg)[0]
    assert decode_segment(RING, VOLUME_ID, 3, sealed).segment == seg


def test_snapshot_round_trip() -> None:
    state = MetaState()
    for logged, _ in build_segments([sample_records()[:6], sample_records()[6:]]):
        replay_segment(state, logged)
    sealed = encode_snapshot(KEYS, VOLUME_ID, state)
    back = decode_snapshot(RING, VOLUME_ID, state.generation, sealed)
    assert state_signature(back) == state_signature(state)


def test_times_at_the_ends_of_their_range_round_trip() -> None:
    """Times are signed (before 1970 is negative) and reach msgpack's unsigned maximum."""
    times = {"atime_ns": ops.TIME_MIN_NS, "mtime_ns": -1_500_000_001, "ctime_ns": ops.TIME_MAX_NS}
    file = ops.new_inode_record(**{
        **dict(zip(ops.INODE_FIELD_NAMES, inode_record(3, stat.S_IFREG | 0o644)[1:], strict=True)),
        **times,
    })  # fmt: skip
    records = [*sample_records(), file]
    ((logged, sealed),) = build_segments([records])
    assert decode_segment(RING, VOLUME_ID, 1, sealed).segment == logged.segment
    state = MetaState()
    replay_segment(state, logged)
    back = decode_snapshot(RING, VOLUME_ID, 1, encode_snapshot(KEYS, VOLUME_ID, state))
    inode = back.inodes[3]
    assert (inode.atime_ns, inode.mtime_ns, inode.ctime_ns) == tuple(times.values())


def test_chunk_rows_keep_their_features_and_base_through_log_and_snapshot() -> None:
    whole, delta, plain = b"W" * 32, b"D" * 32, b"P" * 32
    records = [
        ops.chunk(whole, ChunkInfo(1 << 20, 300_000, b"f" * 16)),
        ops.chunk(delta, ChunkInfo(1 << 20, 900, b"g" * 8 + b"h" * 8, whole)),
        ops.chunk(plain, ChunkInfo(10, 46)),
    ]
    assert [len(r) for r in records] == [6, 6, 4]  # the short form without either
    ((logged, sealed),) = build_segments([records])
    assert decode_segment(RING, VOLUME_ID, 1, sealed).segment == logged.segment
    state = MetaState()
    replay_segment(state, logged)
    back = decode_snapshot(RING, VOLUME_ID, 1, encode_snapshot(KEYS, VOLUME_ID, state))
    assert back.chunks == state.chunks
    assert back.chunks[delta] == ChunkInfo(1 << 20, 900, b"g" * 8 + b"h" * 8, whole)
    back.index_features()
    # a difference is never taken from a difference: delta's features name whole
    assert back.similar_roots(b"h" * 8 + b"f" * 8) == [whole]
    assert back.similar_roots(b"g" * 8 + b"h" * 8 + b"x" * 8) == [whole]
    assert back.similar_roots(b"g" * 8 + b"x" * 8) == []  # one piece alike is no likeness
    assert back.similar_roots(b"x" * 16) == []


@pytest.mark.parametrize(
    "row", [[1, 2, b"f" * 15, b""], [1, 2, b"", b"b" * 31], [1, 2, b"f" * 16, 3], [1, 2, b""]]
)
def test_chunk_records_with_features_or_base_of_another_size_are_refused(row: list[object]) -> None:
    with pytest.raises(FormatError):
        ops.apply(MetaState(), [ops.CHUNK, b"C" * 32, *row])
    payload = {
        "gen": 2, "head": bytes(32), "time": 1, "next_ino": 9, "writer": None,
        "inodes": [], "chunks": [[b"C" * 32, *row]],
    }  # fmt: skip
    with pytest.raises(FormatError):
        decode_snapshot(RING, VOLUME_ID, 2, sealed_payload(ObjectKind.SNAPSHOT, 2, payload))


def test_snapshot_of_an_empty_state_round_trips() -> None:
    state = MetaState()
    sealed = encode_snapshot(KEYS, VOLUME_ID, state)
    assert state_signature(decode_snapshot(RING, VOLUME_ID, 0, sealed)) == state_signature(state)


@settings(max_examples=60)
@given(st.data())
def test_tampered_segment_is_refused(data: st.DataObject) -> None:
    sealed = encode_segment(KEYS, VOLUME_ID, Segment(4, bytes(32), 1, sample_records()))[0]
    pos = data.draw(st.integers(0, len(sealed) - 1))
    bit = data.draw(st.integers(0, 7))
    tampered = bytearray(sealed)
    tampered[pos] ^= 1 << bit
    with pytest.raises((IntegrityError, FormatError)):
        decode_segment(RING, VOLUME_ID, 4, bytes(tampered))


@settings(max_examples=30)
@given(st.integers(0, 200))
def test_truncated_snapshot_is_refused(cut: int) -> None:
    state = MetaState()
    for logged, _ in build_segments([sample_records()]):
        replay_segment(state, logged)
    sealed = encode_snapshot(KEYS, VOLUME_ID, state)
    with pytest.raises((IntegrityError, FormatError)):
        decode_snapshot(RING, VOLUME_ID, 1, sealed[: min(cut, len(sealed) - 1)])


def test_objects_are_bound_to_name_kind_key_and_volume() -> None:
    seg = Segment(4, bytes(32), 1, sample_records())
    sealed = encode_segment(KEYS, VOLUME_ID, seg)[0]
    with pytest.raises(IntegrityError):
        decode_segment(RING, VOLUME_ID, 5, sealed)  # moved to another generation
    with pytest.raises(IntegrityError):
        decode_segment(RING, bytes(16), 4, sealed)  # another volume
    with pytest.raises(IntegrityError):
        decode_segment(
            KeyRing(0, derive_subkeys(bytes(32), VOLUME_ID)), VOLUME_ID, 4, sealed
        )  # another key
    with pytest.raises((IntegrityError, FormatError)):
        decode_snapshot(RING, VOLUME_ID, 4, sealed)  # a segment is not a snapshot
    snap = encode_snapshot(KEYS, VOLUME_ID, MetaState(generation=4))
    with pytest.raises((IntegrityError, FormatError)):
        decode_segment(RING, VOLUME_ID, 4, snap)


def test_names_are_fixed_width_and_sort_by_generation() -> None:
    names = [segment_name(g) for g in (1, 9, 10, 100, 12345678)]
    assert names == sorted(names)
    assert all(
        parse_generation(n) == g for n, g in zip(names, (1, 9, 10, 100, 12345678), strict=True)
    )
    assert parse_generation(snapshot_name(77)) == 77
    for bad in ("l/12", "l/abcdefghijklmnop", "s/", "l/-000000000000001"):
        with pytest.raises(FormatError):
            parse_generation(bad)
    # A copy an operator left beside a segment names the way out (it named none).
    with pytest.raises(FormatError, match=r"'l/0000000000000099.bak'.*move it out of the store"):
        parse_generation("l/0000000000000099.bak")


def sealed_payload(kind: ObjectKind, gen: int, payload: object) -> bytes:
    return _seal(KEYS, VOLUME_ID, kind, gen, payload)[0]


@pytest.mark.parametrize(
    "payload",
    [
        [1, 2, 3],
        {},
        {"gen": 3, "prev": bytes(32), "time": 1},
        {"gen": 4, "prev": bytes(32), "time": 1, "ops": []},  # name says 3
        {"gen": 3, "prev": bytes(31), "time": 1, "ops": []},
        {"gen": 3, "prev": bytes(32), "time": True, "ops": []},
        {"gen": 3, "prev": bytes(32), "time": 1, "ops": {}},
    ],
)
def test_malformed_segment_payload_is_a_format_error(payload: object) -> None:
    with pytest.raises(FormatError):
        decode_segment(RING, VOLUME_ID, 3, sealed_payload(ObjectKind.SEGMENT, 3, payload))


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.binary(max_size=40)
    | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=14)
    | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=30,
)  # fmt: skip


@settings(max_examples=150)
@given(
    st.lists(msgpack_values, max_size=3),
    st.lists(msgpack_values, max_size=3),
    msgpack_values,
)
def test_malformed_snapshot_rows_are_format_errors(
    rows: list[object], chunk_rows: list[object], writer: object
) -> None:
    payload = {
        "gen": 2, "head": bytes(32), "time": 1, "next_ino": 9, "writer": writer,
        "inodes": rows, "chunks": chunk_rows,
    }  # fmt: skip
    with contextlib.suppress(FormatError):
        decode_snapshot(RING, VOLUME_ID, 2, sealed_payload(ObjectKind.SNAPSHOT, 2, payload))


@settings(max_examples=200)
@given(st.integers(0, 13), msgpack_values)
@example(1, 2**32)  # a mode past 32 bits made the stat module raise OverflowError
@example(3, 2**64 - 1)
def test_snapshot_inode_row_with_one_bad_field_is_a_format_error(index: int, value: object) -> None:
    row = [3, stat.S_IFREG | 0o644, 0, 0, 1, 10, 1, 1, 1, 0, 0, b"", {}, []]
    row[index] = value
    payload = {
        "gen": 2, "head": bytes(32), "time": 1, "next_ino": 9, "writer": None,
        "inodes": [row], "chunks": [],
    }  # fmt: skip
    with contextlib.suppress(FormatError):
        decode_snapshot(RING, VOLUME_ID, 2, sealed_payload(ObjectKind.SNAPSHOT, 2, payload))
