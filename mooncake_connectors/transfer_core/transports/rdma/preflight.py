"""What ``doctor`` says of the RDMA NICs, from the code the rdma transport runs.

``open_nics`` opens the devices as the transport's start does (verbs.py's ``Verbs.devices`` and
``Verbs.open``, with the transport's settings): the GID index, the active MTU and the port each
NIC gets are the ones ``Nic`` chose, and a device ``Nic`` refuses (port not ACTIVE, a link layer
the transport cannot drive, an empty GID table) is skipped with its error. Nothing here picks a
GID, an MTU or a device a second time. ``survey`` adds what the rest of the path depends on: the
locked-memory limit (``Verbs.check_memlock``), the NIC/GPU distances (``Topology.preferred``,
what the transport's rail choice uses) and how GPU memory would be registered (mrs.py's order:
dma-buf, else a plain MR that needs nvidia_peermem).
"""

from __future__ import annotations

import contextlib
import os
import resource
from dataclasses import dataclass, field

from ....errors import ConfigError, GpuError
from .settings import RdmaSettings
from .topology import NAMES, Topology, distance
from .verbs import (
    GID_TYPE_ROCE_V2,
    LINK_LAYER_ETHERNET,
    LINK_LAYER_INFINIBAND,
    Nic,
    Verbs,
    has_ipc_lock,
)


def mtu_bytes(mtu: int) -> int:
    """An IBV_MTU_* value (1 = 256 .. 5 = 4096) in bytes; 0 for an unknown value."""
    return 128 << mtu if 1 <= mtu <= 5 else 0


def link_name(link_layer: int) -> str:
    return {LINK_LAYER_INFINIBAND: "InfiniBand", LINK_LAYER_ETHERNET: "Ethernet (RoCE)"}.get(
        link_layer, f"link layer {link_layer}"
    )


def gid_type_name(nic: Nic) -> str:
    """RoCE v1 / RoCE v2 of the GID ``nic`` uses; "IB" on InfiniBand."""
    if nic.link_layer == LINK_LAYER_INFINIBAND:
        return "IB"
    try:
        kind = int(nic.ctx.query_gid_type(nic.port, nic.gid_index))
    except nic.lib.PyverbsError:
        return "?"
    return "RoCE v2" if kind == GID_TYPE_ROCE_V2 else "RoCE v1"


@dataclass(frozen=True)
class NicReport:
    name: str
    port: int
    state: str
    link_layer: str
    gid_index: int
    gid_type: str
    gid: str
    lid: int
    mtu: int  # bytes
    numa: int
    nearest_gpus: list[str] = field(default_factory=list)  # "cuda:0 (PIX)"


@dataclass(frozen=True)
class Skipped:
    name: str
    why: str


@dataclass(frozen=True)
class GpuPath:
    gpu: str  # "cuda:N"
    path: str  # "dma-buf", "peermem" or "none"
    why: str


@dataclass
class Survey:
    nics: list[NicReport]
    skipped: list[Skipped]
    memlock: int  # bytes, -1 for unlimited
    memlock_needed: int
    memlock_problem: str | None  # Verbs.check_memlock's error, None when it passes
    ipc_lock: bool
    gpus: list[GpuPath]
    gpu_note: str  # why no GPU is listed, or ""


def open_nics(verbs: Verbs, st: RdmaSettings) -> tuple[list[Nic], list[Skipped]]:
    """The NICs the transport would open with ``st``, and the ones it would skip (and why).
    ConfigError when none is listed or ``st.nics`` names a device not here."""
    names = verbs.devices()
    if st.nics:
        unknown = sorted(set(st.nics) - set(names))
        if unknown:
            raise ConfigError(f"rdma nics {unknown} not found; this host has {names}")
        names = list(st.nics)
    opened: list[Nic] = []
    skipped: list[Skipped] = []
    for name in names:
        try:
            opened.append(verbs.open(name, st.port, st.gid_index))
        except ConfigError as exc:
            skipped.append(Skipped(name, exc.message))
    return opened, skipped


