"""``doctor``'s RDMA findings: per NIC what the rdma transport would use (preflight.survey, the
transport's own device, GID and MTU choice), the devices it would skip and why, the
locked-memory limit, the GPU registration path; and the findings of ``doctor --peer``.

When pyverbs does not load or lists no device, the kernel's tree (``root``/sys) says why.
"""

from __future__ import annotations

import dataclasses
import resource
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ConfigError
from .doctor import Finding

if TYPE_CHECKING:
    from .transports.rdma.peercheck import PeerResult
    from .transports.rdma.preflight import Survey
    from .transports.rdma.transport import RdmaSettings

_SKIP_FIX = "the rdma transport starts without it"
_GPU_FIX = (
    "load nvidia_peermem (modprobe nvidia_peermem), or use a driver and kernel that export "
    "dma-bufs (open GPU kernel modules, Linux 5.12+); set gpu_mr to match"
)


def settings_for(root: str, st: RdmaSettings | None) -> tuple[RdmaSettings, str]:
    """``st`` (the defaults when None) and the sysfs it reads: ``root``/sys unless ``st``
    names one."""
    from .transports.rdma.transport import RdmaSettings

    st = st if st is not None else RdmaSettings()
    sysfs = st.sysfs if st.sysfs != "/sys" else str(Path(root) / "sys")
    return st, sysfs


def check_rdma(root: str = "/", settings: RdmaSettings | None = None) -> list[Finding]:
    st, sysfs = settings_for(root, settings)
    try:
        from .transports.rdma.preflight import survey

        found = survey(st, sysfs)
    except ConfigError as exc:
        return _memlock_only(st.min_memlock) + _why_none(Path(root), exc) + _peermem(sysfs)
    return _describe(found) + _peermem(sysfs)


def _describe(s: Survey) -> list[Finding]:
    from .transports.rdma.verbs import MEMLOCK_FIX

    out = []
    for n in s.nics:
        near = ", ".join(n.nearest_gpus) or "none known"
        out.append(
            Finding(
                "rdma",
                "ok",
                f"{n.name} port {n.port} {n.state}, {n.link_layer}, GID index {n.gid_index} "
                f"{n.gid_type} {n.gid}, MTU {n.mtu}, NUMA {n.numa}, nearest GPUs {near}",
                data=dataclasses.asdict(n),
            )
        )
    for k in s.skipped:
        out.append(
            Finding(
                "rdma", "warn", f"{k.name} skipped: {k.why}", _SKIP_FIX, data={"skipped": k.name}
            )
        )
    if not s.nics:
        out.append(
            Finding(
                "rdma",
                "fail",
                "no usable RDMA NIC: the rdma transport cannot start",
                "fix a NIC above, or leave rdma out of `transports`",
            )
        )
    limit = "unlimited" if s.memlock < 0 else f"{s.memlock // 1024} KiB"
    memlock: dict[str, object] = {
        "memlock": s.memlock,
        "needed": s.memlock_needed,
        "cap_ipc_lock": s.ipc_lock,
    }
    if s.memlock_problem:
        out.append(Finding("rdma", "fail", s.memlock_problem, MEMLOCK_FIX, data=memlock))
    else:
        lifted = " (CAP_IPC_LOCK: not counted)" if s.ipc_lock and s.memlock >= 0 else ""
        need = f"{s.memlock_needed // 1024} KiB"
        out.append(
            Finding(
                "rdma", "ok", f"locked-memory limit {limit}{lifted}, needs {need}", data=memlock
            )
        )
    if s.gpu_note:
        out.append(Finding("rdma", "info", f"GPU memory registration: {s.gpu_note}"))
    for g in s.gpus:
        reg: dict[str, object] = {"gpu": g.gpu, "gpu_mr": g.path}
        if g.path == "none":
            msg = f"{g.gpu} memory cannot be registered for RDMA: {g.why}"
            out.append(Finding("rdma", "warn", msg, _GPU_FIX, data=reg))
        else:
            msg = f"{g.gpu} memory registers by {g.path} ({g.why})"
            out.append(Finding("rdma", "ok", msg, data=reg))
    return out


def _memlock_only(needed: int) -> list[Finding]:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return []
    return [
        Finding(
            "rdma",
            "warn",
            f"ulimit -l is {soft // 1024} KiB: RDMA cannot pin large buffers",
            "raise the memlock limit (ulimit -l unlimited; docker --ulimit memlock=-1)",
        )
    ]


def _why_none(r: Path, exc: ConfigError) -> list[Finding]:
    """pyverbs gave no device (``exc``): what the kernel's tree says."""
    if not (r / "sys/module/ib_core").exists():
        return [
            Finding(
                "rdma",
                "fail",
                "no kernel RDMA (ib_core is not loaded)",
                "load the RDMA stack (modprobe ib_core and your NIC's driver) or use tcp",
                data={"error": exc.message},
            )
        ]
    ib = r / "sys/class/infiniband"
    names = sorted(p.name for p in ib.iterdir()) if ib.is_dir() else []
    if not names:
        return [Finding("rdma", "fail", "no RDMA device", "attach an RDMA NIC or use tcp")]
    return [
        Finding(
            "rdma",
            "warn",
            f"devices {', '.join(names)} present, but the rdma transport cannot open them",
            exc.message,
        )
    ]


def _peermem(sysfs: str) -> list[Finding]:
    loaded = (Path(sysfs) / "module/nvidia_peermem").exists()
    return [
        Finding(
            "rdma",
            "ok" if loaded else "info",
            "GPUDirect RDMA: "
            + ("nvidia_peermem loaded" if loaded else "nvidia_peermem not loaded"),
            "" if loaded else "modprobe nvidia_peermem, or use dma-buf (kernel 5.12+)",
        )
    ]


def peer_finding(r: PeerResult) -> Finding:
    agreed = f"MTU {r.mtu}" + (
        f" (the smaller of {r.local_mtu} here and {r.peer_mtu} there)"
        if r.local_mtu != r.peer_mtu
        else ""
    )
    return Finding(
        "rdma-peer",
        "ok",
        f"{r.local_nic} GID {r.local_gid_index} {r.local_gid_type} {r.local_gid} <-> {r.peer} "
        f"{r.peer_nic} GID {r.peer_gid_index} {r.peer_gid_type} {r.peer_gid}: {agreed}, "
        f"{r.bytes_verified} bytes verified (READ, WRITE, READ back), round trip "
        f"{r.rtt_us_min:.1f} us min, {r.rtt_us_median:.1f} us median",
        data=dataclasses.asdict(r),
    )


def check_peer(
    target: str, settings: RdmaSettings | None, size: int, timeout: float
) -> list[Finding]:
    """``doctor --peer HOST:PORT``: one finding, failing with the reason when the loop does."""
    from ..errors import MooncakeConnectorsError
    from .transports.rdma.peercheck import check_peer as loop

    st, _ = settings_for("/", settings)
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        return [Finding("rdma-peer", "fail", f"--peer {target!r} is not HOST:PORT", "")]
    try:
        return [peer_finding(loop(host.strip("[]"), int(port), st, size, timeout))]
    except ConfigError as exc:
        return [Finding("rdma-peer", "fail", exc.message, "see the rdma findings above")]
    except MooncakeConnectorsError as exc:
        return [Finding("rdma-peer", "fail", exc.message, "")]
