"""Device memory for tests, made through the real cuda-python (over the fake libcuda), the way an
application (torch) makes it: cudaMalloc-style allocations and VMM (expandable-segment style)
mappings. Each call pushes the device's primary context and pops it, leaving the caller's
current context as it was."""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator
from typing import Any

from cuda.bindings import driver as cu

GRANULARITY = 2 << 20


def ok(res: Any) -> Any:
    err, *rest = res if isinstance(res, tuple) else (res,)
    if int(err) != 0:
        raise RuntimeError(f"fake driver call failed: {err!r}")
    return rest[0] if len(rest) == 1 else tuple(rest) or None


def init() -> None:
    ok(cu.cuInit(0))


@contextlib.contextmanager
def on(device: int) -> Iterator[None]:
    init()  # idempotent, as in the real driver
    ctx = ok(cu.cuDevicePrimaryCtxRetain(ok(cu.cuDeviceGet(device))))
    ok(cu.cuCtxPushCurrent(ctx))
    try:
        yield
    finally:
        ok(cu.cuCtxPopCurrent())


def alloc(device: int, size: int) -> int:
    with on(device):
        return int(ok(cu.cuMemAlloc(size)))


def vmm_alloc(device: int, chunks: int, spare: int = 2) -> tuple[int, list[int]]:
    """A reservation of ``chunks + spare`` granules with ``chunks`` separately created chunks
    mapped from its start (torch's expandable segments grow this way). Returns the reservation
    base and each chunk's address."""
    init()
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.requestedHandleTypes = (
        cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    )
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    base = int(ok(cu.cuMemAddressReserve((chunks + spare) * GRANULARITY, 0, 0, 0)))
    access = cu.CUmemAccessDesc()
    access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    access.location.id = device
    access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    out = []
    for i in range(chunks):
        at = base + i * GRANULARITY
        handle = ok(cu.cuMemCreate(GRANULARITY, prop, 0))
        ok(cu.cuMemMap(at, GRANULARITY, 0, handle, 0))
        ok(cu.cuMemRelease(handle))  # the mapping holds it
        ok(cu.cuMemSetAccess(at, GRANULARITY, [access], 1))
        out.append(at)
    return base, out


def fill(addr: int, data: bytes) -> None:
    """Fake device memory is host memory: write it directly."""
    ctypes.memmove(addr, data, len(data))


def current_ctx() -> int:
    return int(ok(cu.cuCtxGetCurrent()))
