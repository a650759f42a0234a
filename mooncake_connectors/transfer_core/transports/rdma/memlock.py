"""The locked-memory limit: every MR pins its pages, which the kernel counts against
RLIMIT_MEMLOCK unless the process holds CAP_IPC_LOCK."""

from __future__ import annotations

import resource

from ....errors import ConfigError

MEMLOCK_FIX = (
    "raise the locked-memory limit: `ulimit -l unlimited` in the shell, "
    "LimitMEMLOCK=infinity for a systemd unit, `--ulimit memlock=-1` for docker"
)
_CAP_IPC_LOCK = 14


def has_ipc_lock() -> bool:
    """Does this process hold CAP_IPC_LOCK (which lifts RLIMIT_MEMLOCK for pinned memory)?"""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_IPC_LOCK & 1)
    except (OSError, ValueError):
        pass
    return False


def check_memlock(minimum: int) -> None:
    """ConfigError when the locked-memory limit is below ``minimum`` bytes: every MR pins
    its pages, and a low limit makes registration fail later, region by region."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if has_ipc_lock():
        return  # the kernel does not count pinned pages against the limit then
    if soft != resource.RLIM_INFINITY and soft < minimum:
        raise ConfigError(
            f"locked-memory limit (ulimit -l) is {soft // 1024} KiB, below the "
            f"{minimum // 1024} KiB the rdma transport needs: {MEMLOCK_FIX}"
        )
