"""Operation records, replay with its hash chain, and compaction."""

from __future__ import annotations

import contextlib
import stat
from itertools import pairwise

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sealfs.crypto.envelope import ObjectKind, generation_binding, reseal
from sealfs.crypto.keyring import KeyRing
from sealfs.crypto.subkeys import derive_subkeys
from sealfs.errors import FormatError, IntegrityError
from sealfs.meta import ops
from sealfs.meta.codec import (
    LoggedSegment,
    Segment,
    decode_segment,
    decode_snapshot,
    encode_segment,
)
from sealfs.meta.compact import compact
from sealfs.meta.extents import Extent
from sealfs.meta.model import ROOT_INO, ChunkInfo, MetaState
from sealfs.meta.replay import replay_segment
from tests.meta.test_codec import (
    KEYS,
    RING,
    VOLUME_ID,
    build_segments,
    inode_record,
    sample_records,
    state_signature,
)

msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False)
    | st.binary(max_size=40) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=7) | st.dictionaries(
        st.text(max_size=5) | st.integers(0, 9) | st.binary(max_size=4), inner, max_size=4
    ),
    max_leaves=25,
)  # fmt: skip

field_values = (
    st.integers(-2, 12) | st.sampled_from([stat.S_IFDIR | 0o755, stat.S_IFREG | 0o644])
    | st.sampled_from([2**32, 2**64 - 1])  # beyond what stat and the kernel take
    | st.binary(max_size=3) | st.sampled_from([b"A" * 32, b"x"]) | st.booleans() | st.none()
    | st.text(max_size=3)
    | st.lists(st.lists(st.integers(-1, 40) | st.sampled_from([b"A" * 32]), max_size=5), max_size=3)
)  # fmt: skip


@st.composite
def near_records(draw: st.DrawFn) -> list[object]:
    """Records with a real opcode and fields that are mostly of the right kind."""
    opcode = draw(st.integers(0, 10))
    width = {1: 12, 2: 1, 3: 3, 4: 2, 5: 5, 6: 3, 7: 2, 8: 3, 9: 5}.get(opcode, 2)
    width = draw(st.sampled_from([width, width, width, width - 1, width + 1]))
    return [opcode, *draw(st.lists(field_values, min_size=max(width, 0), max_size=max(width, 0)))]


def base_state() -> MetaState:
    state = MetaState()
    for op in sample_records():
        ops.apply(state, op)
    return state


def check_extent_maps(state: MetaState) -> None:
    for inode in state.inodes.values():
        if inode.extents is None:
            continue
        extents = list(inode.extents)
        assert all(e.length > 0 for e in extents)
        assert all(a.end <= b.start for a, b in pairwise(extents))


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(msgpack_values | near_records(), min_size=1, max_size=4))
def test_apply_on_malformed_records_raises_only_format_error(records: list[object]) -> None:
    state = base_state()
    for record in records:
        with contextlib.suppress(FormatError):
            ops.apply(state, record)  # type: ignore[arg-type]
    check_extent_maps(state)


@pytest.mark.parametrize(
    "record",
    [
        [],
        [[1]],  # an unhashable opcode
        [{}],
        [99],
        [ops.DEL_INODE, -1],
        [ops.DEL_INODE, True],
        [ops.LINK, 77, b"x", 3],  # no such directory
        [ops.LINK, 3, b"x", 2],  # a file used as a directory
        [ops.LINK, ROOT_INO, b"x", 77],  # no such inode
        [ops.DATA, 2, 0, 10, [], 10],  # data for a directory
        [ops.DATA, 3, 0, 10, [[0, 20, b"A" * 32, 0]], 10],  # strays outside its range
        [ops.DATA, 3, 0, 10, [[0, 0, b"A" * 32, 0]], 10],  # empty extent
        [ops.DATA, 3, 0, 10, [[0, 5, b"A" * 31, 0]], 10],  # short chunk id
        [ops.DATA, 3, 0, 10, [[0, 5, b"A" * 32, 0, 1]], 10],
        [ops.SET_XATTR, 77, b"a", b"b"],
        [ops.PUT_INODE, *inode_record(3, stat.S_IFDIR | 0o755)[1:]],  # type change
        [ops.WRITER, "h", 1, b"m", 1, 1],
        # Past msgpack's integers: the engine must never queue what cannot be committed.
        [ops.DEL_INODE, ops.U64_MAX + 1],
        ops.put_inode(base_state().inodes[3], mtime_ns=ops.TIME_MAX_NS + 1),
        ops.put_inode(base_state().inodes[3], atime_ns=ops.TIME_MIN_NS - 1),
        ops.put_inode(base_state().inodes[3], size=-1),
    ],
)
def test_apply_refuses_malformed_record(record: list[object]) -> None:
    state = base_state()
    with pytest.raises(FormatError):
        ops.apply(state, record)


