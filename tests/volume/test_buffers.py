from hypothesis import given, settings
from hypothesis import strategies as st

from sealfs.volume.buffers import BlockPool, SparseBuffer

writes = st.lists(
    st.tuples(st.integers(0, 300), st.binary(min_size=0, max_size=60), st.booleans()), max_size=30
)


class Reference:
    """The flat model of a buffer: its bytes, and which of them were written."""

    def __init__(self) -> None:
        self.data, self.known = bytearray(400), [False] * 400

    def write(self, offset: int, data: bytes, under: bool) -> None:
        for k, byte in enumerate(data):
            if not (under and self.known[offset + k]):
                self.data[offset + k] = byte
            self.known[offset + k] = True

    def truncate(self, cut: int) -> None:
        for k in range(cut, 400):
            self.known[k], self.data[k] = False, 0


def write_both(buf: SparseBuffer, ops: list[tuple[int, bytes, bool]]) -> Reference:
    """Apply ops to buf and to a flat reference, and return the reference."""
    ref = Reference()
    for offset, data, under in ops:
        if under:
            buf.write_under(offset, data)
        else:
            buf.write(offset, data)
        ref.write(offset, data, under)
    return ref


@given(writes, st.integers(0, 400))
def test_buffer_matches_a_flat_reference(ops: list[tuple[int, bytes, bool]], cut: int) -> None:
    buf = SparseBuffer()
    ref = write_both(buf, ops)
    buf.truncate(cut)
    ref.truncate(cut)
    out = bytearray(400)
    buf.overlay(out, 0)
    assert out == ref.data
    assert buf.nbytes == sum(ref.known)
    covered = [False] * 400
    for start, data in buf.ranges():
        for k in range(start, start + len(data)):
            covered[k] = True
    assert covered == ref.known


@given(writes, st.integers(0, 400), st.integers(0, 400))
def test_ranges_in_lists_the_ranges_that_begin_inside(
    ops: list[tuple[int, bytes, bool]], lo: int, hi: int
) -> None:
    buf = SparseBuffer()
    write_both(buf, ops)
    listed = [(start, bytes(data)) for start, data in buf.ranges_in(lo, hi)]
    assert listed == [(start, bytes(data)) for start, data in buf.ranges() if lo <= start < hi]


@given(writes, st.integers(0, 400), st.integers(0, 400))
def test_windows_read_and_copy_only_the_bytes_inside(
    ops: list[tuple[int, bytes, bool]], lo: int, hi: int
) -> None:
    """overlay and copy_range of a window anywhere in the buffer, touching ranges that
    start before it, end inside it, or only touch its edges."""
    buf = SparseBuffer()
    ref = write_both(buf, ops)
    hi = max(lo, hi)
    out = bytearray(b"?" * (hi - lo))
    buf.overlay(out, lo)
    assert out == bytes(ref.data[k] if ref.known[k] else ord("?") for k in range(lo, hi))
    part = buf.copy_range(lo, hi)
    covered = [False] * 400
    for start, data in part.ranges():
        assert bytes(data) == ref.data[start : start + len(data)]
        for k in range(start, start + len(data)):
            covered[k] = True
    assert covered == [lo <= k < hi and ref.known[k] for k in range(400)]


def test_writing_under_many_ranges_fills_only_the_gaps() -> None:
    """A failed flush puts each of its ranges back under newer writes: every gap between
    the newer ranges is filled, no newer byte is overwritten, whatever their number."""
    buf = SparseBuffer()
    for k in range(0, 40_000, 4):
        buf.write(k, b"n")  # newer writes: every fourth byte
    old = bytes(range(256)) * 160  # 40,960 bytes, one range each put back
    for k in range(0, 40_000, 8):
        buf.write_under(k, old[k : k + 8])
    out = bytearray(40_000)
    buf.overlay(out, 0)
    assert out == bytes(b"n"[0] if k % 4 == 0 else old[k] for k in range(40_000))
    assert buf.nbytes == 40_000


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
    """Blocks taken by ranges past 8 bytes and kept up to 64: the pooled paths at
    hypothesis's sizes."""
    return BlockPool(64, promote_at=8, **kw)


@given(writes, st.integers(0, 400))
def test_pooled_buffer_matches_a_flat_reference(
    ops: list[tuple[int, bytes, bool]], cut: int
) -> None:
    pool = tiny_pool(max_blocks=2)
    buf = SparseBuffer(pool)
    ref = write_both(buf, ops)
    buf.truncate(cut)
    out = bytearray(400)
    buf.overlay(out, 0)
    assert out[:cut] == ref.data[:cut] and not any(out[cut:])
    assert buf.nbytes == sum(ref.known[:cut])
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
    assert pool.lent == 1 and len(block) == 30
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


def test_a_block_grows_with_its_range_and_long_blocks_are_not_kept() -> None:
    pool = tiny_pool()
    buf = SparseBuffer(pool)
    data = bytes(range(100))
    for k in range(0, 100, 10):
        buf.write(k, data[k : k + 10])
    block = buf.ranges()[0][1].obj
    assert pool.lent == 1 and len(block) == 100, "a block holds what was written, no more"
    assert [(start, bytes(view)) for start, view in buf.ranges()] == [(0, data)]
    buf.release()
    assert pool.lent == 0 and pool.idle_blocks == 0, "longer than max_keep: dropped"


def test_blocks_lent_at_once_are_bounded() -> None:
    pool = tiny_pool(max_blocks=1)
    a, b = SparseBuffer(pool), SparseBuffer(pool)
    a.write(0, b"x" * 5)
    a.write(5, b"x" * 15)
    b.write(0, b"y" * 5)
    b.write(5, b"y" * 15)
    assert pool.lent == 1
    assert bytes(b.ranges()[0][1]) == b"y" * 20


shared_ops = st.lists(
    st.tuples(
        st.sampled_from(["write", "write", "under", "truncate", "detach"]),
        st.integers(0, 1),  # which of the two buffers
        st.integers(0, 120),  # close together, so that ranges grow into blocks
        st.binary(min_size=1, max_size=30),
    ),
    max_size=40,
)


@settings(max_examples=300)
@given(shared_ops)
def test_buffers_sharing_a_pool_never_see_each_others_bytes(
    ops: list[tuple[str, int, int, bytes]],
) -> None:
    """Two files' buffers on one pool. "detach" is what a flush does: it views the
    ranges (as the chunks being sealed do), the buffer is released while those views
    live (a failed flush's traceback can hold them), and the file starts afresh."""
    pool = tiny_pool(max_blocks=2)
    bufs = [SparseBuffer(pool), SparseBuffer(pool)]
    refs = [Reference(), Reference()]
    held: list[tuple[memoryview, bytes]] = []
    for op, b, offset, data in ops:
        if op == "detach":
            held.extend((view, bytes(view)) for _, view in bufs[b].ranges())
            bufs[b].release()
            bufs[b], refs[b] = SparseBuffer(pool), Reference()
        elif op == "truncate":
            bufs[b].truncate(offset)
            refs[b].truncate(offset)
        else:
            (bufs[b].write if op == "write" else bufs[b].write_under)(offset, data)
            refs[b].write(offset, data, op == "under")
        for buf, ref in zip(bufs, refs, strict=True):
            out = bytearray(400)
            buf.overlay(out, 0)
            assert out == ref.data and buf.nbytes == sum(ref.known)
        assert pool.lent <= 2
    for view, seen in held:
        assert bytes(view) == seen, "a block was reused while a flush still viewed it"
    for buf in bufs:
        buf.release()
    assert pool.lent == 0
