from hypothesis import given
from hypothesis import strategies as st

from sealfs.volume.buffers import BlockPool, SparseBuffer

writes = st.lists(
    st.tuples(st.integers(0, 300), st.binary(min_size=0, max_size=60), st.booleans()), max_size=30
)


@given(writes, st.integers(0, 400))
def test_buffer_matches_a_flat_reference(ops: list[tuple[int, bytes, bool]], cut: int) -> None:
    buf, ref, known = SparseBuffer(), bytearray(400), [False] * 400
    for offset, data, under in ops:
        if under:
            buf.write_under(offset, data)
        else:
            buf.write(offset, data)
        for k, byte in enumerate(data):
            if not (under and known[offset + k]):
                ref[offset + k] = byte
            known[offset + k] = True
    buf.truncate(cut)
    for k in range(cut, 400):
        known[k], ref[k] = False, 0
    out = bytearray(400)
    buf.overlay(out, 0)
    assert out == ref
    assert buf.nbytes == sum(known)
    covered = [False] * 400
    for start, data in buf.ranges():
        for k in range(start, start + len(data)):
            covered[k] = True
    assert covered == known


def test_sequential_appends_stay_one_range() -> None:
    buf = SparseBuffer()
    for k in range(100):
        buf.write(k * 10, b"x" * 10)
    assert len(buf.ranges()) == 1
    assert buf.nbytes == 1000


def test_copy_range_is_detached() -> None:
    buf = SparseBuffer()
    buf.write(0, b"abcdef")
    part = buf.copy_range(2, 4)
    buf.write(0, b"zzzzzz")
    out = bytearray(6)
    part.overlay(out, 0)
    assert out == b"\0\0cd\0\0"


def tiny_pool(**kw: int) -> BlockPool:
    """Blocks of 64 bytes, taken by ranges past 8: the pooled paths at hypothesis's sizes."""
    return BlockPool(64, promote_at=8, **kw)


@given(writes, st.integers(0, 400))
def test_pooled_buffer_matches_a_flat_reference(
    ops: list[tuple[int, bytes, bool]], cut: int
) -> None:
    pool = tiny_pool(max_blocks=2)
    buf, ref = SparseBuffer(pool), bytearray(400)
    known = [False] * 400
    for offset, data, under in ops:
        if under:
            buf.write_under(offset, data)
        else:
            buf.write(offset, data)
        for k, byte in enumerate(data):
            if not (under and known[offset + k]):
                ref[offset + k] = byte
            known[offset + k] = True
    buf.truncate(cut)
    out = bytearray(400)
    buf.overlay(out, 0)
    assert out[:cut] == ref[:cut] and not any(out[cut:])
    assert buf.nbytes == sum(known[:cut])
    copy = buf.copy_range(0, 400)
    buf.release()
    assert pool.lent == 0 and not buf and buf.nbytes == 0
    again = bytearray(400)
    copy.overlay(again, 0)
    assert again == out, "a copy must not share storage with a released block"


def test_a_streaming_range_moves_into_a_block_and_the_block_is_reused() -> None:
    pool = tiny_pool()
    first = SparseBuffer(pool)
    for k in range(6):
        first.write(k * 5, bytes([k]) * 5)
    block = first.ranges()[0][1].obj
    assert pool.lent == 1 and len(block) == 64
    first.release()
    second = SparseBuffer(pool)
    second.write(0, b"z" * 8)
    second.write(8, b"z" * 12)
    assert second.ranges()[0][1].obj is block
    assert bytes(second.ranges()[0][1]) == b"z" * 20, "old bytes beyond a range never show"


def test_a_block_with_a_live_view_is_not_reused() -> None:
    pool = tiny_pool()
    first = SparseBuffer(pool)
    first.write(0, b"a" * 8)
    first.write(8, b"a" * 22)
    view = first.ranges()[0][1]
    first.release()
    second = SparseBuffer(pool)
    second.write(0, b"b" * 8)
    second.write(8, b"b" * 22)
    assert second.ranges()[0][1].obj is not view.obj
    assert bytes(view) == b"a" * 30
    assert pool.lent == 1


def test_a_range_outgrowing_its_block_keeps_its_bytes() -> None:
    pool = tiny_pool()
    buf = SparseBuffer(pool)
    data = bytes(range(100))
    for k in range(0, 100, 10):
        buf.write(k, data[k : k + 10])
    assert pool.lent == 0, "the block went back when the range left it"
    assert [(start, bytes(view)) for start, view in buf.ranges()] == [(0, data)]


def test_blocks_lent_at_once_are_bounded() -> None:
    pool = tiny_pool(max_blocks=1)
    a, b = SparseBuffer(pool), SparseBuffer(pool)
    a.write(0, b"x" * 5)
    a.write(5, b"x" * 15)
    b.write(0, b"y" * 5)
    b.write(5, b"y" * 15)
    assert pool.lent == 1
    assert bytes(b.ranges()[0][1]) == b"y" * 20
