"""The one seam between this package and the CUDA driver.

Everything GPU-related in the engine goes through :func:`driver`, an implementation of
:class:`CudaDriver`. The real one wraps ``cuda.bindings.driver`` (cuda-python), imported on first
use so that a CPU-only install never loads it; tests install a fake with :func:`install`. The
methods speak plain ints (addresses, device ordinals, stream and event ids) so that callers never
hold a cuda-python object.

Without a GPU, cuda-python still imports, but its first driver call raises
``DynamicLibNotFoundError`` (no ``libcuda.so``) instead of returning an error code; that, a
missing cuda-python, and ``cuInit`` failing all become one :class:`GpuUnavailable` whose message
says why.
"""

from __future__ import annotations

import abc
import enum
import threading
import time
import weakref
from typing import Any, NamedTuple

from ..errors import GpuError, GpuUnavailable

IPC_HANDLE_BYTES = 64  # sizeof(CUipcMemHandle)


class MemoryType(enum.Enum):
    DEVICE = "device"  # cudaMalloc / VMM / IPC-opened device memory
    HOST = "host"  # pinned host memory (cuMemHostAlloc, cuMemHostRegister)
    UNKNOWN = "unknown"  # memory the driver does not know (pageable host memory)


class PointerInfo(NamedTuple):
    kind: MemoryType
    device: int  # ordinal in this process; -1 for host memory
    base: int  # start of the allocation (or registration) holding the pointer
    size: int
    legacy_ipc: bool  # exportable with cuIpcGetMemHandle (False for VMM allocations)


class Export(NamedTuple):
    """A shareable handle of one allocation. kind "ipc": ``handle`` is a CUipcMemHandle; kind
    "fd": ``handle`` is the exporter's file descriptor number (little-endian), which an importer
    duplicates through pidfd_getfd."""

    kind: str
    handle: bytes
    base: int
    size: int


class CudaDriver(abc.ABC):
    """The driver calls the engine uses. Every method raises GpuError on failure."""

    @abc.abstractmethod
    def driver_version(self) -> int:
        """CUDA version the driver supports, as 1000*major + 10*minor."""

    @abc.abstractmethod
    def device_count(self) -> int: ...

    @abc.abstractmethod
    def device_name(self, device: int) -> str: ...

    @abc.abstractmethod
    def device_uuid(self, device: int) -> str:
        """Stable across processes, unlike ordinals (CUDA_VISIBLE_DEVICES renumbers)."""

    def pci_bus_id(self, device: int) -> str:
        """Device ``device``'s PCI address as sysfs names it ("0000:3b:00.0"), "" if unknown.
        CUDA's ordinals follow CUDA_VISIBLE_DEVICES (numbers or UUIDs) and CUDA_DEVICE_ORDER,
        not the bus order, so only the driver knows which PCI function an ordinal is."""
        del device
        return ""

    @abc.abstractmethod
    def supports_vmm(self, device: int) -> bool: ...

    def supports_fd_export(self, device: int) -> bool:
        """Can VMM allocations be exported as POSIX fds (how cuda_ipc shares them)?"""
        return self.supports_vmm(device)

    def supports_dmabuf(self, device: int) -> bool:
        """Can device memory be exported as a dma-buf (RDMA registration of GPU memory)?"""
        del device
        return False

    @abc.abstractmethod
    def can_access_peer(self, device: int, peer: int) -> bool: ...

    @abc.abstractmethod
    def pointer_info(self, addr: int) -> PointerInfo: ...

    @abc.abstractmethod
    def export(self, addr: int) -> Export:
        """A handle of the allocation holding ``addr``, for another process of this host."""

    @abc.abstractmethod
    def open_export(self, export: Export, owner_pid: int, device: int) -> int:
        """Map a peer's export into this process on ``device``; returns the local base."""

    @abc.abstractmethod
    def close_export(self, export: Export, local_base: int) -> None: ...

    def release_export(self, kind: str, handle: bytes) -> None:
        """The exporter no longer publishes this export: free what :meth:`export` made for it
        (an "fd" export's descriptor, which also holds the physical memory). Default: nothing
        was made."""
        del kind, handle

    def dmabuf_export(self, addr: int, length: int) -> tuple[int, int]:
        """A dma-buf fd covering ``[addr, addr + length)`` and ``addr``'s offset in it (for
        RDMA registration of GPU memory); GpuError where the driver cannot export one."""
        raise GpuError("this CUDA driver exports no dma-buf", call="cuMemGetHandleForAddressRange")

    @abc.abstractmethod
    def host_register(self, addr: int, length: int, *, read_only: bool = False) -> None:
        """Pin pageable host memory so copies to and from it run asynchronously; ``read_only``
        for memory the GPU only reads (pages mapped read-only cannot be pinned otherwise). The
        driver pins whole pages: a range sharing a page with a registration already made fails
        with CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED (712)."""

    @abc.abstractmethod
    def host_unregister(self, addr: int) -> None: ...

    @abc.abstractmethod
    def host_alloc(self, length: int) -> int:
        """Pinned host memory (staging buffers)."""

    @abc.abstractmethod
    def host_free(self, addr: int) -> None: ...

    @abc.abstractmethod
    def stream_create(self, device: int) -> int: ...

    @abc.abstractmethod
    def stream_destroy(self, stream: int) -> None: ...

    @abc.abstractmethod
    def memcpy_async(self, dst: int, src: int, length: int, stream: int) -> None:
        """Queue a copy on ``stream``; copies on one stream run in order."""

    @abc.abstractmethod
    def event_create(self, device: int) -> int: ...

    @abc.abstractmethod
    def event_record(self, event: int, stream: int) -> None: ...

    @abc.abstractmethod
    def event_done(self, event: int) -> bool:
        """Has everything queued before the event's last record finished?"""

    @abc.abstractmethod
    def event_destroy(self, event: int) -> None: ...

    def event_record_on(self, event: int, handle: int) -> None:
        """Record ``event`` on a stream this driver did not make: the application's, by its raw
        handle (``torch.cuda.current_stream(device).cuda_stream``; 0 is the legacy default
        stream of the event's device)."""
        raise GpuError("this CUDA driver records on its own streams only", call="cuEventRecord")

    def stream_wait_event(self, stream: int, event: int) -> None:
        """Work queued on ``stream`` after this call waits on the GPU until ``event``'s last
        record is reached; the host does not wait."""
        raise GpuError("this CUDA driver cannot order streams", call="cuStreamWaitEvent")