def describe(nic: Nic, topo: Topology, usable: list[str]) -> NicReport:
    dev = topo.nic(nic.name)
    near = []
    for i, gpu in enumerate(topo.gpus):
        if dev is not None and nic.name in topo.preferred(f"cuda:{i}", usable):
            near.append(f"cuda:{i} ({NAMES[distance(gpu, dev)]})")
    return NicReport(
        nic.name,
        nic.port,
        "ACTIVE",  # Nic refuses a port in any other state
        link_name(nic.link_layer),
        nic.gid_index,
        gid_type_name(nic),
        nic.gid,
        nic.lid,
        mtu_bytes(nic.mtu),
        dev.numa if dev is not None else -1,
        near,
    )


def gpu_paths(gpu_mr: str, dmabuf_mr: bool, peermem: bool) -> tuple[list[GpuPath], str]:
    """How mrs.Registry would register each GPU's memory with ``gpu_mr`` ("auto", "dmabuf",
    "peermem"): dma-buf where the driver exports it and pyverbs has DmaBufMR, else a plain MR on
    the device address, which only nvidia_peermem makes work."""
    from ... import cuda_driver

    reason = cuda_driver.unavailable_reason()
    if reason is not None:
        return [], f"no usable GPU ({reason}): host memory only"
    try:
        drv = cuda_driver.driver()
        count = drv.device_count()
        exports = [drv.supports_dmabuf(d) for d in range(count)]
    except GpuError as exc:
        return [], f"the CUDA driver failed ({exc}): host memory only"
    out = []
    for d, export in enumerate(exports):
        dmabuf = dmabuf_mr and export
        why_not = (
            "the driver exports no dma-buf for it"
            if not export
            else "this pyverbs has no DmaBufMR"
            if not dmabuf_mr
            else ""
        )
        if gpu_mr != "peermem" and dmabuf:
            out.append(GpuPath(f"cuda:{d}", "dma-buf", "the driver exports dma-bufs"))
        elif gpu_mr != "dmabuf" and peermem:
            out.append(
                GpuPath(f"cuda:{d}", "peermem", f"nvidia_peermem loaded; {why_not or 'gpu_mr'}")
            )
        else:
            out.append(GpuPath(f"cuda:{d}", "none", why_not or "nvidia_peermem is not loaded"))
    return out, ""


def survey(st: RdmaSettings, sysfs: str | None = None) -> Survey:
    """Everything ``doctor`` reports of the RDMA path with settings ``st``; ConfigError when
    pyverbs does not load or lists no device (the caller explains it from sysfs)."""
    verbs = Verbs(st.verbs)
    opened, skipped = open_nics(verbs, st)
    root = sysfs or st.sysfs
    try:
        topo = Topology.read(root)
        usable = [n.name for n in opened]
        nics = [describe(n, topo, usable) for n in opened]
        dmabuf_mr = verbs.lib.DmaBufMR is not None
    finally:
        for n in opened:
            n.close()
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    problem = None
    try:
        verbs.check_memlock(st.min_memlock)
    except ConfigError as exc:
        problem = exc.message
    peermem = os.path.exists(os.path.join(root, "module", "nvidia_peermem"))
    gpus, note = gpu_paths(st.gpu_mr, dmabuf_mr, peermem)
    return Survey(
        nics,
        skipped,
        -1 if soft == resource.RLIM_INFINITY else soft,
        st.min_memlock,
        problem,
        has_ipc_lock(),
        gpus,
        note,
    )


def close_all(nics: list[Nic]) -> None:
    for n in nics:
        with contextlib.suppress(Exception):
            n.close()


__all__ = [
    "GpuPath",
    "NicReport",
    "Skipped",
    "Survey",
    "close_all",
    "describe",
    "gpu_paths",
    "link_name",
    "mtu_bytes",
    "open_nics",
    "survey",
]
