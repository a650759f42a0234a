"""``mooncake-connectors doctor``: what this host can use for transfers, and why not.

Each check returns findings; a finding is one line: its area, a verdict (ok, warn, fail, info),
what was found and, unless it is ok, the fix. Nothing here changes the host, and every probe is
bounded (sockets by a timeout, everything else by reading files). ``root`` lets tests point the
sysfs/procfs reads at a prepared tree.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from ..errors import GpuError
from . import cuda_driver
from .transport import TRANSPORTS

if TYPE_CHECKING:
    from .transports.rdma.transport import RdmaSettings

GIB = 1 << 30
_PROBE_TIMEOUT = 2.0


@dataclasses.dataclass(frozen=True)
class Finding:
    area: str
    verdict: str  # ok | warn | fail | info
    message: str
    fix: str = ""
    data: dict[str, object] = dataclasses.field(default_factory=dict)  # for --json

    def line(self) -> str:
        fix = f"  -> {self.fix}" if self.fix else ""
        return f"[{self.verdict:4}] {self.area}: {self.message}{fix}"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_gpus() -> list[Finding]:
    reason = cuda_driver.unavailable_reason()
    if reason is not None:
        fix = (
            "pip install 'mooncake-connectors[cuda]'"
            if "cuda-python" in reason
            else "install the NVIDIA driver, or run where a GPU is visible (nvidia-smi)"
        )
        return [Finding("gpu", "fail", f"no usable GPU: {reason}", fix)]
    try:
        return _describe_gpus(cuda_driver.driver())
    except GpuError as exc:
        return [Finding("gpu", "fail", f"the CUDA driver failed: {exc}", "check nvidia-smi")]


def _describe_gpus(drv: cuda_driver.CudaDriver) -> list[Finding]:
    v = drv.driver_version()
    n = drv.device_count()
    bindings = _version("cuda-bindings") or _version("cuda-python") or "?"
    out = [
        Finding(
            "gpu",
            "ok" if n else "fail",
            f"{n} GPU(s); driver supports CUDA {v // 1000}.{v % 1000 // 10}; "
            f"cuda-bindings {bindings}",
            "" if n else "check CUDA_VISIBLE_DEVICES",
        )
    ]
    for d in range(n):
        # What the driver says of each device; cudaMalloc memory's legacy IPC has no device
        # attribute to ask (cuda_ipc finds out at the first export), so nothing is claimed.
        vmm, fd, dmabuf = drv.supports_vmm(d), drv.supports_fd_export(d), drv.supports_dmabuf(d)
        shared = vmm and fd
        out.append(
            Finding(
                "gpu",
                "ok" if shared else "warn",
                f"cuda:{d} {drv.device_name(d)}: VMM {'yes' if vmm else 'no'}, "
                f"VMM fd export {'yes' if fd else 'no'}, dma-buf {'yes' if dmabuf else 'no'}",
                "" if shared else "expandable-segment allocations cannot be shared by cuda_ipc",
            )
        )
    if n > 1:
        rows = []
        for d in range(n):
            cells = "".join(
                "-" if p == d else ("P" if drv.can_access_peer(d, p) else ".") for p in range(n)
            )
            rows.append(f"{d}:{cells}")
        full = all(drv.can_access_peer(d, p) for d in range(n) for p in range(n) if p != d)
        out.append(
            Finding(
                "gpu",
                "ok" if full else "warn",
                f"peer access (P = direct, . = through host): {' '.join(rows)}",
                ""
                if full
                else "pairs without peer access copy through host memory: slower cuda_ipc",
            )
        )
    return out


_YAMA = "proc/sys/kernel/yama/ptrace_scope"
_TRIAL = """
import ctypes, errno, os, sys
libc = ctypes.CDLL(None, use_errno=True)
try:
    pidfd = os.pidfd_open(int(sys.argv[1]))
except OSError as exc:
    print(errno.errorcode.get(exc.errno, exc.errno)); sys.exit()
