"""Which NIC a GPU's memory prefers, with the GPU ordinal resolved by the CUDA driver: the real
cuda-python over the FAKE libcuda.so.1 (tests/fake_libcuda), whose devices answer
cuDeviceGetPCIBusId with the addresses a test gives, and a sysfs tree built here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from fake_libcuda import build, cuda_python_missing, env
from test_rdma_topology import build_sysfs

pytestmark = pytest.mark.skipif(
    cuda_python_missing() is not None, reason=str(cuda_python_missing())
)
ROOT = Path(__file__).resolve().parents[1]

CODE = """
import json, sys
from mooncake_connectors.transfer_core import cuda_driver
from mooncake_connectors.transfer_core.transports.rdma.topology import Topology
drv = cuda_driver.driver()
topo = Topology.read(sys.argv[1])
nics = ["mlx5_0", "mlx5_1"]
print(json.dumps({
    "driver": type(drv).__name__,
    "bus": [drv.pci_bus_id(i) for i in range(2)],
    "near": [topo.preferred(f"cuda:{i}", nics) for i in range(2)],
}))
"""


@pytest.mark.parametrize(
    "visible", ["", "1,0", "GPU-a0f1f2f3-f4f5-f6f7-f8f9-fafbfcfdfeff,GPU-a1f1f2f3-f4f5-f6f7"]
)
def test_each_gpu_prefers_the_nic_nearest_its_own_pci_address(tmp_path: Path, visible: str) -> None:
    """The tree has GPU 0000:02:00.0 beside mlx5_0 (one PCIe switch) and GPU 0000:81:00.0 on
    the other socket beside mlx5_1. CUDA numbers them the other way round (its default order is
    fastest first; CUDA_VISIBLE_DEVICES may reorder, by number or by UUID): the driver says
    device 0 is 0000:81:00.0. Each picks its own nearest NIC. Before, GPU N was taken to be the
    N-th NVIDIA function in bus order (with only a numeric CUDA_VISIBLE_DEVICES honoured), so
    cuda:0 preferred mlx5_0, across the sockets from its memory."""
    build()
    sysfs = build_sysfs(tmp_path / "sys")
    switches = {"FAKE_CUDA_PCI_BUS_IDS": "0000:81:00.0,0000:02:00.0"}
    proc = subprocess.run(
        [sys.executable, "-c", CODE, str(sysfs)],
        env={
            **env(tmp_path, **switches),
            "PYTHONPATH": str(ROOT),
            "CUDA_VISIBLE_DEVICES": visible,
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["driver"] == "BindingsDriver"  # the real bindings, not a stand-in
    assert out["bus"] == ["0000:81:00.0", "0000:02:00.0"]  # as sysfs names them (lower case)
    assert out["near"] == [["mlx5_1"], ["mlx5_0"]]
