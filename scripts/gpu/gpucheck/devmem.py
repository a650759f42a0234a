"""Device memory for the GPU check, made through the driver (cuda.bindings) so that it works on a
GPU and on the FAKE libcuda alike: plain and VMM allocations, guard bands, and the application's
own asynchronous GPU work (what a kernel of torch's does) on the legacy default stream."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
from collections.abc import Iterator
from typing import Any

import numpy as np

MIB = 1 << 20
GUARD = 4096
GUARD_BYTE = 0xA5


# -- device memory through the driver (works on a GPU and on the fake library alike) --------
class Dev:
    """One device's primary context, through cuda.bindings. ``make_current``: make it the
    thread's current context, as torch.cuda.set_device leaves it; every call here pushes the
    context and pops it after, so it also works from a thread with another one current."""

    def __init__(self, device: int = 0, make_current: bool = True) -> None:
        from cuda.bindings import driver as cu

        self.cu, self.device = cu, device
        self.ok(cu.cuInit(0))
        self.ctx = self.ok(cu.cuDevicePrimaryCtxRetain(self.ok(cu.cuDeviceGet(device))))
        if make_current:
            self.ok(cu.cuCtxSetCurrent(self.ctx))

    @staticmethod
    def ok(res: Any) -> Any:
        err, *rest = res if isinstance(res, tuple) else (res,)
        if int(err) != 0:
            raise RuntimeError(f"driver call failed: {getattr(err, 'name', err)}")
        return rest[0] if len(rest) == 1 else (tuple(rest) or None)

    @contextlib.contextmanager
    def on(self) -> Iterator[None]:
        self.ok(self.cu.cuCtxPushCurrent(self.ctx))
        try:
            yield
        finally:
            self.ok(self.cu.cuCtxPopCurrent())

    def alloc(self, n: int) -> int:
        with self.on():
            return int(self.ok(self.cu.cuMemAlloc(n)))

    def vmm_chunks(self, total: int) -> tuple[int, list[int]]:
        """Enough separately created chunks for ``total`` bytes and one more, mapped at the
        start of a reservation twice as large (torch's expandable segments grow this way);
        returns the granularity and each chunk's address."""
        with self.on():
            return self._vmm_chunks(total)

    def _vmm_chunks(self, total: int) -> tuple[int, list[int]]:
        cu = self.cu
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.requestedHandleTypes = (
            cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        )
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.device
        opt = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        gran = int(self.ok(cu.cuMemGetAllocationGranularity(prop, opt)))
        chunks = -(-total // gran) + 1
        base = int(self.ok(cu.cuMemAddressReserve(2 * chunks * gran, 0, 0, 0)))
        access = cu.CUmemAccessDesc()
        access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = self.device
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        out = []
        for i in range(chunks):
            handle = self.ok(cu.cuMemCreate(gran, prop, 0))
            self.ok(cu.cuMemMap(base + i * gran, gran, 0, handle, 0))
            self.ok(cu.cuMemRelease(handle))  # the mapping holds it
            self.ok(cu.cuMemSetAccess(base + i * gran, gran, [access], 1))
            out.append(base + i * gran)
        return gran, out

    def free(self, addr: int) -> None:
        with self.on():
            self.ok(self.cu.cuMemFree(addr))

    def put(self, addr: int, data: np.ndarray) -> None:
        with self.on():
            self.ok(self.cu.cuMemcpyHtoD(addr, data.ctypes.data, data.nbytes))

    def get(self, addr: int, n: int) -> np.ndarray:
        out = np.empty(n, dtype=np.uint8)
        with self.on():
            self.ok(self.cu.cuMemcpyDtoH(out.ctypes.data, addr, n))
        return out

    # -- the application's own GPU work, queued on its stream (the legacy default stream, which
    # torch's default current stream is), finishing whenever the GPU gets to it
    def host_alloc(self, n: int) -> int:
        with self.on():
            return int(self.ok(self.cu.cuMemHostAlloc(n, 1)))  # PORTABLE

    def host_free(self, addr: int) -> None:
        with self.on():
            self.ok(self.cu.cuMemFreeHost(addr))

    def produce(self, addr: int, host: int, n: int, busy: tuple[int, int, int] = (0, 0, 0)) -> None:
        """Queue, on the legacy stream: ``busy`` = (scratch address, bytes, times) memsets that
        keep the GPU busy, then the upload of ``n`` bytes of pinned ``host`` to ``addr``. Returns
        at once: the bytes land later."""
        stream = self.cu.CUstream(0)
        scratch, size, times = busy
        with self.on():
            for i in range(times):
                self.ok(self.cu.cuMemsetD8Async(scratch, i & 0xFF, size, stream))
            self.ok(self.cu.cuMemcpyHtoDAsync(addr, host, n, stream))

    def sync(self) -> None:
        with self.on():
            self.ok(self.cu.cuCtxSynchronize())


def pattern(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)


def digest(a: np.ndarray) -> str:
    return hashlib.sha256(memoryview(a)).hexdigest()


class Guarded:
    """``n`` bytes of device ("gpu", "vmm") or host ("host": memfd buffer of the engine) memory
    with GUARD bytes of GUARD_BYTE on each side; ``addr`` is the first byte of the target."""

    def __init__(self, dev: Dev, engine: Any, kind: str, n: int, seed: int) -> None:
        self.dev, self.kind, self.n = dev, kind, n
        total = n + 2 * GUARD
        self.buf = None
        if kind == "host":
            self.buf = engine.allocate_buffer(total)
            base = self.buf.addr
        elif kind == "vmm":  # the target straddles the boundary of the first two chunks
            gran, chunks = dev.vmm_chunks(total)
            base = max(chunks[0], chunks[0] + gran - GUARD - n // 2)
        else:
            base = dev.alloc(total)
        self.base, self.addr = base, base + GUARD
        self._put(base, np.full(total, GUARD_BYTE, dtype=np.uint8))
        self._put(self.addr, pattern(seed, n))
        if self.buf is None:
            engine.register_raw(base, total, location="cuda:0")

    def _put(self, addr: int, data: np.ndarray) -> None:
        if self.buf is not None:
            ctypes.memmove(addr, data.ctypes.data, data.nbytes)
        else:
            self.dev.put(addr, data)

    def _get(self, addr: int, n: int) -> np.ndarray:
        if self.buf is not None:
            return np.frombuffer(ctypes.string_at(addr, n), dtype=np.uint8)
        return self.dev.get(addr, n)

    def sha(self, offset: int = 0, n: int | None = None) -> str:
        return digest(self._get(self.addr + offset, self.n - offset if n is None else n))

    def refill(self, seed: int) -> str:
        data = pattern(seed, self.n)
        self._put(self.addr, data)
        return digest(data)

    def free(self, engine: Any) -> None:
        if self.buf is not None:
            engine.free_buffer(self.buf.addr)
            return
        engine.unregister(self.base)
        if self.kind == "gpu":
            self.dev.free(self.base)  # VMM chunks stay mapped: a few, small, until exit

    def guards_ok(self) -> bool:
        lo, hi = self._get(self.base, GUARD), self._get(self.addr + self.n, GUARD)
        return bool((lo == GUARD_BYTE).all() and (hi == GUARD_BYTE).all())


def start_engine(metadata: str, transports: tuple[str, ...]) -> Any:
    from mooncake_connectors.config import EngineConfig
    from mooncake_connectors.transfer_core import TransferEngine

    cfg = EngineConfig(metadata=metadata, transports=transports, timeout=120)
    return TransferEngine(cfg).start()
