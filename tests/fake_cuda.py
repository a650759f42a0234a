"""FakeCuda: a fake of our CUDA driver seam (transfer_core.cuda_driver.CudaDriver) over host memory.

Tests install it with ``cuda_driver.install(FakeCuda())``; nothing else in the package is faked.
"Device memory" is memfd-backed host memory, so another process can open an export of it through
``/proc/PID/fd/N`` the way a real importer opens an IPC handle. Streams are worker threads that
run their queue in order; an event is done once its stream ran past its last record. The fake is
strict where the real driver is: a copy between memory it does not know (neither device memory,
an opened export, nor pinned or registered host memory) fails, as do double registrations and
closing what was never opened, so that tests catch a missing pin or a leaked handle.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import queue
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from mooncake_connectors.errors import GpuError
from mooncake_connectors.transfer_core import cuda_driver
from mooncake_connectors.transfer_core.cuda_driver import (
    IPC_HANDLE_BYTES,
    CudaDriver,
    Export,
    MemoryType,
    PointerInfo,
)

INVALID_VALUE = 1
ALREADY_REGISTERED = 712
NOT_REGISTERED = 713


@dataclass
class _Mem:
    base: int
    size: int
    kind: MemoryType
    device: int
    mm: mmap.mmap | None = None
    pin: object = None
    fd: int = -1
    inode: int = 0
    vmm: bool = False


@dataclass
class _Stream:
    device: int
    q: queue.SimpleQueue[object] = field(default_factory=queue.SimpleQueue)
    thread: threading.Thread | None = None


class FakeCuda(CudaDriver):
    def __init__(self, devices: int = 2, *, vmm: bool = True) -> None:
        self.devices = devices
        self.vmm = vmm
        self._lock = threading.Lock()
        self._mems: dict[int, _Mem] = {}  # base -> memory the "driver" knows
        self._imports: dict[int, tuple[Export, int]] = {}  # local base -> (export, refcount)
        self._streams: dict[int, _Stream] = {}
        self._events: dict[int, list[int]] = {}  # id -> [records, completed]
        self._ids = iter(range(1, 1 << 30))
        self.calls: list[str] = []  # names of calls made, in order (for tests to inspect)
        self.copies: list[tuple[int, int, int]] = []  # (dst, src, length) as executed

    # -- test helpers (not part of CudaDriver) ----------------------------------------------
    def device_alloc(self, size: int, device: int = 0, *, vmm: bool = False) -> int:
        fd = os.memfd_create("fake-cuda", os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        pin = ctypes.c_char.from_buffer(mm)
        base = ctypes.addressof(pin)
        ino = os.fstat(fd).st_ino
        with self._lock:
            self._mems[base] = _Mem(base, size, MemoryType.DEVICE, device, mm, pin, fd, ino, vmm)
        return base

    def dmabuf_export(self, addr: int, length: int) -> tuple[int, int]:
        """The memfd behind fake device memory stands for its dma-buf (a new fd, the caller's
        to close), with ``addr``'s offset in it, as cuMemGetHandleForAddressRange gives."""
        self.calls.append("dmabuf_export")
        with self._lock:
            m = next((m for m in self._mems.values() if m.base <= addr < m.base + m.size), None)
        if m is None or m.kind is not MemoryType.DEVICE or addr + length > m.base + m.size:
            call = "cuMemGetHandleForAddressRange"
            raise GpuError("not device memory", code=INVALID_VALUE, call=call)
        return os.dup(m.fd), addr - m.base

    def device_free(self, base: int) -> None:
        with self._lock:
            m = self._mems.pop(base)
        self._release(m)

    def array(self, base: int, size: int) -> object:
        """A numpy view of fake device memory (possible only because it is host memory)."""
        import numpy as np

        return np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(base))

    def open_imports(self) -> int:
        with self._lock:
            return len(self._imports)

    def close(self) -> None:
        for s in list(self._streams):
            self.stream_destroy(s)
        with self._lock:
            mems = list(self._mems.values())
            self._mems.clear()
        for m in mems:
            self._release(m)

    @staticmethod
    def _release(m: _Mem) -> None:
        m.pin = None
        if m.mm is not None:
            m.mm.close()
        if m.fd >= 0:
            os.close(m.fd)

    def _find(self, addr: int, length: int = 1) -> _Mem | None:
        with self._lock:
            for m in self._mems.values():
                if m.base <= addr and addr + length <= m.base + m.size:
                    return m
        return None

    def _fail(self, call: str, code: int, why: str) -> GpuError:
        return GpuError(f"{call} failed: {why}", call=call, code=code)

    # -- CudaDriver -------------------------------------------------------------------------
    def driver_version(self) -> int:
        return 12080

    def device_count(self) -> int:
        return self.devices

    def _dev(self, call: str, device: int) -> None:
        if not 0 <= device < self.devices:
            raise self._fail(call, 101, f"invalid device ordinal {device}")

    def device_name(self, device: int) -> str:
        self._dev("cuDeviceGetName", device)
        return f"Fake GPU {device}"

    def device_uuid(self, device: int) -> str:
        self._dev("cuDeviceGetUuid", device)
        return f"fake-uuid-{device}"

    def supports_vmm(self, device: int) -> bool:
        return self.vmm

    def can_access_peer(self, device: int, peer: int) -> bool:
        return device != peer

    def pointer_info(self, addr: int) -> PointerInfo:
        self.calls.append("cuPointerGetAttribute")
        m = self._find(addr)
        if m is None:
            return PointerInfo(MemoryType.UNKNOWN, -1, addr, 0, False)
        legacy = m.kind is MemoryType.DEVICE and not m.vmm
        return PointerInfo(m.kind, m.device, m.base, m.size, legacy)

    def export(self, addr: int) -> Export:
        self.calls.append("export")
        m = self._find(addr)
        if m is None or m.kind is not MemoryType.DEVICE or m.fd < 0:
            raise self._fail("cuIpcGetMemHandle", INVALID_VALUE, f"{addr:#x} is not device memory")
        if m.vmm:
            return Export("fd", struct.pack("<q", m.fd), m.base, m.size)
        raw = struct.pack("<iiQQ", os.getpid(), m.fd, m.inode, m.size)
        return Export("ipc", raw.ljust(IPC_HANDLE_BYTES, b"\0"), m.base, m.size)

    def open_export(self, export: Export, owner_pid: int, device: int) -> int:
        self.calls.append("open_export")
        self._dev("cuIpcOpenMemHandle", device)
        if export.kind == "ipc":
            pid, fd, inode, size = struct.unpack_from("<iiQQ", export.handle)
            if pid != owner_pid:
                raise self._fail("cuIpcOpenMemHandle", INVALID_VALUE, "handle of another process")
        else:
            (fd,) = struct.unpack("<q", export.handle)
            pid, inode, size = owner_pid, 0, export.size
        try:
            f = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise self._fail("cuIpcOpenMemHandle", INVALID_VALUE, str(exc)) from None
        try:
            if inode and os.fstat(f).st_ino != inode:
                raise self._fail("cuIpcOpenMemHandle", INVALID_VALUE, "stale handle")
            mm = mmap.mmap(f, size, flags=mmap.MAP_SHARED)
        finally:
            os.close(f)
        pin = ctypes.c_char.from_buffer(mm)
        base = ctypes.addressof(pin)
        with self._lock:
            self._mems[base] = _Mem(base, size, MemoryType.DEVICE, device, mm, pin)
            self._imports[base] = (export, 1)
        return base

    def close_export(self, export: Export, local_base: int) -> None:
        self.calls.append("close_export")
        with self._lock:
            if local_base not in self._imports:
                raise self._fail("cuIpcCloseMemHandle", INVALID_VALUE, "not an opened handle")
            del self._imports[local_base]
            m = self._mems.pop(local_base)
        self._release(m)

    def host_register(self, addr: int, length: int, *, read_only: bool = False) -> None:
        self.calls.append("cuMemHostRegister")
        if self._find(addr, 1) is not None or self._find(addr + length - 1, 1) is not None:
            raise self._fail("cuMemHostRegister", ALREADY_REGISTERED, "already registered")
        with self._lock:
            self._mems[addr] = _Mem(addr, length, MemoryType.HOST, -1)

    def host_unregister(self, addr: int) -> None:
        self.calls.append("cuMemHostUnregister")
        with self._lock:
            m = self._mems.get(addr)
            if m is None or m.kind is not MemoryType.HOST or m.mm is not None:
                raise self._fail("cuMemHostUnregister", NOT_REGISTERED, f"{addr:#x}")
            del self._mems[addr]

    def host_alloc(self, length: int) -> int:
        self.calls.append("cuMemHostAlloc")
        mm = mmap.mmap(-1, length)
        pin = ctypes.c_char.from_buffer(mm)
        base = ctypes.addressof(pin)
        with self._lock:
            self._mems[base] = _Mem(base, length, MemoryType.HOST, -1, mm, pin)
        return base

    def host_free(self, addr: int) -> None:
        self.calls.append("cuMemFreeHost")
        with self._lock:
            m = self._mems.pop(addr)
        self._release(m)

    def stream_create(self, device: int) -> int:
        self._dev("cuStreamCreate", device)
        sid = next(self._ids)
        s = _Stream(device)
        s.thread = threading.Thread(target=self._run, args=(s,), daemon=True, name=f"fake-s{sid}")
        s.thread.start()
        with self._lock:
            self._streams[sid] = s
        return sid

    def _run(self, s: _Stream) -> None:
        while True:
            item = s.q.get()
            if item is None:
                return
            if isinstance(item, tuple):
                dst, src, n = item
                ctypes.memmove(dst, src, n)
                self.copies.append(item)
            elif isinstance(item, list):
                item[1] += 1  # an event's record reached: one more completed

    def stream_destroy(self, stream: int) -> None:
        with self._lock:
            s = self._streams.pop(stream)
        s.q.put(None)
        assert s.thread is not None
        s.thread.join(5)

    def memcpy_async(self, dst: int, src: int, length: int, stream: int) -> None:
        self.calls.append("cuMemcpyAsync")
        for end, what in ((dst, "destination"), (src, "source")):
            if self._find(end, length) is None:
                raise self._fail(
                    "cuMemcpyAsync", INVALID_VALUE, f"{what} {end:#x}+{length} is not known memory"
                )
        self._streams[stream].q.put((dst, src, length))

    def event_create(self, device: int) -> int:
        eid = next(self._ids)
        self._events[eid] = [0, 0]
        return eid

    def event_record(self, event: int, stream: int) -> None:
        ev = self._events[event]
        ev[0] += 1
        self._streams[stream].q.put(ev)

    def event_done(self, event: int) -> bool:
        ev = self._events[event]
        return ev[1] >= ev[0]

    def event_destroy(self, event: int) -> None:
        del self._events[event]


