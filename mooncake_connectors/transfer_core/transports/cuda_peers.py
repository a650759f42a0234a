"""What ``cuda_ipc`` holds open for one peer process: opened exports, pinned mappings of its host
buffers, and one stream per local GPU.

An export is opened once, on first use, and stays open while the peer's descriptor lists it;
``close_unlisted`` closes the rest after the peer's epoch moved (it unregistered memory), and
``release`` closes everything (the peer's process changed, or the transport closes).
"""

from __future__ import annotations

import threading
from collections.abc import Collection

from ...errors import GpuError
from .. import cuda_driver
from ..cuda_driver import Export
from ..descriptor import CudaExport
from .shm import _Mapping


class PeerHandles:
    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.lock = threading.Lock()
        self.imports: dict[bytes, tuple[Export, int]] = {}  # handle -> (export, local base)
        self.host: dict[tuple[int, int], _Mapping] = {}  # (memfd, inode) -> mapping, pinned
        self.unpinnable: set[tuple[int, int]] = set()  # buffers the driver would not pin here
        self.streams: dict[int, int] = {}  # local device -> stream
        self.epoch_page: _Mapping | None = None

    def open(self, e: CudaExport, device: int) -> int:
        """The local base address of ``e``'s allocation, opened on ``device`` if not yet."""
        with self.lock:
            got = self.imports.get(e.handle)
            if got is None:
                export = Export(e.kind, e.handle, 0, e.alloc_size)
                got = (export, cuda_driver.driver().open_export(export, self.pid, device))
                self.imports[e.handle] = got
            return got[1]

    def host_mapping(self, memfd: int, inode: int) -> int:
        """The base of the peer's memfd buffer mapped here and pinned (once: GpuError again,
        without asking the driver, for a buffer it would not pin)."""
        key = (memfd, inode)
        with self.lock:
            m = self.host.get(key)
            if m is None:
                if key in self.unpinnable:
                    raise GpuError("the CUDA driver would not pin this buffer here")
                m = _Mapping(self.pid, memfd, inode)
                try:
                    cuda_driver.driver().host_register(m.base, m.size)
                except BaseException as exc:
                    m.close()
                    if isinstance(exc, GpuError):
                        self.unpinnable.add(key)
                    raise
                self.host[key] = m
            return m.base

    def refused(self, memfd: int, inode: int) -> bool:
        return (memfd, inode) in self.unpinnable

    def stream(self, device: int) -> int:
        with self.lock:
            stream = self.streams.get(device)
            if stream is None:
                stream = cuda_driver.driver().stream_create(device)
                self.streams[device] = stream
            return stream

    def device_of(self, stream: int) -> int:
        return next((d for d, s in self.streams.items() if s == stream), 0)

    def close_unlisted(self, listed: Collection[bytes]) -> None:
        """Close the exports whose handles the peer's descriptor no longer lists."""
        with self.lock:
            stale = [h for h in self.imports if h not in listed]
            closing = [self.imports.pop(h) for h in stale]
        drv = cuda_driver.driver() if closing else None
        for export, base in closing:
            assert drv is not None
            drv.close_export(export, base)

    def release(self) -> None:
        drv = cuda_driver.driver() if cuda_driver.loaded() else None
        with self.lock:
            streams, self.streams = list(self.streams.values()), {}
            imports, self.imports = list(self.imports.values()), {}
            host, self.host = list(self.host.values()), {}
        if drv is not None:
            for stream in streams:
                drv.stream_destroy(stream)
            for export, base in imports:
                drv.close_export(export, base)
        for m in host:
            if drv is not None:
                drv.host_unregister(m.base)
            m.close()
        if self.epoch_page is not None:
            self.epoch_page.close()
            self.epoch_page = None
