"""Topology from a sysfs tree built here (the kernel's tree is a seam we do not own), the rails
it prefers, and GPU regions' dma-buf registration."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fake_nic
import fake_verbs
import numpy as np
import pytest
from helpers import Peer

from mooncake_connectors.config import EngineConfig
from mooncake_connectors.errors import ConfigError
from mooncake_connectors.transfer_core import TransferEngine
from mooncake_connectors.transfer_core.memory import Region
from mooncake_connectors.transfer_core.metadata.http import MetadataHTTPServer
from mooncake_connectors.transfer_core.transports.rdma import RdmaTransport
from mooncake_connectors.transfer_core.transports.rdma.mrs import Registry
from mooncake_connectors.transfer_core.transports.rdma.topology import (
    Topology,
    doctor_report,
    page_node,
)
from mooncake_connectors.transfer_core.transports.rdma.verbs import Verbs

# Two sockets. GPU0 and mlx5_0 share a PCIe switch on NUMA 0; GPU1 and mlx5_1 hang off two root
# ports of one host bridge on NUMA 1.
DEVICES = {
    "GPU0": ("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0", 0, "0x10de", "0x030200"),
    "mlx5_0": ("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0", 0, "0x15b3", "0x020700"),
    "GPU1": ("pci0000:80/0000:80:01.0/0000:81:00.0", 1, "0x10de", "0x030200"),
    "mlx5_1": ("pci0000:80/0000:80:02.0/0000:82:00.0", 1, "0x15b3", "0x020700"),
}


@pytest.fixture(scope="module", autouse=True)
def _own_fabric() -> Iterator[None]:
    # configure() changes this process's environment, which later modules' peers inherit.
    with fake_nic.isolated():
        yield


def build_sysfs(root: Path) -> Path:
    for name, (path, numa, vendor, cls) in DEVICES.items():
        d = root / "devices" / path
        d.mkdir(parents=True)
        (d / "numa_node").write_text(f"{numa}\n")
        (d / "vendor").write_text(vendor + "\n")
        (d / "class").write_text(cls + "\n")
        pci = root / "bus" / "pci" / "devices"
        pci.mkdir(parents=True, exist_ok=True)
        os.symlink(d, pci / path.rsplit("/", 1)[1])
        if name.startswith("mlx5"):
            ib = root / "class" / "infiniband" / name
            (ib / "ports" / "1").mkdir(parents=True)
            (ib / "ports" / "1" / "state").write_text("4: ACTIVE\n")
            os.symlink(d, ib / "device")
    return root


def test_matrix_and_preferred_nics(tmp_path: Path) -> None:
    topo = Topology.read(str(build_sysfs(tmp_path)), visible="")
    nics = ["mlx5_0", "mlx5_1"]
    assert topo.preferred("cuda:0", nics) == ["mlx5_0"]
    assert topo.preferred("cuda:1", nics) == ["mlx5_1"]
    assert topo.preferred("cpu:1", nics) == ["mlx5_1"]
    assert topo.preferred("cpu:7", nics) == nics  # unknown node: every NIC
    rows = {r[0]: r[1:] for r in topo.matrix()}
    assert rows[""] == ["GPU0", "GPU1", "mlx5_0", "mlx5_1", "NUMA"]
    assert rows["GPU0"] == ["X", "SYS", "PIX", "SYS", "0"]
    assert rows["GPU1"] == ["SYS", "X", "SYS", "PHB", "1"]
    lines = doctor_report(str(tmp_path))
    assert any("mlx5_0 numa 0" in line and "ACTIVE" in line for line in lines)
    assert any(line.startswith("GPU0") and "PIX" in line for line in lines)


def test_doctor_says_when_there_is_no_rdma(tmp_path: Path) -> None:
    assert "no RDMA device" in doctor_report(str(tmp_path))[0]


def test_host_memory_goes_out_through_its_numa_nodes_nic(tmp_path: Path) -> None:
    fake_verbs.configure("mlx5_0,mlx5_1")
    srv = MetadataHTTPServer("127.0.0.1", 0).start()
    rdma: dict[str, Any] = {"verbs": "fake_verbs"}
    peer = Peer(metadata=srv.url, transports=["rdma"], transport_settings={"rdma": rdma})
    e = TransferEngine(
        EngineConfig(
            metadata=srv.url,
            transports=("rdma",),
            transport_settings={"rdma": {**rdma, "sysfs": str(build_sysfs(tmp_path))}},
        )
    ).start()
    try:
        addr = peer.call("alloc", kind="numpy", size=1 << 20, seed=1)["addr"]
        buf = np.ones(1 << 20, dtype=np.uint8)  # faulted in: the kernel knows its node
        # The pages' node decides, not the label (cpu:1); the label only where pages do not say.
        node = page_node(int(buf.ctypes.data), buf.size)
        near, far = ("mlx5_0", "mlx5_1") if node == 0 else ("mlx5_1", "mlx5_0")
        e.register(buf, location="cpu:1")
        e.read(peer.segment, int(buf.ctypes.data), addr, buf.size)
        t = e.transports[0]
        assert isinstance(t, RdmaTransport)
        carried = {k: v["carried"] for k, v in t.rail_stats(peer.segment).items()}
        assert sum(v for k, v in carried.items() if k.startswith(near + ">")) == 16, carried
        assert not any(v for k, v in carried.items() if k.startswith(far + ">")), carried
    finally:
        e.close()
        peer.close()
        srv.stop()


def test_gpu_regions_use_dmabuf_else_peermem() -> None:
    fake_verbs.configure("mlx5_0")
    nic = Verbs("fake_verbs").open("mlx5_0", 1, 0)
    mem = np.zeros(1 << 16, dtype=np.uint8)  # stands for device memory: the fake reads the iova
    gpu = Region(int(mem.ctypes.data), mem.size, "cuda:0")
    exported: list[tuple[int, int]] = []

    def export(addr: int, length: int) -> tuple[int, int]:
        exported.append((addr, length))
        return os.memfd_create("dmabuf"), 0

    reg = Registry([nic], "auto", export)
    mr = reg.get(gpu)
    assert isinstance(mr.mrs["mlx5_0"], fake_verbs.DmaBufMR)
    assert reg.get(gpu) is mr and exported == [(gpu.addr, gpu.length)]  # registered once

    def no_export(addr: int, length: int) -> tuple[int, int]:
        raise ConfigError("no dma-buf here")

    peermem = Registry([nic], "auto", no_export).get(gpu)
    assert type(peermem.mrs["mlx5_0"]) is fake_verbs.MR
    with pytest.raises(ConfigError, match="no dma-buf"):
        Registry([nic], "dmabuf", no_export).get(Region(gpu.addr + 1, 16, "cuda:0"))
    reg.close_all()
