"""``doctor``: one finding per line, with a fix; GPUs through the driver seam (FakeCuda)."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_cuda import FakeCuda, installed
from typer.testing import CliRunner

from mooncake_connectors.cli import app
from mooncake_connectors.transfer_core import cuda_driver, doctor, doctor_rdma


@pytest.fixture
def fake() -> Iterator[FakeCuda]:
    with installed(3) as f:
        yield f


def test_gpus_versions_vmm_and_peer_matrix(fake: FakeCuda) -> None:
    lines = [f.line() for f in doctor.check_gpus()]
    assert lines[0].startswith("[ok  ] gpu: 3 GPU(s); driver supports CUDA 12.8")
    assert "cuda:1 Fake GPU 1: VMM yes, VMM fd export yes, dma-buf no" in lines[2]
    assert "0:-PP 1:P-P 2:PP-" in lines[-1]


def test_no_driver_is_one_failing_line_with_its_fix() -> None:
    prev = cuda_driver.install(None)  # the real loader: this host has no GPU driver
    try:
        (f,) = doctor.check_gpus()
    finally:
        cuda_driver.install(prev)
    assert f.verdict == "fail" and f.message.startswith("no usable GPU")
    assert f.fix


def test_rdma_reasons_from_the_system_tree(tmp_path: Path) -> None:
    findings = doctor.check_rdma(str(tmp_path))
    assert any("no kernel RDMA" in f.message and f.fix for f in findings)
    (tmp_path / "sys/module/ib_core").mkdir(parents=True)
    assert any(f.message == "no RDMA device" for f in doctor.check_rdma(str(tmp_path)))
    (tmp_path / "sys/class/infiniband/mlx5_0").mkdir(parents=True)
    msgs = [f.message for f in doctor.check_rdma(str(tmp_path))]
    assert any("mlx5_0" in m or "pyverbs" in m for m in msgs)
    assert any("nvidia_peermem not loaded" in m for m in msgs)


def test_numa_layout_and_shm(tmp_path: Path) -> None:
    for n, cpus in (("node0", "0-3"), ("node1", "4-7")):
        (tmp_path / "sys/devices/system/node" / n).mkdir(parents=True)
        (tmp_path / "sys/devices/system/node" / n / "cpulist").write_text(cpus + "\n")
    (numa,) = doctor.check_numa(str(tmp_path))
    assert numa.message == "2 node(s): node0 cpus 0-3; node1 cpus 4-7" and numa.fix
    (shm,) = doctor.check_shm()
    assert "GiB" in shm.message


def test_reachability_of_given_endpoints() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        ok = doctor.check_reachable("metadata", f"etcd://127.0.0.1:{port}", 2379)
    assert ok.verdict == "ok"
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        dead = closed.getsockname()[1]  # bound, never listening: refused
    bad = doctor.check_reachable("master", f"127.0.0.1:{dead}", 50051)
    assert bad.verdict == "fail" and bad.fix


def test_cli_text_and_json(fake: FakeCuda) -> None:
    runner = CliRunner()
    text = runner.invoke(app, ["doctor"])
    assert text.exit_code == 0, text.output
    assert all(line.startswith("[") for line in text.output.splitlines())
    out = runner.invoke(app, ["doctor", "--json"])
    assert out.exit_code == 0, out.output
    areas = {f["area"] for f in json.loads(out.output)}
    assert {"gpu", "rdma", "shm", "numa", "transports"} <= areas


def test_bad_rdma_settings_and_peer_addresses_are_refused_clearly() -> None:
    runner = CliRunner()
    bad = runner.invoke(app, ["doctor", "--rdma-settings", '{"nics": "mlx5_0", "bogus": 1}'])
    assert bad.exit_code == 2 and "--rdma-settings" in bad.output
    (f,) = doctor_rdma.check_peer("no-port", None, 4096, 1.0)
    assert f.verdict == "fail" and "is not HOST:PORT" in f.message


def test_doctor_prints_the_rdma_topology_matrix(tmp_path: Path) -> None:
    from test_rdma_topology import build_sysfs

    build_sysfs(tmp_path / "sys")
    lines = [f.message for f in doctor.run(root=str(tmp_path)) if f.area == "topology"]
    assert any("mlx5_0" in line and "ACTIVE" in line for line in lines)
    assert any(line.startswith("GPU0") and "PIX" in line for line in lines)


def test_the_cuda_extra_admits_only_releases_with_cuda_bindings() -> None:
    """cuda-python 12.0 to 12.6.0 install fine but have no ``cuda.bindings`` (the user would be
    told it is not installed); 12.6.1 is the first with it."""
    from pathlib import Path

    import tomllib

    requirements = pytest.importorskip("packaging.requirements")
    with open(Path(__file__).resolve().parents[1] / "pyproject.toml", "rb") as fh:
        (spec,) = tomllib.load(fh)["project"]["optional-dependencies"]["cuda"]
    req = requirements.Requirement(spec)
    assert req.name == "cuda-python"
    assert [v in req.specifier for v in ("12.0.0", "12.6.0", "12.6.1", "13.4.4")] == [
        False, False, True, True,
    ]  # fmt: skip


def test_pidfd_getfd_verdict_follows_yama_and_the_trial(tmp_path: Path) -> None:
    yama = tmp_path / "proc/sys/kernel/yama/ptrace_scope"
    yama.parent.mkdir(parents=True)
    yama.write_text("1\n")
    (f,) = doctor.check_pidfd(str(tmp_path), trial=lambda: "EPERM")
    assert f.verdict == "warn" and "EPERM" in f.message and "ptrace_scope=1" in f.message
    assert "fall back to tcp staging" in f.message and "VMM" in f.message
    assert "kernel.yama.ptrace_scope=0" in f.fix
    yama.write_text("0\n")  # no Yama restriction, still refused: a container's seccomp
    (f,) = doctor.check_pidfd(str(tmp_path), trial=lambda: "EPERM")
    assert "SYS_PTRACE" in f.fix
    (f,) = doctor.check_pidfd(str(tmp_path / "none"), trial=lambda: None)
    assert f.verdict == "ok" and "no Yama" in f.message and not f.fix


def test_the_pidfd_trial_is_a_real_attempt_from_another_process() -> None:
    answer = doctor.pidfd_trial()  # this host's real answer: permitted, or an errno name
    assert answer is None or answer.startswith("E"), answer
    if answer is None:  # permitted here: a descriptor this process does not have is refused
        assert doctor.pidfd_trial(fd=999_999) == "EBADF"


def test_doctor_reports_pidfd_getfd_where_a_gpu_is_usable(fake: FakeCuda, tmp_path: Path) -> None:
    areas = [f.message for f in doctor.run(root=str(tmp_path)) if "pidfd_getfd" in f.message]
    assert len(areas) == 1
