"""Range allocation inside one mounted segment: best fit over a sorted free map.

Free blocks are kept three ways: a sorted list of ``size << 40 | offset`` ints (best fit is one
bisect: the smallest block at least as large, lowest offset among equals), and two dicts from a
block's start and end to its other edge (freeing coalesces with both neighbours in O(1) lookups).
Search is O(log n); inserting into the sorted list is a memmove, fast for the block counts a
segment sees. Sizes round up to ``ALIGN`` bytes.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

ALIGN = 64
_SHIFT = 40
_MASK = (1 << _SHIFT) - 1


def aligned(n: int) -> int:
    """Bytes actually reserved for an ``n``-byte request (an empty object still takes a slot)."""
    return max(ALIGN, (n + ALIGN - 1) & ~(ALIGN - 1))


class RangeAllocator:
    __slots__ = ("_by_end", "_by_start", "_sorted", "size", "used")

    def __init__(self, size: int) -> None:
        if not 0 < size <= 1 << _SHIFT:
            raise ValueError(f"segment size must be in 1..{1 << _SHIFT}, got {size}")
        self.size = size - size % ALIGN
        self.used = 0
        self._sorted: list[int] = []
        self._by_start: dict[int, int] = {}
        self._by_end: dict[int, int] = {}
        if self.size:
            self._add(0, self.size)

    @classmethod
    def with_used(cls, size: int, used: Iterable[tuple[int, int]]) -> RangeAllocator:
        """An allocator whose ``used`` (offset, length) ranges are taken (a rebuilt segment).

        Ranges outside the segment or overlapping an earlier one are ignored and returned by
        nothing: the caller validated them against its own view.
        """
        a = cls.__new__(cls)
        a.size = size - size % ALIGN
        a.used = 0
        a._sorted, a._by_start, a._by_end = [], {}, {}
        pos = 0
        for off, n in sorted(used):
            n = aligned(n)
            if off < pos or off + n > a.size or off % ALIGN:
                continue
            if off > pos:
                a._add(pos, off - pos)
            pos = off + n
            a.used += n
        if pos < a.size:
            a._add(pos, a.size - pos)
        return a

    @property
    def free(self) -> int:
        return self.size - self.used

    def largest_free(self) -> int:
        return self._sorted[-1] >> _SHIFT if self._sorted else 0

    def _add(self, off: int, n: int) -> None:
        bisect.insort(self._sorted, n << _SHIFT | off)
        self._by_start[off] = n
        self._by_end[off + n] = off

    def _take(self, off: int, n: int) -> None:
        i = bisect.bisect_left(self._sorted, n << _SHIFT | off)
        del self._sorted[i]
        del self._by_start[off]
        del self._by_end[off + n]

    def alloc(self, n: int) -> int | None:
        """Reserve ``n`` bytes; the offset, or None when no free block is large enough."""
        n = aligned(n)
        s = self._sorted
        i = bisect.bisect_left(s, n << _SHIFT)
        if i == len(s):
            return None
        key = s.pop(i)
        size, off = key >> _SHIFT, key & _MASK
        del self._by_start[off]
        del self._by_end[off + size]
        if size > n:
            self._add(off + n, size - n)
        self.used += n
        return off

    def release(self, off: int, n: int) -> None:
        """Give back what ``alloc(n)`` returned at ``off``."""
        n = aligned(n)
        self.used -= n
        end = off + n
        after = self._by_start.get(end)
        if after is not None:
            self._take(end, after)
            n += after
        before = self._by_end.get(off)
        if before is not None:
            self._take(before, off - before)
            n += off - before
            off = before
        self._add(off, n)

    def free_blocks(self) -> int:
        return len(self._sorted)
