"""NIC, GPU and NUMA affinity read from sysfs, as a matrix of PCIe distances.

A region's preferred rails are the NICs nearest its memory: for ``cuda:N`` the NICs closest to
GPU N on the PCIe tree, for ``cpu:N`` the NICs on NUMA node N. Distances, nearest first (the
classes ``nvidia-smi topo -m`` prints): PIX (one PCIe switch between them), PXB (several
switches, one host bridge), PHB (through the host bridge), NODE (another host bridge of the same
NUMA node), SYS (across NUMA nodes). Everything is read from a sysfs root given by the caller
(``/sys`` by default), so tests build a tree of their own.
"""

from __future__ import annotations

import collections
import ctypes
import mmap
import os
import re
from dataclasses import dataclass, field

from ....errors import GpuError, GpuUnavailable
from ....types import LocationKind, parse_location

PIX, PXB, PHB, NODE, SYS = 1, 2, 3, 4, 5
NAMES = {0: "X", PIX: "PIX", PXB: "PXB", PHB: "PHB", NODE: "NODE", SYS: "SYS"}
_PCI_ADDR = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_NVIDIA = "0x10de"


# move_pages(2) by syscall number: glibc has no wrapper (libnuma's is not always installed)
_MOVE_PAGES = {"x86_64": 279, "aarch64": 239, "ppc64le": 301, "s390x": 310}.get(os.uname().machine)
_SAMPLES = 16


