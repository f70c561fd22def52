"""Write-back buffers: the bytes written to a file and not yet sealed into chunks.

Kept as sorted, non-overlapping ranges (writes merge the ranges they touch)
so that a sequential writer appends to one growing bytearray instead of
allocating per request.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right

Bytes = bytes | bytearray | memoryview


class SparseBuffer:
    """Written byte ranges of one file, newest data winning."""

    __slots__ = ("_datas", "_starts", "nbytes")

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._datas: list[bytearray] = []
        self.nbytes = 0

    def __bool__(self) -> bool:
        return bool(self._starts)

    def ranges(self) -> list[tuple[int, bytearray]]:
        return list(zip(self._starts, self._datas, strict=True))

    def end(self) -> int:
        return self._starts[-1] + len(self._datas[-1]) if self._starts else 0

    def write(self, offset: int, data: Bytes) -> None:
        """Record data at offset, replacing what was buffered there."""
        if not data:
            return
        end = offset + len(data)
        # Ranges that overlap or touch [offset, end) merge into one.
        i = bisect_left(self._starts, offset)
        if i > 0 and self._starts[i - 1] + len(self._datas[i - 1]) >= offset:
            i -= 1
        j = bisect_right(self._starts, end)
        if j - i == 1 and self._starts[i] <= offset:
            self._write_into(i, offset, data)
            return
        merged = bytearray()
        if i < j and self._starts[i] < offset:
            merged += self._datas[i][: offset - self._starts[i]]
        merged += data
        if i < j:
            last_end = self._starts[j - 1] + len(self._datas[j - 1])
            if last_end > end:
                merged += self._datas[j - 1][end - self._starts[j - 1] :]
        start = min(offset, self._starts[i]) if i < j else offset
        self.nbytes += len(merged) - sum(len(d) for d in self._datas[i:j])
        self._starts[i:j] = [start]
        self._datas[i:j] = [merged]

    def _write_into(self, i: int, offset: int, data: Bytes) -> None:
        """Fast path: the write starts inside (or right at the end of) range i only."""
        buf = self._datas[i]
        pos = offset - self._starts[i]
        grow = max(0, pos + len(data) - len(buf))
        buf[pos : pos + len(data)] = data
        self.nbytes += grow

    def write_under(self, offset: int, data: Bytes) -> None:
        """Record data only where nothing is buffered (older bytes never hide newer ones).

        Each gap becomes a range of its own, even where it touches a neighbour:
        merging would copy that neighbour, which after an early flush is the
        whole growing buffer of a streaming writer (tens of MiB per flush).
        """
        pos, end = offset, offset + len(data)
        view = memoryview(data)
        for start, buf in self.ranges():
            if start >= end:
                break
            if start > pos:
                self._insert(pos, view[pos - offset : start - offset])
            pos = max(pos, start + len(buf))
        if pos < end:
            self._insert(pos, view[pos - offset :])

    def _insert(self, offset: int, data: Bytes) -> None:
        """Add a range over a gap (the caller guarantees nothing is buffered there)."""
        i = bisect_left(self._starts, offset)
        self._starts.insert(i, offset)
        self._datas.insert(i, bytearray(data))
        self.nbytes += len(data)

    def overlay(self, out: bytearray | memoryview, offset: int) -> None:
        """Copy the buffered bytes that fall inside [offset, offset + len(out)) into out."""
        end = offset + len(out)
        i = max(0, bisect_right(self._starts, offset) - 1)
        for start, buf in zip(self._starts[i:], self._datas[i:], strict=True):
            if start >= end:
                break
            lo, hi = max(start, offset), min(start + len(buf), end)
            if lo < hi:
                out[lo - offset : hi - offset] = buf[lo - start : hi - start]

    def copy_range(self, offset: int, end: int) -> SparseBuffer:
        """A detached copy of the buffered bytes inside [offset, end)."""
        out = SparseBuffer()
        i = max(0, bisect_right(self._starts, offset) - 1)
        for start, buf in zip(self._starts[i:], self._datas[i:], strict=True):
            if start >= end:
                break
            lo, hi = max(start, offset), min(start + len(buf), end)
            if lo < hi:
                out.write(lo, buf[lo - start : hi - start])
        return out

    def truncate(self, size: int) -> None:
        """Forget every buffered byte at or beyond size."""
        while self._starts and self._starts[-1] >= size:
            self._starts.pop()
            self.nbytes -= len(self._datas.pop())
        if self._starts and self._starts[-1] + len(self._datas[-1]) > size:
            keep = size - self._starts[-1]
            self.nbytes -= len(self._datas[-1]) - keep
            del self._datas[-1][keep:]