def test_data_record_with_overlapping_extents_is_refused() -> None:
    state = base_state()
    a = b"A" * 32
    with pytest.raises(FormatError):
        ops.apply(state, [ops.DATA, 3, 0, 100, [[0, 50, a, 0], [10, 50, a, 0]], 100])
    check_extent_maps(state)


def test_put_inode_shrinking_size_truncates_extents() -> None:
    state = base_state()
    inode = state.inodes[3]
    ops.apply(state, ops.put_inode(inode, size=120))
    assert inode.extents is not None
    assert [e.end for e in inode.extents] == [100, 120]


def test_data_record_sets_size_on_replay_but_not_live() -> None:
    a = b"A" * 32
    replayed, live = base_state(), base_state()
    record = ops.data(3, 150, 200, [Extent(150, 50, a, 0)], 200)
    ops.apply(replayed, record)
    assert replayed.inodes[3].size == 200
    live.inodes[3].size = 500  # newer bytes still buffered
    ops.apply(live, record, live=True)
    assert live.inodes[3].size == 500


def test_the_stored_total_follows_every_chunk_row() -> None:
    """statfs reads the running total, so a re-sealed chunk must replace its row's size."""
    state = MetaState()
    ops.apply(state, ops.chunk(b"A" * 32, ChunkInfo(100, 80)))
    ops.apply(state, ops.chunk(b"B" * 32, ChunkInfo(50, 60)))
    ops.apply(state, ops.chunk(b"A" * 32, ChunkInfo(100, 90)))  # a rekey re-sealed it
    assert state.chunks_stored_bytes == 150
    state.set_chunks({b"C" * 32: ChunkInfo(10, 7)})
    assert state.chunks_stored_bytes == 7


def test_replay_applies_segments_in_order_and_tracks_the_chain() -> None:
    segments = build_segments([sample_records()[:4], sample_records()[4:]])
    state = MetaState()
    for logged, _ in segments:
        replay_segment(state, logged)
    assert state.generation == 2
    assert state.committed_ns == segments[-1][0].segment.time_ns
    assert state.inodes[3].size == 150
    assert state.next_ino == 6


def test_replay_rejects_a_gap() -> None:
    segments = build_segments([sample_records(), [ops.set_xattr(ROOT_INO, b"a", b"1")], []])
    state = MetaState()
    replay_segment(state, segments[0][0])
    with pytest.raises(IntegrityError, match="missing"):
        replay_segment(state, segments[2][0])
    assert state.generation == 1
    with pytest.raises(IntegrityError):
        replay_segment(state, segments[0][0])  # a replay of an old segment is a gap too


