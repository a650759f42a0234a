"""The CudaDriver over cuda-python's ``cuda.bindings.driver``: the only module that imports it.

Each thread that calls in gets the primary context of the device it works on made current
(driver calls act on the current context); contexts are retained once per device and never
released, as the runtime does.
"""

from __future__ import annotations

import ctypes
import os
import struct
import threading
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


class BindingsDriver(CudaDriver):
    def __init__(self) -> None:
        self.cu = _import()
        self._ctx: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._tls = threading.local()
        self._streams: dict[int, tuple[Any, int]] = {}  # id -> (CUstream, device)
        self._events: dict[int, tuple[Any, int]] = {}  # id -> (CUevent, device)
        self._vmm: dict[int, tuple[int, Any]] = {}  # local base -> (size, handle)

    # -- contexts ---------------------------------------------------------------------------
    def _use(self, device: int) -> None:
        if getattr(self._tls, "device", None) == device:
            return
        cu = self.cu
        with self._lock:
            ctx = self._ctx.get(device)
            if ctx is None:
                dev = check("cuDeviceGet", cu.cuDeviceGet(device))
                ctx = check("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(dev))
                self._ctx[device] = ctx
        check("cuCtxSetCurrent", cu.cuCtxSetCurrent(ctx))
        self._tls.device = device

    def _any(self) -> None:
        if getattr(self._tls, "device", None) is None:
            self._use(0)

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

    def _attr(self, device: int, name: str) -> int:
        attr = getattr(self.cu.CUdevice_attribute, name)
        return int(check("cuDeviceGetAttribute", self.cu.cuDeviceGetAttribute(attr, device)))

    def supports_vmm(self, device: int) -> bool:
        return bool(self._attr(device, "CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED"))

    def can_access_peer(self, device: int, peer: int) -> bool:
        return bool(check("cuDeviceCanAccessPeer", self.cu.cuDeviceCanAccessPeer(device, peer)))

    # -- pointers ---------------------------------------------------------------------------
    def pointer_info(self, addr: int) -> PointerInfo:
        cu = self.cu
        self._any()
        a = cu.CUpointer_attribute
        err, mtype = cu.cuPointerGetAttribute(a.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, addr)
        if int(err) != 0:  # CUDA_ERROR_INVALID_VALUE: memory the driver never saw
            return PointerInfo(MemoryType.UNKNOWN, -1, addr, 0, False)
        if int(mtype) != 2:  # CU_MEMORYTYPE_DEVICE; pinned host memory answers fewer questions
            return PointerInfo(MemoryType.HOST, -1, addr, 0, False)
        ordinal = check(
            "cuPointerGetAttribute",
            cu.cuPointerGetAttribute(a.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, addr),
        )
        start = check(
            "cuPointerGetAttribute",
            cu.cuPointerGetAttribute(a.CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, addr),
        )
        size = check(
            "cuPointerGetAttribute",
            cu.cuPointerGetAttribute(a.CU_POINTER_ATTRIBUTE_RANGE_SIZE, addr),
        )
        legacy_attr = a.CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE
        err, legacy = cu.cuPointerGetAttribute(legacy_attr, addr)
        return PointerInfo(
            MemoryType.DEVICE, int(ordinal), int(start), int(size), int(err) == 0 and bool(legacy)
        )

    # -- sharing ----------------------------------------------------------------------------
    def export(self, addr: int) -> Export:
        cu = self.cu
        info = self.pointer_info(addr)
        if info.kind is not MemoryType.DEVICE:
            raise GpuError(f"{addr:#x} is not device memory; only device memory is exported")
        self._use(info.device)
        if info.legacy_ipc:
            handle = check("cuIpcGetMemHandle", cu.cuIpcGetMemHandle(info.base))
            raw = ctypes.string_at(handle.getPtr(), IPC_HANDLE_BYTES)
            return Export("ipc", raw, info.base, info.size)
        # A VMM allocation (torch's expandable segments): export its physical handle as an fd.
        mem = check("cuMemRetainAllocationHandle", cu.cuMemRetainAllocationHandle(info.base))
        try:
            fd = check(
                "cuMemExportToShareableHandle",
                cu.cuMemExportToShareableHandle(
                    mem, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0
                ),
            )
        finally:
            check("cuMemRelease", cu.cuMemRelease(mem))
        return Export("fd", struct.pack("<q", int(fd)), info.base, info.size)

    def open_export(self, export: Export, owner_pid: int, device: int) -> int:
        cu = self.cu
        self._use(device)
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
        access = cu.CUmemAccessDesc()
        access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = device
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        check("cuMemSetAccess", cu.cuMemSetAccess(base, size, [access], 1))
        self._vmm[base] = (size, mem)
        return base

    def close_export(self, export: Export, local_base: int) -> None:
        cu = self.cu
        self._any()
        if export.kind == "ipc":
            check("cuIpcCloseMemHandle", cu.cuIpcCloseMemHandle(local_base))
            return
        size, mem = self._vmm.pop(local_base)
        check("cuMemUnmap", cu.cuMemUnmap(local_base, size))
        check("cuMemAddressFree", cu.cuMemAddressFree(local_base, size))
        check("cuMemRelease", cu.cuMemRelease(mem))

    def dmabuf_export(self, addr: int, length: int) -> tuple[int, int]:
        cu = self.cu
        self._any()
        page = 1 << 16  # the driver exports whole pages: align the range out to 64 KiB
        base = addr & ~(page - 1)
        size = -(-(addr + length - base) // page) * page
        kind = cu.CUmemRangeHandleType.CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD
        fd = check(
            "cuMemGetHandleForAddressRange", cu.cuMemGetHandleForAddressRange(base, size, kind, 0)
        )
        return int(fd), addr - base

    # -- host memory ------------------------------------------------------------------------
    def host_register(self, addr: int, length: int) -> None:
        self._any()
        flags = self.cu.CU_MEMHOSTREGISTER_PORTABLE
        check("cuMemHostRegister", self.cu.cuMemHostRegister(addr, length, flags))

    def host_unregister(self, addr: int) -> None:
        self._any()
        check("cuMemHostUnregister", self.cu.cuMemHostUnregister(addr))

    def host_alloc(self, length: int) -> int:
        self._any()
        flags = self.cu.CU_MEMHOSTALLOC_PORTABLE
        return int(check("cuMemHostAlloc", self.cu.cuMemHostAlloc(length, flags)))

    def host_free(self, addr: int) -> None:
        self._any()
        check("cuMemFreeHost", self.cu.cuMemFreeHost(addr))

    # -- streams and events -----------------------------------------------------------------
    def stream_create(self, device: int) -> int:
        self._use(device)
        flags = self.cu.CUstream_flags.CU_STREAM_NON_BLOCKING
        stream = check("cuStreamCreate", self.cu.cuStreamCreate(flags))
        key = int(stream)
        self._streams[key] = (stream, device)
        return key

    def stream_destroy(self, stream: int) -> None:
        s, device = self._streams.pop(stream)
        self._use(device)
        check("cuStreamDestroy", self.cu.cuStreamDestroy(s))

    def memcpy_async(self, dst: int, src: int, length: int, stream: int) -> None:
        s, device = self._streams[stream]
        self._use(device)
        check("cuMemcpyAsync", self.cu.cuMemcpyAsync(dst, src, length, s))

    def event_create(self, device: int) -> int:
        self._use(device)
        flags = self.cu.CUevent_flags.CU_EVENT_DISABLE_TIMING
        event = check("cuEventCreate", self.cu.cuEventCreate(flags))
        key = int(event)
        self._events[key] = (event, device)
        return key

    def event_record(self, event: int, stream: int) -> None:
        ev, device = self._events[event]
        s, _ = self._streams[stream]
        self._use(device)
        check("cuEventRecord", self.cu.cuEventRecord(ev, s))

    def event_done(self, event: int) -> bool:
        ev, device = self._events[event]
        self._use(device)
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
        self._use(device)
        check("cuEventDestroy", self.cu.cuEventDestroy(ev))
