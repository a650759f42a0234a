"""Memory registration: every registered region gets one MR on each NIC, made once.

Host memory is registered by address. A ``cuda:N`` region gets a dma-buf MR when the CUDA
driver exports the range as a dma-buf (``cuMemGetHandleForAddressRange``) and pyverbs has
``DmaBufMR``; it is addressed from its iova (the offset in the dma-buf, pyverbs' choice),
published per NIC as ``rdma_iova``. Otherwise a plain MR on the device address, which works where
nvidia-peermem is loaded. Deregistration waits until no work request uses the region any more.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from ....errors import ConfigError, GpuError, GpuUnavailable
from ....types import Access, LocationKind, parse_location
from ...memory import Region
from .topology import page_node
from .verbs import Nic

# addr, length -> (dma-buf fd, offset of addr in it); raises ConfigError when unsupported.
DmabufExport = Callable[[int, int], tuple[int, int]]


def cuda_dmabuf(addr: int, length: int) -> tuple[int, int]:
    """Export a device range as a dma-buf through our CUDA driver seam."""
    from ... import cuda_driver

    try:
        return cuda_driver.driver().dmabuf_export(addr, length)
    except (GpuError, GpuUnavailable) as exc:
        raise ConfigError(f"no dma-buf export for GPU memory: {exc}") from exc


class LocalMr:
    """The MRs of one local region, one per NIC, and the work requests that use them."""

    def __init__(self, region: Region) -> None:
        self.region = region
        self.mrs: dict[str, Any] = {}
        self.cv = threading.Condition()
        self.inflight = 0
        self.fds: list[int] = []
        # NIC -> iova of the region's start where it is not its address (dma-buf MRs)
        self.iova: dict[str, int] = {}
        self._where: str | None = None

    def where(self) -> str:
        """The region's location for NIC affinity: host memory by the NUMA node its pages are
        on (asked once they answer), else its registered location."""
        if self._where is None and self.region.kind is LocationKind.CPU:
            node = page_node(self.region.addr, self.region.length)
            if node >= 0:
                self._where = f"cpu:{node}"
        return self._where or self.region.location

    def lkey(self, nic: str) -> int:
        return int(self.mrs[nic].lkey)

    def local_addr(self, nic: str, addr: int) -> int:
        """Where a work request on ``nic`` addresses the byte at ``addr`` of this region."""
        base = self.iova.get(nic)
        return addr if base is None else base + (addr - self.region.addr)

    def rkeys(self) -> dict[str, int]:
        return {name: int(mr.rkey) for name, mr in self.mrs.items()}

    def acquire(self, n: int) -> None:
        with self.cv:
            self.inflight += n

    def release(self, n: int = 1) -> None:
        with self.cv:
            self.inflight -= n
            if self.inflight == 0:
                self.cv.notify_all()

    def drain(self, deadline: float) -> bool:
        """Wait until no work request uses the region; False if ``deadline`` came first."""
        with self.cv:
            while self.inflight > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cv.wait(left)
            return True


class Registry:
    """Local regions -> their MRs on every NIC."""

    def __init__(self, nics: list[Nic], gpu_mr: str, export: DmabufExport = cuda_dmabuf) -> None:
        self.nics = nics
        self.gpu_mr = gpu_mr  # "auto", "dmabuf" or "peermem"
        self.export = export
        self.lock = threading.Lock()
        self.by_key: dict[tuple[int, int], LocalMr] = {}

    def get(self, region: Region) -> LocalMr:
        key = (region.addr, region.length)
        with self.lock:
            mr = self.by_key.get(key)
            if mr is not None:
                return mr
            mr = LocalMr(region)
            try:
                for nic in self.nics:
                    mr.mrs[nic.name] = self._register(nic, region, mr)
            except BaseException:
                self._close(mr)
                raise
            self.by_key[key] = mr
            return mr

    def _register(self, nic: Nic, region: Region, mr: LocalMr) -> Any:
        access = 0
        e = nic.lib.e
        if region.writable:
            access |= int(e.IBV_ACCESS_LOCAL_WRITE)
            if region.access & Access.WRITE:
                access |= int(e.IBV_ACCESS_REMOTE_WRITE)
        if region.access & Access.READ:
            access |= int(e.IBV_ACCESS_REMOTE_READ)
        kind, _ = parse_location(region.location)
        if kind is LocationKind.CUDA and self.gpu_mr != "peermem":
            try:
                fd, offset = self.export(region.addr, region.length)
            except ConfigError:
                if self.gpu_mr == "dmabuf":
                    raise
            else:
                mr.fds.append(fd)
                try:
                    dmabuf_mr, iova = nic.reg_dmabuf_mr(
                        fd, offset, region.length, region.addr, access
                    )
                except ConfigError:
                    if self.gpu_mr == "dmabuf":
                        raise
                else:
                    if iova != region.addr:
                        mr.iova[nic.name] = iova
                    return dmabuf_mr
        return nic.reg_mr(region.addr, region.length, access)

    def dropped(self, live: set[tuple[int, int]]) -> list[LocalMr]:
        """Forget regions no longer registered; the caller drains and closes them."""
        with self.lock:
            gone = [k for k in self.by_key if k not in live]
            return [self.by_key.pop(k) for k in gone]

    def _close(self, mr: LocalMr) -> None:
        for name, m in list(mr.mrs.items()):
            nic = next((n for n in self.nics if n.name == name), None)
            if nic is not None:
                nic.destroy(m)
        mr.mrs.clear()
        for fd in mr.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        mr.fds.clear()

    def close(self, mr: LocalMr) -> None:
        self._close(mr)

    def close_all(self) -> None:
        with self.lock:
            mrs = list(self.by_key.values())
            self.by_key.clear()
        for mr in mrs:
            self._close(mr)