def page_node(addr: int, length: int) -> int:
    """The NUMA node most of the pages of ``[addr, addr + length)`` are on, asked of the kernel
    with move_pages (nodes NULL: it reports, moves nothing), sampling up to 16 pages; -1 when it
    cannot say (no NUMA, pages not faulted in yet, an architecture not known here). Host memory
    is where first touch put it, whatever location it was registered with (``cpu:0`` unless
    said), so this, not the location, picks the NICs nearest it."""
    if _MOVE_PAGES is None or length <= 0:
        return -1
    page = mmap.PAGESIZE
    first, last = addr // page, (addr + length - 1) // page
    step = max(1, (last - first + 1) // _SAMPLES)
    pages = [p * page for p in range(first, last + 1, step)][:_SAMPLES]
    arr = (ctypes.c_void_p * len(pages))(*pages)
    status = (ctypes.c_int * len(pages))(*([-1] * len(pages)))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(_MOVE_PAGES, 0, len(pages), arr, None, status, 0) != 0:
        return -1
    nodes = collections.Counter(n for n in status if n >= 0)  # negative: -errno for that page
    return nodes.most_common(1)[0][0] if nodes else -1


@dataclass(frozen=True)
class Device:
    name: str
    host_bridge: str  # the pciDDDD:BB component of the sysfs path ("" when unknown)
    chain: tuple[str, ...]  # PCI addresses from the root port down to the device
    numa: int  # -1 when the platform does not say


def _read(path: str, default: str = "") -> str:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return default


def _device(name: str, path: str) -> Device:
    real = os.path.realpath(path)
    parts = real.split(os.sep)
    bridge = next((p for p in parts if p.startswith("pci")), "")
    chain = tuple(p for p in parts if _PCI_ADDR.match(p))
    numa = _read(os.path.join(real, "numa_node"), "-1")
    return Device(name, bridge, chain, int(numa) if numa.lstrip("-").isdigit() else -1)


def distance(a: Device, b: Device) -> int:
    if a.chain and a.chain == b.chain:
        return 0
    if a.host_bridge and a.host_bridge == b.host_bridge:
        common = 0
        for x, y in zip(a.chain, b.chain, strict=False):
            if x != y:
                break
            common += 1
        if common == 0:
            return PHB
        hops = len(a.chain) + len(b.chain) - 2 * common
        return PIX if hops <= 2 else PXB
    if a.numa >= 0 and a.numa == b.numa:
        return NODE
    return SYS


def cuda_bus_id(ordinal: int) -> str | None:
    """The PCI address of CUDA device ``ordinal`` of this process, from the driver (our CUDA
    seam); "" when the driver cannot say, None when no driver is loaded here. Never loads one:
    a process with GPU regions has loaded it to register them."""
    from ... import cuda_driver

    if not cuda_driver.loaded():
        return None
    try:
        return cuda_driver.driver().pci_bus_id(ordinal)
    except (GpuError, GpuUnavailable):
        return ""


@dataclass
class Topology:
    nics: list[Device] = field(default_factory=list)
    gpus: list[Device] = field(default_factory=list)  # in PCI-bus order (the fallback guess)
    root: str = ""  # the sysfs root read, where a GPU's PCI address is looked up
    _by_ordinal: dict[int, Device | None] = field(default_factory=dict, repr=False)

    def gpu(self, ordinal: int) -> Device | None:
        """CUDA device ``ordinal``'s place in the tree: by the PCI address the driver gives
        (right whatever CUDA_VISIBLE_DEVICES, by number or UUID, and CUDA_DEVICE_ORDER say),
        else the ``ordinal``-th NVIDIA function in bus order (what CUDA numbers with
        CUDA_DEVICE_ORDER=PCI_BUS_ID and all GPUs visible)."""
        if ordinal in self._by_ordinal:
            return self._by_ordinal[ordinal]
        bus = cuda_bus_id(ordinal)
        path = os.path.join(self.root, "bus", "pci", "devices", bus or "")
        if bus and self.root and _PCI_ADDR.match(bus) and os.path.exists(path):
            dev: Device | None = _device(bus, path)
        else:
            dev = self.gpus[ordinal] if 0 <= ordinal < len(self.gpus) else None
        if bus is not None:  # the driver answered (or cannot): that does not change
            self._by_ordinal[ordinal] = dev
        return dev

    @classmethod
    def read(cls, root: str = "/sys", visible: str | None = None) -> Topology:
        """Read the tree under ``root``. ``visible``: CUDA_VISIBLE_DEVICES (numeric lists are
        honoured; CUDA numbers GPUs in PCI bus order when CUDA_DEVICE_ORDER=PCI_BUS_ID)."""
        ib = os.path.join(root, "class", "infiniband")
        nics = []
        for name in sorted(os.listdir(ib)) if os.path.isdir(ib) else []:
            nics.append(_device(name, os.path.join(ib, name, "device")))
        pci = os.path.join(root, "bus", "pci", "devices")
        gpus = []
        for addr in sorted(os.listdir(pci)) if os.path.isdir(pci) else []:
            d = os.path.join(pci, addr)
            if _read(os.path.join(d, "vendor")) == _NVIDIA and _read(
                os.path.join(d, "class")
            ).startswith(("0x0300", "0x0302")):
                gpus.append(_device(addr, d))
        if visible is None:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible and all(v.strip().isdigit() for v in visible.split(",")):
            picked = [int(v) for v in visible.split(",")]
            gpus = [gpus[i] for i in picked if i < len(gpus)]
        return cls(nics, gpus, root)

    def nic(self, name: str) -> Device | None:
        return next((n for n in self.nics if n.name == name), None)

    def preferred(self, location: str, among: list[str]) -> list[str]:
        """The NICs of ``among`` nearest memory at ``location``; all of them when unknown."""
        try:
            kind, rest = parse_location(location)
        except ValueError:
            return list(among)
        known = [(name, self.nic(name)) for name in among]
        gpu = self.gpu(int(rest)) if kind is LocationKind.CUDA else None
        if gpu is not None:
            dist = {n: distance(gpu, d) for n, d in known if d is not None}
            if dist:
                best = min(dist.values())
                return [n for n in among if dist.get(n) == best]
        if kind is LocationKind.CPU:
            near = [n for n, d in known if d is not None and d.numa == int(rest)]
            if near:
                return near
        return list(among)

    def matrix(self) -> list[list[str]]:
        """Rows GPU0.., then NICs; columns the same, each cell a distance class name."""
        devs = [(f"GPU{i}", g) for i, g in enumerate(self.gpus)] + [(n.name, n) for n in self.nics]
        head = ["", *[label for label, _ in devs], "NUMA"]
        rows = [head]
        for label, d in devs:
            rows.append([label, *[NAMES[distance(d, o)] for _, o in devs], str(d.numa)])
        return rows


def doctor_report(root: str = "/sys") -> list[str]:
    """Lines for ``doctor``: what RDMA this host has, and the NIC/GPU distance matrix."""
    topo = Topology.read(root)
    lines: list[str] = []
    if not topo.nics:
        lines.append(
            f"rdma: no RDMA device under {os.path.join(root, 'class', 'infiniband')}: no "
            "NIC/GPU distances to go by (the rdma transport counts every NIC it opens as near)"
        )
    for n in topo.nics:
        ports = os.path.join(root, "class", "infiniband", n.name, "ports")
        states = [
            f"port {p}: {_read(os.path.join(ports, p, 'state'), '?')}"
            for p in (sorted(os.listdir(ports)) if os.path.isdir(ports) else [])
        ]
        lines.append(f"rdma: {n.name} numa {n.numa} pci {n.chain[-1:] or '?'} {', '.join(states)}")
    if topo.nics or topo.gpus:
        rows = topo.matrix()
        width = max(len(c) for r in rows for c in r) + 1
        lines += ["".join(c.ljust(width) for c in r).rstrip() for r in rows]
    return lines
