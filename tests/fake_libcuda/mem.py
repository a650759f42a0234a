"""Device memory for tests, made through the real cuda-python (over the fake libcuda) the way an
application makes it: the GPU check script's own ``Dev`` (scripts/gpu/gpucheck/devmem.py), one per
device, which pushes the device's primary context around each call and pops it after, leaving
the caller's current context as it was."""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "gpu"))

from gpucheck.devmem import Dev

GRANULARITY = 2 << 20  # the fake's (cuMemGetAllocationGranularity)
_devs: dict[int, Dev] = {}
ok = Dev.ok


def dev(device: int) -> Dev:
    if device not in _devs:
        _devs[device] = Dev(device, make_current=False)
    return _devs[device]


def init() -> None:
    dev(0)


def alloc(device: int, size: int) -> int:
    return dev(device).alloc(size)


def vmm_alloc(device: int, total: int) -> list[int]:
    """Chunks for ``total`` bytes and one more, each created on its own and mapped into one
    reservation twice as large (torch's expandable segments grow this way)."""
    return dev(device).vmm_chunks(total)[1]


def fill(addr: int, data: bytes) -> None:
    """Fake device memory is host memory: write it directly."""
    ctypes.memmove(addr, data, len(data))