# How wait_event waits (see docs/transfer.md, "GPU memory", completion).
_SPIN_QUERIES = 64  # queries made, without sleeping, before the first sleep ...
_SPIN_S = 100e-6  # ... and for at least this long
_SLEEP_SHARE = 1 / 16  # then each sleep is this share of the time waited so far ...
_SLEEP_MIN, _SLEEP_MAX = 20e-6, 1e-3  # ... within these bounds


def wait_event(drv: CudaDriver, event: int, deadline: float) -> bool:
    """Wait for ``event`` until ``deadline`` (monotonic); False when it passed first.

    The driver has no timed wait (cuEventSynchronize blocks until the GPU gets there, so a
    thread in it on work that never finishes is lost for good), so this queries: first in a
    tight loop (a copy of up to ~100 us is seen within a query's time), then sleeping a
    sixteenth of the time waited so far (a long copy is seen at most ~6% late, plus the OS's
    sleep granularity), never past the deadline. The calling thread is the only one involved."""
    if drv.event_done(event):
        return True
    start = time.monotonic()
    queries = 1
    while not drv.event_done(event):
        now = time.monotonic()
        if now >= deadline:
            return False
        queries += 1
        waited = now - start
        if queries < _SPIN_QUERIES or waited < _SPIN_S:
            continue
        pause = min(max(waited * _SLEEP_SHARE, _SLEEP_MIN), _SLEEP_MAX)
        time.sleep(min(pause, deadline - now))
    return True


class Fence:
    """A point in an application's stream (where its kernels write the bytes a transfer then
    moves) that copies must follow: an event recorded there now. :meth:`order` makes one of our
    copy streams wait for it on the GPU, so neither the host nor the application's stream waits;
    :meth:`wait` waits for it on the host, for a path that copies without a stream of ours.
    The event goes when the fence is garbage (a stream waiting on it still waits)."""

    def __init__(self, device: int, handle: int, drv: CudaDriver | None = None) -> None:
        self.drv = drv or driver()
        self.device = device
        self.event = self.drv.event_create(device)
        try:
            self.drv.event_record_on(self.event, handle)
        except BaseException:
            self.drv.event_destroy(self.event)
            raise
        self._ordered: set[int] = set()  # our streams that wait for it already
        self._lock = threading.Lock()
        self._gone = weakref.finalize(self, self.drv.event_destroy, self.event)
        self._gone.atexit = False  # at exit the driver may be gone first

    def order(self, stream: int) -> None:
        """Copies queued on ``stream`` from now on run after the fence's point."""
        with self._lock:
            if stream in self._ordered:
                return
            self._ordered.add(stream)
        self.drv.stream_wait_event(stream, self.event)

    def wait(self, deadline: float) -> bool:
        """Wait on the host until the fence's point is reached; False when ``deadline`` came
        first."""
        return wait_event(self.drv, self.event, deadline)


_lock = threading.Lock()
_active: CudaDriver | None = None
_failure: GpuUnavailable | None = None


def driver() -> CudaDriver:
    """The driver in use; loads cuda-python on first call. GpuUnavailable if none is usable."""
    global _active, _failure
    d = _active
    if d is not None:
        return d
    with _lock:
        if _active is None:
            if _failure is not None:
                raise _failure
            try:
                from ._cuda_bindings import BindingsDriver

                _active = BindingsDriver()
            except GpuUnavailable as exc:
                _failure = exc  # the answer does not change within a process
                raise
        return _active


def unavailable_reason() -> str | None:
    """Why this process cannot use a GPU, or None when it can."""
    try:
        driver()
    except GpuUnavailable as exc:
        return exc.message
    return None


def loaded() -> bool:
    """Has a driver been loaded (or installed) in this process? Never loads one."""
    return _active is not None


def install(impl: CudaDriver | None) -> CudaDriver | None:
    """Use ``impl`` from now on (None: load the real driver again on next use); returns the
    previous one. This is the test seam: a fake driver goes in here and nowhere else."""
    global _active, _failure
    with _lock:
        prev, _active, _failure = _active, impl, None
        return prev


def check(call: str, result: Any) -> Any:
    """Unpack a cuda.bindings ``(err, value...)`` tuple, raising GpuError on a failed call."""
    err, *values = result if isinstance(result, tuple) else (result,)
    code = int(err)
    if code != 0:
        raise GpuError(f"{call} failed: {getattr(err, 'name', code)}", call=call, code=code)
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)