def ensure_cuda_ipc_registered() -> None:
    """Make ``cuda_ipc`` known even to an install whose entry points predate it (an editable
    install records them when installed, not when the source changes)."""
    from mooncake_connectors.transfer_core.transport import TRANSPORTS
    from mooncake_connectors.transfer_core.transports.cuda_ipc import CudaIpcTransport

    if "cuda_ipc" not in TRANSPORTS.names():
        TRANSPORTS.register("cuda_ipc", CudaIpcTransport)


class FakeCudaTensor:
    """What the connectors ask of a CUDA KV cache tensor (geometry, device, dtype), over fake
    device memory: torch's own CUDA tensors need a GPU."""

    def __init__(self, fake: FakeCuda, shape: tuple[int, ...], itemsize: int = 2) -> None:
        import numpy as np

        self.shape = shape
        self.itemsize = itemsize
        n = int(np.prod(shape)) * itemsize
        self.addr = fake.device_alloc(n)
        self.bytes: Any = fake.array(self.addr, n)
        self.device = _Device("cuda", 0)
        self.dtype = "torch.bfloat16"

    def stride(self) -> tuple[int, ...]:
        out, acc = [], 1
        for dim in reversed(self.shape):
            out.append(acc)
            acc *= dim
        return tuple(reversed(out))

    def element_size(self) -> int:
        return self.itemsize

    def data_ptr(self) -> int:
        return self.addr

    def is_contiguous(self) -> bool:
        return True

    def elements(self) -> Any:
        """The bytes as an array of ``shape`` plus a trailing item-size axis."""
        return self.bytes.reshape(*self.shape, self.itemsize)


@dataclass(frozen=True)
class _Device:
    type: str
    index: int


@contextlib.contextmanager
def installed(devices: int = 2) -> Iterator[FakeCuda]:
    """A FakeCuda at the driver seam for the duration; the previous driver is put back."""
    f = FakeCuda(devices)
    prev = cuda_driver.install(f)
    try:
        yield f
    finally:
        cuda_driver.install(prev)
        f.close()
