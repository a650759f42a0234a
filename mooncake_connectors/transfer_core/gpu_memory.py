"""GPU memory checks at registration: the driver, not the caller's word, says what a pointer is.

A range registered as ``cuda:N`` must be device memory of device N from end to end (it may span
several allocations: torch's expandable segments map one tensor over many). A range registered as
host memory must not be device memory; that is asked of the driver only once one is loaded in
this process (a process that never touched CUDA cannot hold device pointers worth checking, and a
CPU-only install should not load cuda-python for it).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import ConfigError, GpuError
from ..types import LocationKind, parse_location
from . import cuda_driver
from .cuda_driver import MemoryType


def _device_of(location: str) -> int:
    kind, rest = parse_location(location)
    if kind is not LocationKind.CUDA:
        raise ConfigError(f"{location!r} is not a CUDA location")
    return int(rest)


def check_device_ranges(spans: Sequence[tuple[int, int]], location: str) -> None:
    """Raise ConfigError unless every (addr, length) is device memory of ``location``'s device;
    GpuUnavailable when this process cannot use a GPU at all."""
    device = _device_of(location)
    drv = cuda_driver.driver()
    for addr, length in spans:
        if addr <= 0 or length <= 0:
            continue  # the segment refuses these with its own message
        end, pos = addr + length, addr
        while pos < end:
            info = drv.pointer_info(pos)
            if info.kind is not MemoryType.DEVICE:
                what = "pinned host" if info.kind is MemoryType.HOST else "host (or unknown)"
                raise ConfigError(
                    f"{addr:#x}+{length} was registered as {location} but {pos:#x} is "
                    f"{what} memory to the CUDA driver",
                    location=location,
                )
            if info.device != device:
                raise ConfigError(
                    f"{addr:#x}+{length} was registered as {location} but is memory of "
                    f"cuda:{info.device}",
                    location=location,
                )
            if info.size <= 0 or info.base + info.size <= pos:
                raise ConfigError(f"the CUDA driver reports no allocation at {pos:#x}")
            pos = info.base + info.size


def check_host_ranges(spans: Sequence[tuple[int, int]], location: str) -> None:
    """Raise ConfigError if a range registered as host memory is device memory (only asked
    when a CUDA driver is already loaded in this process)."""
    if not cuda_driver.loaded():
        return
    drv = cuda_driver.driver()
    for addr, length in spans:
        if addr <= 0 or length <= 0:
            continue
        try:
            info = drv.pointer_info(addr)
        except GpuError:  # a driver that cannot say does not block host memory
            continue
        if info.kind is MemoryType.DEVICE:
            raise ConfigError(
                f"{addr:#x}+{length} was registered as {location} but is GPU memory of "
                f"cuda:{info.device}; register it as cuda:{info.device}",
                location=location,
            )