got = libc.syscall(438, pidfd, int(sys.argv[2]), 0)  # pidfd_getfd
print("ok" if got >= 0 else errno.errorcode.get(ctypes.get_errno(), "?"))
"""


def pidfd_trial(fd: int | None = None) -> str | None:
    """A child process takes descriptor ``fd`` (default: a pipe opened for it) of this one
    with pidfd_getfd, as cuda_ipc's importer takes a VMM export's fd from its owner, which is
    not its descendant (two vLLM workers are siblings: Yama's scope 1 refuses them). None when
    it could, else why not (an errno name)."""
    pipe = os.pipe() if fd is None else ()
    try:
        target = pipe[0] if pipe else fd
        proc = subprocess.run(
            [sys.executable, "-c", _TRIAL, str(os.getpid()), str(target)],
            capture_output=True, text=True, timeout=_PROBE_TIMEOUT * 5,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"the trial did not run: {exc}"
    finally:
        for end in pipe:
            os.close(end)
    answer = proc.stdout.strip() or f"the trial failed: {proc.stderr.strip()[-200:]}"
    return None if answer == "ok" else answer


def check_pidfd(root: str = "/", trial: Callable[[], str | None] = pidfd_trial) -> list[Finding]:
    """May cuda_ipc take VMM (expandable-segment) exports' fds from other processes?"""
    try:
        scope: int | None = int((Path(root) / _YAMA).read_text().strip())
    except (OSError, ValueError):
        scope = None  # no Yama: only the usual same-user rule (and a container's seccomp)
    yama = "no Yama LSM" if scope is None else f"Yama ptrace_scope={scope}"
    refused = trial()
    if refused is None:
        return [
            Finding(
                "gpu",
                "ok",
                f"pidfd_getfd of another process permitted ({yama}): cuda_ipc opens VMM "
                "(expandable-segment) memory of other processes directly",
            )
        ]
    if scope == 3:
        fix = "ptrace_scope 3 cannot be lowered until reboot; set kernel.yama.ptrace_scope=0 then"
    elif scope is not None and scope >= 1:
        fix = "sysctl -w kernel.yama.ptrace_scope=0 (or give the processes CAP_SYS_PTRACE)"
    else:
        fix = "in a container: docker run --cap-add SYS_PTRACE (default seccomp refuses it)"
    return [
        Finding(
            "gpu",
            "warn",
            f"pidfd_getfd of another process refused ({refused}; {yama}): cuda_ipc cannot "
            "open VMM (expandable-segment) memory of other processes, so those transfers "
            "fall back to tcp staging (slower); cudaMalloc memory (legacy CUDA IPC) is "
            "unaffected",
            fix,
        )
    ]


def check_rdma(root: str = "/", settings: RdmaSettings | None = None) -> list[Finding]:
    """Per RDMA NIC what the rdma transport would use, and why not (doctor_rdma.py)."""
    from . import doctor_rdma

    return doctor_rdma.check_rdma(root, settings)


def rdma_topology(root: str = "/", settings: RdmaSettings | None = None) -> list[Finding]:
    """The RDMA NICs' ports and the NIC/GPU/NUMA distance matrix the rdma transport uses to
    pick a region's nearest NICs, one finding per line."""
    from .doctor_rdma import settings_for
    from .transports.rdma.topology import doctor_report

    _, sysfs = settings_for(root, settings)
    return [Finding("topology", "info", line) for line in doctor_report(sysfs)]


def check_shm(path: str = "/dev/shm") -> list[Finding]:
    try:
        st = os.statvfs(path)
    except OSError as exc:
        return [Finding("shm", "fail", f"{path}: {exc}", "mount a tmpfs on /dev/shm")]
    total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    small = total < GIB
    return [
        Finding(
            "shm",
            "warn" if small else "ok",
            f"{path} {total / GIB:.1f} GiB, {free / GIB:.1f} GiB free",
            "enlarge it (docker --shm-size=16g)" if small else "",
        )
    ]


def check_numa(root: str = "/") -> list[Finding]:
    nodes = Path(root) / "sys/devices/system/node"
    found = sorted(nodes.glob("node[0-9]*")) if nodes.is_dir() else []
    if not found:
        return [Finding("numa", "info", "no NUMA information (one node assumed)")]
    parts = []
    for n in found:
        try:
            cpus = (n / "cpulist").read_text().strip()
        except OSError:
            cpus = "?"
        parts.append(f"{n.name} cpus {cpus}")
    note = "pin each engine near its GPU and NIC" if len(found) > 1 else ""
    return [Finding("numa", "info", f"{len(found)} node(s): {'; '.join(parts)}", note)]


def _hostport(target: str, default_port: int) -> tuple[str, int]:
    u = urlsplit(target if "://" in target else f"tcp://{target}")
    return u.hostname or "127.0.0.1", u.port or default_port


def check_reachable(area: str, target: str, default_port: int) -> Finding:
    host, port = _hostport(target.split(",")[0], default_port)
    try:
        with socket.create_connection((host, port), timeout=_PROBE_TIMEOUT):
            pass
    except OSError as exc:
        return Finding(
            area, "fail", f"{host}:{port} unreachable: {exc}", "start it or fix the address"
        )
    return Finding(area, "ok", f"{host}:{port} accepts connections")


def check_transports() -> list[Finding]:
    return [Finding("transports", "info", f"installed: {', '.join(TRANSPORTS.names())}")]


def run(
    *,
    metadata: str | None = None,
    master: str | None = None,
    root: str = "/",
    rdma: RdmaSettings | None = None,
) -> list[Finding]:
    """Every check; ``metadata`` (an etcd:// or http:// URL) and ``master`` (HOST:PORT) are
    probed only when given; ``rdma``: the rdma transport's settings (its defaults if None)."""
    findings: list[Finding] = []
    findings += check_transports()
    gpus = check_gpus()
    findings += gpus
    if not any(f.verdict == "fail" for f in gpus):
        findings += check_pidfd(root)
    findings += check_rdma(root, rdma)
    findings += rdma_topology(root, rdma)
    findings += check_shm()
    findings += check_numa(root)
    if metadata and "://" in metadata:
        default = 2379 if metadata.startswith("etcd") else 80
        findings.append(check_reachable("metadata", metadata, default))
    if master:
        findings.append(check_reachable("master", master, 50051))
    return findings


def as_json(findings: Iterable[Finding]) -> list[dict[str, str]]:
    return [dataclasses.asdict(f) for f in findings]
