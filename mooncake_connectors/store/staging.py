"""Registered scratch memory of a client: where Python bytes are staged for the engine.

The transfer engine moves bytes only between registered regions, so ``put(bytes)`` copies the
value into this buffer first and ``get`` reads into it, then copies out (Mooncake's client does
the same with its ``local_buffer_size``). Single small values take one of a few fixed slots
without a lock; larger or batched requests take one range from an allocator; what does not fit
gets a temporary registered buffer.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

from ..transfer_core.engine import TransferEngine
from .allocator import RangeAllocator, aligned

SLOT = 64 * 1024
SLOTS = 16


class Staging:
    def __init__(self, engine: TransferEngine, size: int) -> None:
        self.engine = engine
        n_slots = min(SLOTS, size // (2 * SLOT))
        self.buffer = engine.allocate_buffer(size)
        self._slots = [self.buffer.addr + i * SLOT for i in range(n_slots)]
        self._base = self.buffer.addr + n_slots * SLOT
        self._alloc = RangeAllocator(size - n_slots * SLOT)
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def stage(self, sizes: Sequence[int]) -> Iterator[list[int]]:
        """Registered addresses for values of ``sizes`` bytes, valid inside the ``with``."""
        if not sizes:
            yield []
            return
        if len(sizes) == 1 and sizes[0] <= SLOT and self._slots:
            addr = self._slots.pop()  # the common single small value: no lock, no allocator
            try:
                yield [addr]
            finally:
                self._slots.append(addr)
            return
        spans = [aligned(n) for n in sizes]
        total = sum(spans)
        with self._lock:
            off = self._alloc.alloc(total)
        temp = None
        if off is not None:
            base = self._base + off
        else:
            temp = self.engine.allocate_buffer(max(total, 1))
            base = temp.addr
        addrs = []
        for n in spans:
            addrs.append(base)
            base += n
        try:
            yield addrs
        finally:
            if off is not None:
                with self._lock:
                    self._alloc.release(off, total)
            if temp is not None:
                self.engine.free_buffer(temp.addr)
