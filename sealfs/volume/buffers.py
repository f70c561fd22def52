"""Write-back buffers: the bytes written to a file and not yet sealed into chunks.

Kept as sorted, non-overlapping ranges (writes merge the ranges they touch)
so that a sequential writer appends to one range instead of allocating per
request.

A range that grows past a megabyte (a streaming writer) moves into a block
from a small pool, and the block goes back to the pool when its flush ends.
A plain bytearray grown to 32 MiB and freed after each early flush meant
faulting in and zeroing fresh pages for every byte written: about 1 s of
kernel time per GiB, an eighth of the daemon's CPU on a sequential write.
A reused block is already resident.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right

Bytes = bytes | bytearray | memoryview


class BlockPool:
    """Bytearrays lent to the ranges of streaming writers, kept when returned for reuse.

    A block grows with its range, as any bytearray does (a fresh one holds no
    memory that was not written), and keeps its length when given back: its
    pages stay resident for the next range. Bounded: at most max_blocks lent
    at once, at most max_idle kept and none longer than max_keep, and none
    once nothing is buffered (FileData drops them). Over the bytes buffered,
    the pool holds at most the idle blocks, or the stale tail of a reused one.
    """

    def __init__(
        self, max_keep: int, *, promote_at: int = 1 << 20, max_idle: int = 1, max_blocks: int = 4
    ) -> None:
        self.promote_at = promote_at  # a plain range growing beyond this takes a block
        self._max_keep = max_keep
        self._max_idle = max_idle
        self._max_blocks = max_blocks
        self._idle: list[bytearray] = []
        self.lent = 0

    @property
    def idle_blocks(self) -> int:
        return len(self._idle)

    def take(self) -> bytearray | None:
        if self.lent >= self._max_blocks:
            return None
        self.lent += 1
        return self._idle.pop() if self._idle else bytearray()

    def give_back(self, block: bytearray) -> None:
        """Keep the block for reuse, unless a view of it is still alive (or it is not
        worth keeping).

        Checked, not assumed: writing the next file's bytes into a block that a
        chunk being sealed still looks at would seal the wrong bytes. Resizing a
        bytearray fails while a view of it exists; pop-then-append resizes it
        without touching its allocation. A block still viewed becomes garbage
        with its last view.
        """
        self.lent -= 1
        if not block or len(block) > self._max_keep or len(self._idle) >= self._max_idle:
            return
        try:
            block.append(block.pop())
        except BufferError:
            return
        self._idle.append(block)

    def clear(self) -> None:
        """Free the idle blocks (the daemon holds no buffer memory while nothing is written)."""
        self._idle.clear()


class _Range:
    """One buffered range: the first n bytes of its storage, a bytearray exactly n long
    or a pooled block at least n long (whose bytes beyond n are stale)."""

    __slots__ = ("buf", "n", "pooled")

    def __init__(self, buf: bytearray) -> None:
        self.buf = buf
        self.n = len(buf)
        self.pooled = False

    def view(self) -> memoryview:
        return memoryview(self.buf)[: self.n]


class SparseBuffer:
    """Written byte ranges of one file, newest data winning."""

    __slots__ = ("_pool", "_ranges", "_starts", "nbytes")

    def __init__(self, pool: BlockPool | None = None) -> None:
        self._starts: list[int] = []
        self._ranges: list[_Range] = []
        self._pool = pool
        self.nbytes = 0

    def __bool__(self) -> bool:
        return bool(self._starts)

    def ranges(self) -> list[tuple[int, memoryview]]:
        """(start, bytes) of each range; views, valid until the buffer changes or is released."""
        return [(start, r.view()) for start, r in zip(self._starts, self._ranges, strict=True)]

    def ranges_in(self, start: int, end: int) -> list[tuple[int, memoryview]]:
        """ranges(), of the ranges that begin inside [start, end) only.

        A flush asks once per region, and a file written at random holds
        thousands of ranges: listing them all each time made flushes quadratic.
        """
        i, j = bisect_left(self._starts, start), bisect_left(self._starts, end)
        return [(at, r.view()) for at, r in zip(self._starts[i:j], self._ranges[i:j], strict=True)]

    def end(self) -> int:
        return self._starts[-1] + self._ranges[-1].n if self._starts else 0

    def write(self, offset: int, data: Bytes) -> None:
        """Record data at offset, replacing what was buffered there."""
        if not data:
            return
        end = offset + len(data)
        # Ranges that overlap or touch [offset, end) merge into one.
        i = bisect_left(self._starts, offset)
        if i > 0 and self._starts[i - 1] + self._ranges[i - 1].n >= offset:
            i -= 1
        j = bisect_right(self._starts, end)
        if j - i == 1 and self._starts[i] <= offset:
            self._write_into(i, offset, data)
            return
        merged = bytearray()
        if i < j and self._starts[i] < offset:
            merged += self._ranges[i].view()[: offset - self._starts[i]]
        merged += data
        if i < j:
            last_end = self._starts[j - 1] + self._ranges[j - 1].n
            if last_end > end:
                merged += self._ranges[j - 1].view()[end - self._starts[j - 1] :]
        start = min(offset, self._starts[i]) if i < j else offset
        self.nbytes += len(merged) - sum(r.n for r in self._ranges[i:j])
        self._release(self._ranges[i:j])
        self._starts[i:j] = [start]
        self._ranges[i:j] = [_Range(merged)]

    def _write_into(self, i: int, offset: int, data: Bytes) -> None:
        """Fast path: the write starts inside (or right at the end of) range i only."""
        r = self._ranges[i]
        pos = offset - self._starts[i]
        end = pos + len(data)
        if end > len(r.buf) and not r.pooled:
            self._promote(r, end)
        r.buf[pos:end] = data  # pos <= n <= len(buf): overwrites, or extends the storage
        grow = max(0, end - r.n)
        r.n += grow
        self.nbytes += grow

    def _promote(self, r: _Range, size: int) -> None:
        """Move a plain range that is growing to size bytes into a pooled block, if it is
        past the pool's threshold and a block is free."""
        pool = self._pool
        if pool is None or size <= pool.promote_at or (block := pool.take()) is None:
            return
        block[: r.n] = r.buf
        r.buf, r.pooled = block, True

    def write_under(self, offset: int, data: Bytes) -> None:
        """Record data only where nothing is buffered (older bytes never hide newer ones).

        Each gap becomes a range of its own, even where it touches a neighbour:
        merging would copy that neighbour, which after an early flush is the
        whole growing buffer of a streaming writer (tens of MiB per flush).
        """
        pos, end = offset, offset + len(data)
        view = memoryview(data)
        # Only the ranges overlapping [offset, end) matter: a failed flush puts back each
        # of its ranges so, and walking every buffered range each time froze the event
        # loop for 30 s on 20,000 scattered ranges (quadratic).
        i, j = self._overlapping(offset, end)
        for start, n in [(self._starts[k], self._ranges[k].n) for k in range(i, j)]:
            if start > pos:
                self._insert(pos, view[pos - offset : start - offset])
            pos = max(pos, start + n)
        if pos < end:
            self._insert(pos, view[pos - offset :])

    def _overlapping(self, offset: int, end: int) -> tuple[int, int]:
        """Index range of the ranges that overlap [offset, end) (found by bisection)."""
        i = bisect_right(self._starts, offset)
        if i > 0 and self._starts[i - 1] + self._ranges[i - 1].n > offset:
            i -= 1
        return i, max(i, bisect_left(self._starts, end))

    def _insert(self, offset: int, data: Bytes) -> None:
        """Add a range over a gap (the caller guarantees nothing is buffered there)."""
        i = bisect_left(self._starts, offset)
        self._starts.insert(i, offset)
        self._ranges.insert(i, _Range(bytearray(data)))
        self.nbytes += len(data)

    def overlay(self, out: bytearray | memoryview, offset: int) -> None:
        """Copy the buffered bytes that fall inside [offset, offset + len(out)) into out."""
        end = offset + len(out)
        i, j = self._overlapping(offset, end)  # not a copy of every range after offset
        for start, r in zip(self._starts[i:j], self._ranges[i:j], strict=True):
            lo, hi = max(start, offset), min(start + r.n, end)
            out[lo - offset : hi - offset] = memoryview(r.buf)[lo - start : hi - start]

    def copy_range(self, offset: int, end: int) -> SparseBuffer:
        """A detached copy of the buffered bytes inside [offset, end)."""
        out = SparseBuffer()
        # A read asks this of each layer: listing every range after offset made a read
        # at the start of a file written at random cost 0.5 ms at 100,000 ranges.
        i, j = self._overlapping(offset, end)
        for start, r in zip(self._starts[i:j], self._ranges[i:j], strict=True):
            lo, hi = max(start, offset), min(start + r.n, end)
            out.write(lo, memoryview(r.buf)[lo - start : hi - start])
        return out

    def truncate(self, size: int) -> None:
        """Forget every buffered byte at or beyond size."""
        while self._starts and self._starts[-1] >= size:
            self._starts.pop()
            dropped = self._ranges.pop()
            self.nbytes -= dropped.n
            self._release([dropped])
        if self._starts and self._starts[-1] + self._ranges[-1].n > size:
            r = self._ranges[-1]
            keep = size - self._starts[-1]
            self.nbytes -= r.n - keep
            if not r.pooled:
                del r.buf[keep:]
            r.n = keep

    def release(self) -> None:
        """Empty the buffer and return its blocks to the pool; call when discarding it."""
        self._release(self._ranges)
        self._starts, self._ranges, self.nbytes = [], [], 0

    def _release(self, ranges: list[_Range]) -> None:
        for r in ranges:
            if r.pooled:
                assert self._pool is not None
                r.pooled = False
                self._pool.give_back(r.buf)
