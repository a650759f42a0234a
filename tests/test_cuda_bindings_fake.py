"""Our real BindingsDriver through the real cuda-python, over a FAKE libcuda.so.1 built here.

tests/fake_libcuda/fake_libcuda.c stands in for the NVIDIA driver over host memory (two fake
devices, per-thread contexts, IPC across processes, VMM); cuda-python loads it through
LD_LIBRARY_PATH, so everything from our wrapper down to the bindings' marshalling is the real
code. Each scenario (tests/fake_libcuda/scenario.py) runs in a fresh process with that
environment and a peer process of its own, and reports what it saw as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from fake_libcuda import build, cuda_python_missing, env

pytestmark = pytest.mark.skipif(
    cuda_python_missing() is not None, reason=str(cuda_python_missing())
)
ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ROOT / "tests" / "fake_libcuda" / "scenario.py"


def run_scenario(name: str, shm: Path, script: Path = SCENARIO, **switches: str) -> dict[str, Any]:
    path = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)]))
    proc = subprocess.run(
        [sys.executable, str(script), name],
        env={**env(shm, **switches), "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=150,
    )
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines, (
        f"scenario {name} rc={proc.returncode}: {proc.stderr[-3000:]}"
    )
    out: dict[str, Any] = json.loads(lines[-1])
    assert "error" not in out, out.get("trace", out)
    out["stderr"] = proc.stderr
    return out


@pytest.fixture(scope="session")
def fake_lib() -> Path:
    return build()


def test_bytes_move_between_processes_through_the_real_bindings(
    fake_lib: Path, tmp_path: Path
) -> None:
    out = run_scenario("ipc", tmp_path)
    assert out["driver"] == "BindingsDriver"  # not a Python stand-in
    for case in ("gpu_gpu", "host_gpu", "thread", "tcp_gpu_gpu"):
        assert out[case] == [True, True], case  # SHA-256 equal after the read and the write
    c = out["counters"]
    assert c["ctx_mismatch"] == 0 and c["unknown_copy"] == 0 and c["no_ctx"] == 0
    assert c["ipc_open"] == c["ipc_close"] == 1  # opened once, closed when the engine closed
    assert c["not_ready"] > 0  # the NOT_READY answers were waited through


def run_code(code: str, shm: Path, **switches: str) -> str:
    path = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)]))
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env={**env(shm, **switches), "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_init_failure_is_one_typed_error(fake_lib: Path, tmp_path: Path) -> None:
    code = (
        "from mooncake_connectors.transfer_core import cuda_driver\n"
        "print(cuda_driver.unavailable_reason())\n"
    )
    out = run_code(code, tmp_path, FAKE_CUDA_FAIL_INIT="1")
    assert "found no usable GPU" in out and "CUDA_ERROR_NO_DEVICE" in out


def test_doctor_says_how_rdma_would_register_gpu_memory(fake_lib: Path, tmp_path: Path) -> None:
    """mrs.py's order through the real bindings: dma-buf where the driver exports it (device
    attribute 124) and pyverbs has DmaBufMR, else a plain MR, which needs nvidia_peermem."""
    code = (
        "import json\n"
        "from mooncake_connectors.transfer_core.transports.rdma.preflight import gpu_paths\n"
        "cases = [('auto', True, False), ('auto', False, True), ('peermem', True, False),\n"
        "         ('dmabuf', False, True)]\n"
        "print(json.dumps([[g.path for g in gpu_paths(*c)[0]] for c in cases]))\n"
    )
    exports = json.loads(run_code(code, tmp_path, FAKE_CUDA_ATTRS="124=1"))
    assert exports == [["dma-buf"] * 2, ["peermem"] * 2, ["none"] * 2, ["none"] * 2]
    none = json.loads(run_code(code, tmp_path, FAKE_CUDA_ATTRS="124=0"))
    assert none == [["none"] * 2, ["peermem"] * 2, ["none"] * 2, ["none"] * 2]


def test_doctor_describes_the_devices_through_the_real_bindings(
    fake_lib: Path, tmp_path: Path
) -> None:
    code = (
        "from mooncake_connectors.transfer_core import doctor\n"
        "print('\\n'.join(f.line() for f in doctor.check_gpus()))\n"
    )
    lines = run_code(code, tmp_path, FAKE_CUDA_ATTRS="103=0,124=1").splitlines()
    assert "2 GPU(s); driver supports CUDA 12.8" in lines[0]
    assert "CUDA IPC" not in "".join(lines)  # never claimed without asking the driver
    assert (
        "cuda:1 FAKE CUDA device 1 (not a GPU): VMM yes, VMM fd export no, dma-buf yes"
        in (lines[2])
    )
    assert "0:-P 1:P-" in lines[3]


def test_a_tp_rank_keeps_its_current_device_and_copies_run_in_their_devices_context(
    fake_lib: Path, tmp_path: Path
) -> None:
    out = run_scenario("contexts", tmp_path)
    for case in ("rank1_gpu", "rank1_host", "fresh_gpu", "dev0_first", "dev0_after_switch"):
        assert out[case] == [True, True], case
    # device 1 current before: still device 1 after registering, GPU and host transfers
    assert [out["rank1_register"], out["rank1_after_gpu"], out["rank1_after_host"]] == [1, 1, 1]
    assert out["fresh_after"] == -1  # a thread without a context is left without one
    assert out["switch_after"] == 1
    assert out["counters"]["ctx_mismatch"] == 0  # no event recorded on another context's stream
    assert out["counters"]["no_ctx"] == 0


def test_a_vmm_chunk_of_a_larger_reservation_is_exported_as_its_mapping(
    fake_lib: Path, tmp_path: Path
) -> None:
    out = run_scenario("vmm", tmp_path)
    for case in ("vmm", "vmm_offset", "local_vmm"):
        assert out[case] == [True, True], case
    assert out["export"] == [["fd", 2 << 20, 0]]  # the 2 MiB mapping, not the 8 MiB reservation
    assert out["counters"]["unknown_copy"] == 0


def test_an_unexportable_region_is_published_without_its_export_and_poisons_nothing(
    fake_lib: Path, tmp_path: Path
) -> None:
    out = run_scenario("unexportable", tmp_path)
    assert out["exports"] == {"bad": 0, "good": 1, "host": 0}
    assert out["good"] == [True, True] and out["bad"] == [True, True]
    assert out["peer_reads_bad"]
    (warning,) = out["warnings"]
    assert "export" in warning and "cuIpcGetMemHandle" in warning


def test_an_entry_point_the_driver_lacks_is_a_gpu_error_not_the_bindings_own(
    fake_lib: Path, tmp_path: Path
) -> None:
    out = run_scenario("old_driver", tmp_path, FAKE_CUDA_HIDE="cuMemRetainAllocationHandle")
    assert out["export_error"] == ["GpuError", "cuMemRetainAllocationHandle"]
    assert out["peer_reads"]  # registered without the export; tcp staging still reaches it
    assert "published without a CUDA export" in out["stderr"]


def test_exported_descriptors_are_closed_when_their_region_goes(
    fake_lib: Path, tmp_path: Path
) -> None:
    out = run_scenario("fd_exports", tmp_path)
    assert (out["registered"], out["after_unregister"], out["after_close"]) == (2, 1, 0)


def test_copies_of_a_kernels_bytes_wait_for_its_stream_through_a_fence_not_the_host(
    fake_lib: Path, tmp_path: Path
) -> None:
    out = run_scenario("ordering", tmp_path)
    for name in ("cuda_ipc", "tcp"):
        case = out[name]
        # the control: a copy that does not wait reads the bytes before the kernel wrote them
        assert case["unfenced_stale"][0] and case["unfenced_stale"][1] > 0, (name, case)
        # with the fence: the kernel's bytes, no stale copy, one stream wait on the GPU
        assert case["fenced_ok"] == [True, 0, 1], (name, case)
        assert case["own_stream_ok"] == [True, 0], (name, case)  # a non-default stream's handle
        assert case["current_after"] == 1, name  # the application's current device stays
    assert out["counters"]["ctx_mismatch"] == 0 and out["counters"]["no_ctx"] == 0
