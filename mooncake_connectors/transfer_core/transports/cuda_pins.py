"""Local host regions pinned for ``cuda_ipc``, at registration rather than on the data path.

``cuMemHostRegister`` of a large region takes seconds (every page is locked), so a region is
pinned when it is published (``describe_region``), never inside a transfer's deadline. Memory
its owner pinned already (torch ``pin_memory``, ``cuMemHostAlloc``) is left alone; read-only
memory (``Region.writable`` False: ``bytes``, a read-only mapping) is pinned with
``CU_MEMHOSTREGISTER_READ_ONLY``. The driver pins whole pages, so two regions that share a page
collide (``CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED``): the pages the other registration holds
are pinned already, and the rest of the region is pinned around them. A region the driver will
not pin stays registered, with one warning; cuda_ipc then leaves its transfers to the other
transports (tcp staging).
"""

from __future__ import annotations

import logging
import mmap
import threading
from typing import TYPE_CHECKING

from ...errors import GpuError
from ..cuda_driver import CudaDriver, MemoryType

if TYPE_CHECKING:
    from collections.abc import Collection

    from ..memory import Region

log = logging.getLogger(__name__)
ALREADY_REGISTERED = 712  # CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
PAGE = mmap.PAGESIZE


def pin_range(drv: CudaDriver, addr: int, length: int, read_only: bool) -> list[int]:
    """Pin ``addr``+``length``; returns the bases registered (for ``host_unregister``). Pages
    a registration made already holds (a neighbouring region's, sharing a page) are skipped."""
    try:
        drv.host_register(addr, length, read_only=read_only)
        return [addr]
    except GpuError as exc:
        if exc.code != ALREADY_REGISTERED:
            raise
    end = addr + length
    lo, hi = -(-addr // PAGE) * PAGE, end // PAGE * PAGE
    spans = []
    if addr < lo:  # the first, shared page
        spans.append((addr, min(lo, end)))
    if lo < hi:  # whole pages of this region alone
        spans.append((lo, hi))
    if max(lo, hi) < end:  # the last, shared page
        spans.append((max(lo, hi), end))
    out: list[int] = []
    try:
        for a, b in spans:
            try:
                drv.host_register(a, b - a, read_only=read_only)
                out.append(a)
            except GpuError as exc:
                if exc.code != ALREADY_REGISTERED:
                    raise
    except BaseException:
        for a in out:
            drv.host_unregister(a)
        raise
    return out


class LocalPins:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pinned: dict[int, list[int]] = {}  # region addr -> bases we registered
        self._refused: set[int] = set()  # region addrs the driver would not pin (said once)

    def pin(self, drv: CudaDriver, region: Region) -> None:
        """Pin ``region`` unless done (or refused) before; never raises for a refusal."""
        with self._lock:
            if region.addr in self._pinned or region.addr in self._refused:
                return
            try:
                ends = (region.addr, region.addr + region.length - 1)
                if all(drv.pointer_info(a).kind is MemoryType.HOST for a in ends):
                    self._pinned[region.addr] = []  # pinned by its owner already
                    return
                bases = pin_range(drv, region.addr, region.length, not region.writable)
            except GpuError as exc:
                self._refused.add(region.addr)
                log.warning(
                    "cuda_ipc: the CUDA driver would not pin %d bytes of host memory at %#x "
                    "(%s); it stays registered, and its transfers with GPUs go through another "
                    "transport (tcp staging)",
                    region.length, region.addr, exc,
                )  # fmt: skip
                return
            self._pinned[region.addr] = bases

    def refused(self, addr: int) -> bool:
        """Would the driver not pin the region at ``addr``? (cheap while none was refused)"""
        return bool(self._refused) and addr in self._refused

    def forget(self, live: Collection[int], drv: CudaDriver | None) -> None:
        """Unpin the regions whose start is not in ``live`` (unregistered); None: all."""
        with self._lock:
            gone = [a for a in self._pinned if a not in live]
            bases = [b for a in gone for b in self._pinned.pop(a)]
            self._refused &= set(live)
        if drv is None:
            return
        for b in bases:
            try:
                drv.host_unregister(b)
            except GpuError as exc:  # the memory may be gone already; nothing else to undo
                log.warning("cuda_ipc: unpinning %#x failed: %s", b, exc)
