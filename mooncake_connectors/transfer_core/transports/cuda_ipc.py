"""The ``cuda_ipc`` transport: GPU memory between processes of one host (NVLink or PCIe).

Each GPU region is published with the exports of the allocations that hold it (a CUDA IPC handle,
or a VMM allocation's fd for torch's expandable segments; see ``CudaExport``). An initiator opens
each export once per peer and keeps it while the peer's descriptor still lists it: when the
peer's epoch page moves, the descriptor is fetched again and exports it no longer lists are
closed. Copies are ``cuMemcpyAsync`` on one stream per (peer, device); a batch completes on an
event recorded after its last copy. Host memory on either end also goes through here when the
other end is a GPU: local host regions are pinned (``cuMemHostRegister``) when registered (see
``cuda_pins``), and a peer's memfd-backed host regions are mapped, as ``shm`` maps them, and
pinned when its descriptor is fetched (``engine.peer(name)`` ahead of the first transfer keeps
that off the transfer's path); one the driver will not pin is left to the other transports.

The driver is loaded at the first registration (no call before); an engine on a host without a
GPU starts with this transport enabled and simply finds nothing reachable through it.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from ...errors import (
    AccessViolation,
    GpuError,
    MetadataError,
    MooncakeConnectorsError,
    TransferTimeout,
    TransportBroken,
    TransportClosed,
)
from ...plugins import hookimpl
from ...types import Access, LocationKind, TransferOp
from .. import cuda_driver
from ..cuda_driver import CudaDriver
from ..descriptor import CudaExport, RegionDesc, SegmentDesc, host_id
from ..transport import Slice, Transport, TransportContext
from .cuda_peers import PeerHandles
from .cuda_pins import LocalPins
from .shm import EpochPage, _Mapping, epoch_page_at, peer_epoch

if TYPE_CHECKING:
    from ..memory import Region

log = logging.getLogger(__name__)
_CUDA = LocationKind.CUDA
_CPU = LocationKind.CPU
_ABORT_WAIT = 5.0  # seconds an aborted lane waits for copies already queued to land


class CudaIpcTransport(Transport):
    name = "cuda_ipc"
    orders_after = True  # a slice's fence is waited for on its copy stream

    def __init__(self, ctx: TransportContext) -> None:
        super().__init__(ctx)
        self._lock = threading.Lock()
        self._peers: dict[str, PeerHandles] = {}
        self._exports: dict[tuple[int, int], list[CudaExport]] = {}  # local region -> exports
        self._pins = LocalPins()  # local host regions, pinned at registration
        self._uuids: dict[str, int] | None = None
        self._denied: str | None = None
        self._pending: queue.SimpleQueue[tuple[int, float, list[Slice]] | None] = (
            queue.SimpleQueue()
        )
        self._waiter: threading.Thread | None = None
        self._epoch = EpochPage("mooncake-connectors-cuda-epoch")
        self._closed = False

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> dict[str, str]:
        where = self._epoch.open()
        self.local_changed(self.ctx.local.epoch)
        return {"cuda_ipc": where}

    def _drv(self) -> CudaDriver:
        return cuda_driver.driver()

    def usable(self) -> bool:
        """Can this process use a GPU at all? Asked once; the answer is logged once."""
        if self._denied is None:
            reason = cuda_driver.unavailable_reason()
            self._denied = reason or ""
            if reason:
                log.debug("cuda_ipc reaches nothing: %s", reason)
        return not self._denied

    # -- descriptors ------------------------------------------------------------------------
    def describe_region(self, region: Region) -> Mapping[str, object]:
        if region.device < 0:
            if self.usable():  # at registration, not inside a transfer's deadline
                self._pins.pin(self._drv(), region)
            if region.memfd < 0:
                return {}
            return {  # the same values shm publishes: GPUs of peers copy into these pages
                "memfd": region.memfd,
                "memfd_inode": region.memfd_inode,
                "memfd_offset": region.memfd_offset,
            }
        key = (region.addr, region.length)
        exports = self._exports.get(key)
        if exports is None:
            try:
                exports = self._export(region)
            except GpuError as exc:
                # Memory the driver will not share (a cudaMallocAsync pool, VMM made without
                # the POSIX-fd handle type): published without an export, so peers reach it
                # through tcp staging; cached as such, so this is said once per region.
                log.warning(
                    "cuda_ipc: %d bytes of cuda:%d at %#x are published without a CUDA export "
                    "(peers reach it through tcp staging): %s",
                    region.length, region.device, region.addr, exc,
                )  # fmt: skip
                exports = []
            self._exports[key] = exports
        return {"cuda_exports": exports} if exports else {}

    def _export(self, region: Region) -> list[CudaExport]:
        drv = self._drv()
        out: list[CudaExport] = []
        pos, end = region.addr, region.addr + region.length
        while pos < end:
            info = drv.pointer_info(pos)
            ex = drv.export(pos)
            stop = min(end, info.base + info.size)
            out.append(
                CudaExport(
                    kind=ex.kind,
                    handle=ex.handle,
                    alloc_size=ex.size,
                    alloc_offset=pos - ex.base,
                    region_offset=pos - region.addr,
                    length=stop - pos,
                    device_uuid=drv.device_uuid(info.device),
                )
            )
            pos = stop
        return out

    def local_changed(self, epoch: int) -> None:
        if not self._closed:
            self._epoch.write(epoch)
        live = {(r.addr, r.length) for r in self.ctx.local.regions()}
        for key in [k for k in self._exports if k not in live]:
            self._release(self._exports.pop(key))
        self._pins.forget({a for a, _ in live}, self._drv() if cuda_driver.loaded() else None)

    def _release(self, exports: list[CudaExport]) -> None:
        for ex in exports:
            try:
                self._drv().release_export(ex.kind, ex.handle)
            except (GpuError, OSError) as exc:
                log.warning("cuda_ipc: releasing an export failed: %s", exc)

    # -- reachability -----------------------------------------------------------------------
    def serves(self, local: LocationKind, remote: LocationKind) -> bool:
        kinds = (_CPU, _CUDA)
        return local in kinds and remote in kinds and _CUDA in (local, remote)

    def reachable(self, peer: SegmentDesc, region: RegionDesc) -> bool:
        if peer.host_id != host_id() or "cuda_ipc" not in peer.endpoints:
            return False
        if region.kind is _CUDA:
            ok = bool(region.cuda_exports)
        else:  # a peer's host buffer this process could not pin is left to other transports
            state = self._peers.get(peer.name)
            refused = state is not None and state.refused(region.memfd, region.memfd_inode)
            ok = region.memfd >= 0 and not refused
        return ok and self.usable()

    def peer_seen(self, peer: SegmentDesc) -> None:
        """Map and pin the peer's memfd host buffers now, off the data path."""
        if self._closed or peer.pid == os.getpid() or peer.host_id != host_id():
            return
        if "cuda_ipc" not in peer.endpoints:
            return
        host = [r for r in peer.regions if r.kind is _CPU and r.memfd >= 0]
        if not host or not self.usable():
            return
        state = self._state(peer)
        for r in host:
            try:
                state.host_mapping(r.memfd, r.memfd_inode)
            except GpuError as exc:
                log.warning(
                    "cuda_ipc: %d bytes of host memory of %s at %#x could not be pinned here "
                    "(%s); its transfers with GPUs go through another transport (tcp staging)",
                    r.length, peer.name, r.addr, exc,
                )  # fmt: skip
            except OSError as exc:  # gone since the descriptor was published
                log.debug("cuda_ipc: cannot map %s's buffer at %#x: %s", peer.name, r.addr, exc)

    # -- data path --------------------------------------------------------------------------
    def submit(
        self, peer: SegmentDesc, slices: Sequence[Slice], *, inline_ok: bool = False
    ) -> None:
        if self._closed:
            for s in slices:
                s.complete(TransportClosed("cuda_ipc transport closed", peer=peer.name))
            return
        path = f"cuda_ipc pid {peer.pid}"
        for s in slices:
            s.path = path
        try:
            current, state = self._current(peer)
        except (OSError, MetadataError, GpuError) as exc:
            err = TransportBroken(f"peer unreachable over cuda_ipc: {exc}", peer=peer.name)
            for s in slices:
                s.complete(err)
            return
        fresh = current is peer
        queued: dict[int, list[Slice]] = {}  # stream -> slices
        for s in slices:
            try:
                stream = self._copy(current, state, s, s.region if fresh else None)
            except (GpuError, OSError) as exc:  # this path failed (an export that cannot be
                # opened here, say): TransportBroken, so the engine retries on another one
                s.complete(TransportBroken(f"GPU copy failed: {exc}", peer=peer.name, path=path))
                continue
            except MooncakeConnectorsError as exc:
                s.complete(exc)
                continue
            queued.setdefault(stream, []).append(s)
        drv = self._drv()
        for stream, group in queued.items():
            deadline = max(s.deadline for s in group)
            try:
                event = drv.event_create(state.device_of(stream))
                drv.event_record(event, stream)
            except GpuError as exc:
                for s in group:
                    s.complete(TransportBroken(f"cannot record: {exc}", peer=peer.name))
                continue
            if inline_ok:
                self._finish(event, deadline, group)
            else:
                self._start_waiter()
                self._pending.put((event, deadline, group))

    def _finish(self, event: int, deadline: float, group: list[Slice]) -> None:
        drv = self._drv()
        try:
            done = cuda_driver.wait_event(drv, event, deadline)
        except GpuError as exc:
            err: MooncakeConnectorsError | None = TransportBroken(f"GPU copy failed: {exc}")
        else:
            err = None if done else TransferTimeout("GPU copies outlasted the deadline")
        if err is None or not isinstance(err, TransferTimeout):
            drv.event_destroy(event)
        for s in group:
            s.complete(err)

    def _start_waiter(self) -> None:
        if self._waiter is None:
            with self._lock:
                if self._waiter is None:
                    self._waiter = threading.Thread(
                        target=self._wait_loop, name="mc-cuda-ipc", daemon=True
                    )
                    self._waiter.start()

    def _wait_loop(self) -> None:
        while True:
            item = self._pending.get()
            if item is None:
                return
            self._finish(*item)

    def _current(self, peer: SegmentDesc) -> tuple[SegmentDesc, PeerHandles]:
        """The peer's up-to-date descriptor (re-fetched when its epoch page moved) and our state
        for it; exports the new descriptor no longer lists are closed."""
        state = self._state(peer)
        if peer.pid == os.getpid():
            return peer, state
        if state.epoch_page is None:
            state.epoch_page = _Mapping(*epoch_page_at(peer.endpoints["cuda_ipc"]))
        if peer_epoch(state.epoch_page, "cuda_ipc") != peer.epoch:
            peer = self.ctx.refresh_peer(peer.name)
            listed = {e.handle for r in peer.regions for e in r.cuda_exports}
            state.close_unlisted(listed)
        return peer, state

    def _state(self, peer: SegmentDesc) -> PeerHandles:
        with self._lock:
            state = self._peers.get(peer.name)
            if state is None or state.pid != peer.pid:
                if state is not None:
                    state.release()
                state = PeerHandles(peer.pid)
                self._peers[peer.name] = state
            return state

    def _copy(
        self, peer: SegmentDesc, state: PeerHandles, s: Slice, region: RegionDesc | None
    ) -> int:
        write = s.op is TransferOp.WRITE
        if region is None:
            region = peer.find_region(s.remote_addr, s.length)
        need = Access.WRITE if write else Access.READ
        if region is None or not region.contains(s.remote_addr, s.length):
            raise AccessViolation(
                f"{s.remote_addr:#x}+{s.length} is not a registered range of the peer",
                peer=peer.name,
                path=s.path,
            )
        if not need & region.access:
            raise AccessViolation(
                f"region at {region.addr:#x} does not allow {'WRITE' if write else 'READ'}",
                peer=peer.name,
                path=s.path,
            )
        if s.local_device < 0 and self._pins.refused(self._local_base(s)):
            raise TransportBroken(
                "this host memory could not be pinned; left to the other transports",
                peer=peer.name,
                path=s.path,
            )
        drv = self._drv()
        pieces = self._remote_pointers(state, region, s.remote_addr, s.length)
        device = s.local_device if s.local_device >= 0 else self._device_for(region)
        stream = state.stream(device)
        if s.after is not None:  # the application's kernel writing these bytes comes first
            s.after.order(stream)
        local = s.local_addr
        for remote, n in pieces:
            dst, src = (remote, local) if write else (local, remote)
            drv.memcpy_async(dst, src, n, stream)
            local += n
        return stream

    def _local_base(self, s: Slice) -> int:
        region = self.ctx.local.find(s.local_addr, s.length)
        return -1 if region is None else region.addr

    def _remote_pointers(
        self, state: PeerHandles, region: RegionDesc, addr: int, length: int
    ) -> list[tuple[int, int]]:
        """(pointer in this process, length) pieces covering the peer's ``addr``+``length``."""
        if state.pid == os.getpid():  # our own memory: its addresses are valid here as is
            return [(addr, length)]
        off = addr - region.addr
        if region.kind is not _CUDA:
            base = state.host_mapping(region.memfd, region.memfd_inode)
            return [(base + region.memfd_offset + off, length)]
        out: list[tuple[int, int]] = []
        end = off + length
        for e in region.cuda_exports:
            lo, hi = max(off, e.region_offset), min(end, e.region_offset + e.length)
            if lo >= hi:
                continue
            base = state.open(e, self._device_for(region, e))
            out.append((base + e.alloc_offset + (lo - e.region_offset), hi - lo))
        if sum(n for _, n in out) != length:
            raise AccessViolation(f"the peer's exports do not cover {addr:#x}+{length}")
        return out

    def _device_for(self, region: RegionDesc, e: CudaExport | None = None) -> int:
        """The local ordinal of the GPU holding ``region`` if this process sees it, else 0."""
        if self._uuids is None:
            drv = self._drv()
            self._uuids = {drv.device_uuid(i): i for i in range(drv.device_count())}
        uuid = (
            e.device_uuid
            if e is not None
            else next((x.device_uuid for x in region.cuda_exports), "")
        )
        return self._uuids.get(uuid, 0)

    def abort(self, peer_name: str, lane: int) -> None:
        # Queued copies cannot be recalled: wait (bounded) until they landed, so none lands
        # after the caller hears of the timeout and reuses its buffer.
        state = self._peers.get(peer_name)
        if state is None:
            return
        drv = self._drv()
        for device, stream in list(state.streams.items()):
            try:
                event = drv.event_create(device)
                drv.event_record(event, stream)
                if cuda_driver.wait_event(drv, event, time.monotonic() + _ABORT_WAIT):
                    drv.event_destroy(event)
            except GpuError as exc:
                log.warning("cuda_ipc abort for %s: %s", peer_name, exc)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._epoch.mark_closed()
        if self._waiter is not None:
            self._pending.put(None)
            self._waiter.join(timeout=5)
        with self._lock:
            peers = list(self._peers.values())
            self._peers.clear()
        for state in peers:
            try:
                state.release()
            except GpuError as exc:
                log.warning("cuda_ipc: releasing a peer's handles failed: %s", exc)
        exports, self._exports = list(self._exports.values()), {}
        for ex in exports:
            self._release(ex)
        self._pins.forget((), self._drv() if cuda_driver.loaded() else None)
        self._epoch.release()


@hookimpl
def mooncake_transport() -> type[Transport]:
    return CudaIpcTransport
