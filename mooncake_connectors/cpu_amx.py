"""Let this process use Intel AMX tiles before vLLM's CPU attention kernel does (used by the
vLLM connectors; no engine import).

Linux gives a process AMX tile state only after it asks (``arch_prctl(ARCH_REQ_XCOMP_PERM,
XFEATURE_XTILEDATA)``); an AMX instruction before that is SIGILL. vLLM's CPU build picks its AMX
attention kernel whenever the CPU advertises AMX (bf16, block size a multiple of 32) but leaves the
request to oneDNN, which makes it on the first large bf16 matmul. A decode instance whose first
forward is one token over KV that came from a prefill instance (or from the store) reaches the
attention kernel first, and its worker dies with exit code -4. Asking once when the connector
registers the KV cache, before any forward, is what the kernel requires; it changes nothing else.
"""

from __future__ import annotations

import ctypes
import logging
import platform
import sys
from pathlib import Path

log = logging.getLogger(__name__)

_SYS_ARCH_PRCTL = 158  # x86_64
_ARCH_GET_XCOMP_PERM = 0x1022
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def cpu_has_amx(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    try:
        text = cpuinfo.read_text()
    except OSError:
        return False
    return any(
        line.startswith("flags") and "amx_tile" in line.split() for line in text.splitlines()
    )


def amx_permitted() -> bool:
    """Whether this process may use AMX tile data now."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    mask = ctypes.c_uint64(0)
    if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_GET_XCOMP_PERM, ctypes.byref(mask)) != 0:
        return False
    return bool(mask.value & (1 << _XFEATURE_XTILEDATA))


def enable_amx_tiles() -> bool:
    """Ask the kernel for AMX tile state if the CPU has AMX; True when this process may use it.
    Never raises: without the permission vLLM's other kernels still run."""
    if sys.platform != "linux" or platform.machine() != "x86_64" or not cpu_has_amx():
        return False
    if amx_permitted():
        return True
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) != 0:
        err = ctypes.get_errno()
        log.warning(
            "the CPU advertises AMX but the kernel refused AMX tile state (errno %d); vLLM's "
            "AMX attention kernel will fail on this host: use a block size that is not a "
            "multiple of 32 to select its AVX-512 kernel",
            err,
        )
        return False
    log.debug("AMX tile state enabled for this process")
    return True