def test_replay_rejects_a_broken_hash_chain() -> None:
    first, second = build_segments([sample_records(), [ops.set_xattr(3, b"a", b"1")]])
    state = MetaState()
    replay_segment(state, first[0])
    forged = Segment(2, bytes(32), 5, second[0].segment.ops)
    sealed, digest = encode_segment(KEYS, VOLUME_ID, forged)
    with pytest.raises(IntegrityError, match="hash chain"):
        replay_segment(state, LoggedSegment(forged, digest, len(sealed)))
    # Segment 1 with the same records but another commit time: the chain breaks.
    other_first = Segment(1, bytes(32), first[0].segment.time_ns + 1, first[0].segment.ops)
    sealed, digest = encode_segment(KEYS, VOLUME_ID, other_first)
    other = MetaState()
    replay_segment(other, LoggedSegment(other_first, digest, len(sealed)))
    with pytest.raises(IntegrityError, match="hash chain"):
        replay_segment(other, second[0])


def test_chain_survives_resealing_under_a_new_key_epoch() -> None:
    """The chain hashes payloads, so a rekey can re-seal the log without breaking it."""
    (_, first_sealed), (_, second_sealed) = build_segments(
        [sample_records(), [ops.set_xattr(3, b"a", b"1")]]
    )
    new_keys = derive_subkeys(bytes(32), VOLUME_ID)
    ring = KeyRing(0, KEYS[1])
    ring.advance(1, new_keys)
    binding = generation_binding(VOLUME_ID, 1)
    resealed = reseal(
        KEYS[1].meta_key, new_keys.meta_key, 1, ObjectKind.SEGMENT, binding, first_sealed
    )
    assert resealed != first_sealed
    state = MetaState()
    replay_segment(state, decode_segment(ring, VOLUME_ID, 1, resealed))
    replay_segment(state, decode_segment(ring, VOLUME_ID, 2, second_sealed))
    assert state.generation == 2
    ring.drop_retired()
    with pytest.raises(IntegrityError, match="key epoch 0"):
        decode_segment(ring, VOLUME_ID, 2, second_sealed)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 6), st.integers(0, 6))
def test_compact_equals_replay_of_the_whole_log(split: int, split2: int) -> None:
    batches: list[list[ops.Op]] = [sample_records()]
    a = b"A" * 32
    for k in range(6):
        batches.append([
            ops.set_xattr(3, b"user.n", b"%d" % k),
            ops.data(3, k * 10, k * 10 + 5, [Extent(k * 10, 5, a, k)], 150 + k),
            inode_record(10 + k, stat.S_IFREG | 0o600),
            ops.link(2, b"f%d" % k, 10 + k),
            *([ops.unlink(2, b"f%d" % (k - 1)), ops.del_inode(9 + k)] if k else []),
        ])  # fmt: skip
    segments = build_segments(batches)
    live = MetaState()
    for logged, _ in segments:
        replay_segment(live, logged)

    lo, hi = sorted((split, split2))
    logged = [seg for seg, _ in segments]
    base = compact(RING, KEYS, VOLUME_ID, None, logged[:lo]) if lo else None
    mid = compact(RING, KEYS, VOLUME_ID, base, logged[lo:hi]) if hi > lo else base
    gen, sealed = compact(RING, KEYS, VOLUME_ID, mid, logged[hi:])
    assert gen == live.generation
    assert state_signature(decode_snapshot(RING, VOLUME_ID, gen, sealed)) == state_signature(live)


def test_compact_refuses_a_tail_that_does_not_follow_the_base() -> None:
    segments = build_segments([sample_records(), [], []])
    logged = [seg for seg, _ in segments]
    base = compact(RING, KEYS, VOLUME_ID, None, logged[:1])
    with pytest.raises(IntegrityError):
        compact(RING, KEYS, VOLUME_ID, base, logged[2:])


def test_the_size_a_record_leaves_is_what_applying_it_leaves() -> None:
    """A follower reads it off a commit's records before replaying them (to keep the
    version before a shrink): it must agree with apply."""
    state = base_state()
    inode = state.inodes[3]
    extent = Extent(0, 10, b"c" * 32, 0)
    for op in (ops.put_inode(inode, size=5), ops.data(3, 0, 10, [extent], 10)):
        ops.apply(state, op)
        assert ops.size_set_by(op) == state.inodes[3].size
    assert ops.size_set_by(ops.unlink(ROOT_INO, b"x")) is None
