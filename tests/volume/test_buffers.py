from hypothesis import given
from hypothesis import strategies as st

from sealfs.volume.buffers import SparseBuffer

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
