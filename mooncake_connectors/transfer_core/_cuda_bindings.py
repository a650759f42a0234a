"""The CudaDriver over cuda-python's ``cuda.bindings.driver``: the only module that imports it.

Driver calls act on the calling thread's current context, which is also the application's
(torch's current device). Each call here pushes the primary context of the device it works on
and pops it after, so the caller's current context is never changed; contexts are retained once
per device and never released, as the runtime does.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import struct
import threading
from collections.abc import Iterator
from typing import Any

from ..errors import GpuError, GpuUnavailable
from .cuda_driver import IPC_HANDLE_BYTES, CudaDriver, Export, MemoryType, PointerInfo, check

_SYS_PIDFD_GETFD = 438  # x86_64 and aarch64 share this syscall number
_libc = ctypes.CDLL(None, use_errno=True)


def _import() -> Any:
    try:
        from cuda.bindings import driver as cu
    except ImportError as exc:
        raise GpuUnavailable(
            f"cuda-python is not installed ({exc}); install mooncake-connectors[cuda]"
        ) from None
    try:
        check("cuInit", cu.cuInit(0))
    except GpuError as exc:
        raise GpuUnavailable(
            f"the CUDA driver found no usable GPU ({exc.message}); check nvidia-smi and "
            "CUDA_VISIBLE_DEVICES",
            call="cuInit",
            code=exc.code,
        ) from None
    except Exception as exc:  # DynamicLibNotFoundError and kin: no libcuda.so on this host
        raise GpuUnavailable(
            f"the NVIDIA driver library could not be loaded ({type(exc).__name__}: {exc}); "
            "this host has no GPU driver, or the process cannot see it",
            call="cuInit",
        ) from None
    return cu


def _pidfd_getfd(pid: int, fd: int) -> int:
    pidfd = os.pidfd_open(pid)
    try:
        out = _libc.syscall(_SYS_PIDFD_GETFD, pidfd, fd, 0)
        if out < 0:
            err = ctypes.get_errno()
            raise GpuError(f"cannot duplicate fd {fd} of pid {pid}: {os.strerror(err)}")
        return int(out)
    finally:
        os.close(pidfd)


class _Calls:
    """``cuda.bindings.driver`` whose driver functions raise GpuError, naming the call, for what
    the bindings raise themselves: FunctionNotFoundError for an entry point this driver lacks,
    ValueError for a result code their enum does not know. Types and enums pass through."""

    def __init__(self, cu: Any) -> None:
        self._cu = cu

    def __getattr__(self, name: str) -> Any:
        obj = getattr(self._cu, name)
        if not (name.startswith("cu") and callable(obj)):
            return obj

        def call(*args: Any) -> Any:
            try:
                return obj(*args)
            except Exception as exc:
                raise GpuError(f"{name} failed: {type(exc).__name__}: {exc}", call=name) from exc

        self.__dict__[name] = call  # found directly from now on
        return call


class BindingsDriver(CudaDriver):
    def __init__(self) -> None:
        self.cu: Any = _Calls(_import())
        self._ctx: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._streams: dict[int, tuple[Any, int]] = {}  # id -> (CUstream, device)
        self._events: dict[int, tuple[Any, int]] = {}  # id -> (CUevent, device)
        self._vmm: dict[int, tuple[int, Any]] = {}  # local base -> (size, handle)
        self._opened: dict[int, int] = {}  # local base of an opened export -> device

    # -- contexts ---------------------------------------------------------------------------
    # The current context is the application's (torch's current device is the runtime's current
    # context): every call pushes the context it needs and pops it after, so the caller's stays
    # as it was and nothing is cached per thread (the application may switch devices at will).
    def _primary(self, device: int) -> Any:
        with self._lock:
            ctx = self._ctx.get(device)
            if ctx is None:
                cu = self.cu
                dev = check("cuDeviceGet", cu.cuDeviceGet(device))
                ctx = check("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(dev))
                self._ctx[device] = ctx
            return ctx

    @contextlib.contextmanager
    def _on(self, device: int | None) -> Iterator[None]:
        """``device``'s primary context current for the calls inside; None: any context (the
        thread's own if it has one, else device 0's)."""
        cu = self.cu
        if device is None:
            if int(check("cuCtxGetCurrent", cu.cuCtxGetCurrent()) or 0) != 0:
                yield
                return
            device = 0
        check("cuCtxPushCurrent", cu.cuCtxPushCurrent(self._primary(device)))
        try:
            yield
        finally:
            check("cuCtxPopCurrent", cu.cuCtxPopCurrent())

    # -- devices ----------------------------------------------------------------------------
    def driver_version(self) -> int:
        return int(check("cuDriverGetVersion", self.cu.cuDriverGetVersion()))

    def device_count(self) -> int:
        return int(check("cuDeviceGetCount", self.cu.cuDeviceGetCount()))

    def device_name(self, device: int) -> str:
        raw = check("cuDeviceGetName", self.cu.cuDeviceGetName(256, device))
        return bytes(raw).split(b"\0", 1)[0].decode(errors="replace")

    def device_uuid(self, device: int) -> str:
        uuid = check("cuDeviceGetUuid", self.cu.cuDeviceGetUuid(device))
        return bytes(uuid.bytes).hex()

    def pci_bus_id(self, device: int) -> str:
        raw = check("cuDeviceGetPCIBusId", self.cu.cuDeviceGetPCIBusId(32, device))
        text = raw if isinstance(raw, str) else bytes(raw).split(b"\0", 1)[0].decode()
        return text.strip().lower()

    def _attr(self, device: int, name: str) -> int:
        attr = getattr(self.cu.CUdevice_attribute, name)
        return int(check("cuDeviceGetAttribute", self.cu.cuDeviceGetAttribute(attr, device)))

    def supports_vmm(self, device: int) -> bool:
        return bool(self._attr(device, "CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED"))

    def supports_fd_export(self, device: int) -> bool:
        name = "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED"
        return bool(self._attr(device, name))

    def supports_dmabuf(self, device: int) -> bool:
        return bool(self._attr(device, "CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED"))

    def can_access_peer(self, device: int, peer: int) -> bool:
        return bool(check("cuDeviceCanAccessPeer", self.cu.cuDeviceCanAccessPeer(device, peer)))

    # -- pointers ---------------------------------------------------------------------------
    def _pointer_attr(self, name: str, addr: int) -> Any:
        attr = getattr(self.cu.CUpointer_attribute, "CU_POINTER_ATTRIBUTE_" + name)
        return self.cu.cuPointerGetAttribute(attr, addr)

    def pointer_info(self, addr: int) -> PointerInfo:
        with self._on(None):
            err, mtype = self._pointer_attr("MEMORY_TYPE", addr)
            if int(err) != 0:  # CUDA_ERROR_INVALID_VALUE: memory the driver never saw
                return PointerInfo(MemoryType.UNKNOWN, -1, addr, 0, False)
            if int(mtype) != 2:  # CU_MEMORYTYPE_DEVICE; pinned host memory answers fewer
                return PointerInfo(MemoryType.HOST, -1, addr, 0, False)
            ordinal = check("cuPointerGetAttribute", self._pointer_attr("DEVICE_ORDINAL", addr))
            err, legacy = self._pointer_attr("IS_LEGACY_CUDA_IPC_CAPABLE", addr)
            legacy = int(err) == 0 and bool(legacy)
            # For a VMM pointer (torch's expandable segments) RANGE_* is the whole address
            # reservation, which holds many separately created chunks; the allocation that
            # can be exported and mapped elsewhere is the mapping holding the pointer.
            start_attr, size_attr = ("RANGE_START_ADDR", "RANGE_SIZE")
            if not legacy:
                err, _ = self._pointer_attr("MAPPING_BASE_ADDR", addr)
                if int(err) == 0:
                    start_attr, size_attr = ("MAPPING_BASE_ADDR", "MAPPING_SIZE")
            start = check("cuPointerGetAttribute", self._pointer_attr(start_attr, addr))
            size = check("cuPointerGetAttribute", self._pointer_attr(size_attr, addr))
        return PointerInfo(MemoryType.DEVICE, int(ordinal), int(start), int(size), legacy)

    # -- sharing ----------------------------------------------------------------------------
    def export(self, addr: int) -> Export:
        cu = self.cu
        info = self.pointer_info(addr)
        if info.kind is not MemoryType.DEVICE:
            raise GpuError(f"{addr:#x} is not device memory; only device memory is exported")
        with self._on(info.device):
            if info.legacy_ipc:
                handle = check("cuIpcGetMemHandle", cu.cuIpcGetMemHandle(info.base))
                raw = ctypes.string_at(handle.getPtr(), IPC_HANDLE_BYTES)
                return Export("ipc", raw, info.base, info.size)
            # VMM: the physical chunk mapped at the mapping base, exported as an fd.
            mem = check("cuMemRetainAllocationHandle", cu.cuMemRetainAllocationHandle(info.base))
            try:
                fd = check(
                    "cuMemExportToShareableHandle",
                    cu.cuMemExportToShareableHandle(
                        mem,
                        cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                        0,
                    ),
                )
            finally:
                check("cuMemRelease", cu.cuMemRelease(mem))
        return Export("fd", struct.pack("<q", int(fd)), info.base, info.size)

    def release_export(self, kind: str, handle: bytes) -> None:
        if kind == "fd":
            (fd,) = struct.unpack("<q", handle)
            os.close(fd)

    def open_export(self, export: Export, owner_pid: int, device: int) -> int:
        with self._on(device):
            base = self._open(export, owner_pid, device)
        self._opened[base] = device
        return base

    def _open(self, export: Export, owner_pid: int, device: int) -> int:
        cu = self.cu
        if export.kind == "ipc":
            handle = cu.CUipcMemHandle()
            ctypes.memmove(handle.getPtr(), export.handle, IPC_HANDLE_BYTES)
            flags = cu.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
            return int(check("cuIpcOpenMemHandle", cu.cuIpcOpenMemHandle(handle, flags)))
        if export.kind != "fd":
            raise GpuError(f"unknown export kind {export.kind!r}")
        (remote_fd,) = struct.unpack("<q", export.handle)
        fd = _pidfd_getfd(owner_pid, remote_fd)
        try:
            htype = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
            mem = check(
                "cuMemImportFromShareableHandle", cu.cuMemImportFromShareableHandle(fd, htype)
            )
        finally:
            os.close(fd)
        size = export.size
        base = int(check("cuMemAddressReserve", cu.cuMemAddressReserve(size, 0, 0, 0)))
        check("cuMemMap", cu.cuMemMap(base, size, 0, mem, 0))
        # Copies run on the stream of the local GPU at the other end, which may be any local
        # device that reaches this one: each of them is granted access.
        descs = []
        for d in self._accessors(device):
            access = cu.CUmemAccessDesc()
            access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            access.location.id = d
            access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            descs.append(access)
        check("cuMemSetAccess", cu.cuMemSetAccess(base, size, descs, len(descs)))
        self._vmm[base] = (size, mem)
        return base

    def _accessors(self, device: int) -> list[int]:
        """``device`` and every local device with peer access to it."""
        others = range(self.device_count())
        return [device] + [d for d in others if d != device and self.can_access_peer(d, device)]

    def close_export(self, export: Export, local_base: int) -> None:
        cu = self.cu
        with self._on(self._opened.pop(local_base, None)):  # the context it was opened in
            if export.kind == "ipc":
                check("cuIpcCloseMemHandle", cu.cuIpcCloseMemHandle(local_base))
                return
            size, mem = self._vmm.pop(local_base)
            check("cuMemUnmap", cu.cuMemUnmap(local_base, size))
            check("cuMemAddressFree", cu.cuMemAddressFree(local_base, size))
            check("cuMemRelease", cu.cuMemRelease(mem))

    def dmabuf_export(self, addr: int, length: int) -> tuple[int, int]:
        cu = self.cu
        page = 1 << 16  # the driver exports whole pages: align the range out to 64 KiB
        base = addr & ~(page - 1)
        size = -(-(addr + length - base) // page) * page
        kind = cu.CUmemRangeHandleType.CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD
        with self._on(None):
            fd = check(
                "cuMemGetHandleForAddressRange",
                cu.cuMemGetHandleForAddressRange(base, size, kind, 0),
            )
        return int(fd), addr - base

    # -- host memory ------------------------------------------------------------------------
    def host_register(self, addr: int, length: int, *, read_only: bool = False) -> None:
        flags = int(self.cu.CU_MEMHOSTREGISTER_PORTABLE)
        if read_only:
            flags |= int(self.cu.CU_MEMHOSTREGISTER_READ_ONLY)
        with self._on(None):
            check("cuMemHostRegister", self.cu.cuMemHostRegister(addr, length, flags))

    def host_unregister(self, addr: int) -> None:
        with self._on(None):
            check("cuMemHostUnregister", self.cu.cuMemHostUnregister(addr))

    def host_alloc(self, length: int) -> int:
        flags = self.cu.CU_MEMHOSTALLOC_PORTABLE
        with self._on(None):
            return int(check("cuMemHostAlloc", self.cu.cuMemHostAlloc(length, flags)))

    def host_free(self, addr: int) -> None:
        with self._on(None):
            check("cuMemFreeHost", self.cu.cuMemFreeHost(addr))

    # -- streams and events -----------------------------------------------------------------
    # Each stream and event belongs to its device's primary context; every call on one runs
    # with that context current, whatever the calling thread has current.
    def stream_create(self, device: int) -> int:
        flags = self.cu.CUstream_flags.CU_STREAM_NON_BLOCKING
        with self._on(device):
            stream = check("cuStreamCreate", self.cu.cuStreamCreate(flags))
        key = int(stream)
        self._streams[key] = (stream, device)
        return key

    def stream_destroy(self, stream: int) -> None:
        s, device = self._streams.pop(stream)
        with self._on(device):
            check("cuStreamDestroy", self.cu.cuStreamDestroy(s))

    def memcpy_async(self, dst: int, src: int, length: int, stream: int) -> None:
        s, device = self._streams[stream]
        with self._on(device):
            check("cuMemcpyAsync", self.cu.cuMemcpyAsync(dst, src, length, s))

    def event_create(self, device: int) -> int:
        flags = self.cu.CUevent_flags.CU_EVENT_DISABLE_TIMING
        with self._on(device):
            event = check("cuEventCreate", self.cu.cuEventCreate(flags))
        key = int(event)
        self._events[key] = (event, device)
        return key

    def event_record(self, event: int, stream: int) -> None:
        ev, device = self._events[event]
        s, _ = self._streams[stream]
        with self._on(device):
            check("cuEventRecord", self.cu.cuEventRecord(ev, s))

    def event_done(self, event: int) -> bool:
        ev, device = self._events[event]
        with self._on(device):
            res = self.cu.cuEventQuery(ev)
        err = res[0] if isinstance(res, tuple) else res
        code = int(err)
        if code == 600:  # CUDA_ERROR_NOT_READY
            return False
        if code != 0:
            raise GpuError(f"cuEventQuery failed: {getattr(err, 'name', code)}", code=code)
        return True

    def event_destroy(self, event: int) -> None:
        ev, device = self._events.pop(event)
        with self._on(device):
            check("cuEventDestroy", self.cu.cuEventDestroy(ev))

    # -- ordering after the application's stream ---------------------------------------------
    def event_record_on(self, event: int, handle: int) -> None:
        ev, device = self._events[event]
        with self._on(device):  # handle 0, the legacy stream, is the current context's
            check("cuEventRecord", self.cu.cuEventRecord(ev, self.cu.CUstream(handle)))

    def stream_wait_event(self, stream: int, event: int) -> None:
        s, device = self._streams[stream]
        ev, _ = self._events[event]  # an event of another device is allowed
        with self._on(device):
            check("cuStreamWaitEvent", self.cu.cuStreamWaitEvent(s, ev, 0))
