"""``mooncake-connectors doctor`` for RDMA, and ``doctor --peer`` / ``--serve-rdma``, run as the
real command line in child processes over the real pyverbs and the emulated NIC (the FAKE
libibverbs.so.1 of tests/fake_ibverbs/, one emulated host per process on one fabric).

Skipped where pyverbs does not import (run in .venv-rdma) or the fake cannot be built."""

from __future__ import annotations

import json
import queue
import resource
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fake_ibverbs_lib as fib
import pytest
from test_rdma_topology import build_sysfs

pytest.importorskip("pyverbs.device", reason="pyverbs (python3-pyverbs) does not import here")
if fib.missing():
    pytest.skip(f"cannot build the fake libibverbs: {fib.missing()}", allow_module_level=True)

ROOT = Path(__file__).resolve().parent.parent
# two usable NICs (RoCE at 4096, InfiniBand at 2048) and two the transport must skip
MIXED = "mlx5_0:roce:4096,mlx5_1:ib:2048,mlx5_2:roce:1024:down,mlx5_3:roce:4096:nogid"


@pytest.fixture(scope="module")
def lib() -> Path:
    return fib.build()


@pytest.fixture
def fabric() -> Iterator[str]:
    name = fib.new_fabric()
    yield name
    fib.drop_fabric(name)


def _env(lib: Path, devices: str, fabric: str, host: int) -> dict[str, str]:
    return {**fib.env(lib, devices, fabric, host), "PYTHONPATH": str(ROOT)}


def doctor(
    lib: Path, devices: str, fabric: str, host: int, *args: str, **kw: Any
) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "mooncake_connectors", "doctor", *args]
    env = _env(lib, devices, fabric, host)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=90, **kw)


def findings(out: str, area: str = "rdma") -> list[dict[str, Any]]:
    return [f for f in json.loads(out) if f["area"] == area]


class Server:
    """``doctor --serve-rdma`` in a child; ``where`` is the HOST:PORT it printed."""

    def __init__(self, lib: Path, devices: str, fabric: str, host: int = 2) -> None:
        cmd = [sys.executable, "-m", "mooncake_connectors", "doctor", "--serve-rdma", "--json"]
        self.proc = subprocess.Popen(
            cmd, env=_env(lib, devices, fabric, host), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        lines: queue.Queue[str] = queue.Queue()
        stdout = self.proc.stdout
        assert stdout is not None
        threading.Thread(target=lambda: lines.put(stdout.readline()), daemon=True).start()
        try:
            first = lines.get(timeout=60)
        except queue.Empty:
            self.close()
            raise AssertionError("the server printed no address within 60s") from None
        assert first, self.close_and_stderr()
        self.info = json.loads(first)
        self.where = self.info["serving"]

    def close_and_stderr(self) -> str:
        self.close()
        assert self.proc.stderr is not None
        return self.proc.stderr.read()[-3000:]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: it stops accepting and closes its NICs
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def test_doctor_reports_what_the_transport_chose_on_each_nic(
    lib: Path, fabric: str, tmp_path: Path
) -> None:
    """Per NIC: port state, link layer, GID index/type/address, MTU, NUMA node and nearest GPUs
    (from a sysfs tree where GPU0 shares a PCIe switch with mlx5_0, GPU1 a host bridge with
    mlx5_1); the down and GID-less NICs skipped with their reason. And the real engine's rdma
    transport, started with the same settings in the same emulation, uses exactly that."""
    settings = json.dumps({"sysfs": str(build_sysfs(tmp_path / "sys"))})
    out = doctor(lib, MIXED, fabric, 1, "--json", "--rdma-settings", settings)
    assert out.returncode == 0, out.stderr[-3000:]
    rdma = findings(out.stdout)
    nics = {f["data"]["name"]: f["data"] for f in rdma if "gid_index" in f["data"]}
    assert set(nics) == {"mlx5_0", "mlx5_1"}
    roce, ib = nics["mlx5_0"], nics["mlx5_1"]
    assert (roce["gid_index"], roce["gid_type"], roce["mtu"], roce["state"]) == (
        3, "RoCE v2", 4096, "ACTIVE",
    )  # fmt: skip
    assert roce["gid"].endswith("ffff:0a00:0101") and roce["link_layer"] == "Ethernet (RoCE)"
    assert (roce["numa"], roce["nearest_gpus"]) == (0, ["cuda:0 (PIX)"])
    assert (ib["gid_index"], ib["gid_type"], ib["mtu"], ib["link_layer"]) == (
        0, "IB", 2048, "InfiniBand",
    )  # fmt: skip
    assert (ib["numa"], ib["nearest_gpus"]) == (1, ["cuda:1 (PHB)"])
    skipped = {f["data"]["skipped"]: f for f in rdma if "skipped" in f["data"]}
    assert set(skipped) == {"mlx5_2", "mlx5_3"}
    assert "not ACTIVE" in skipped["mlx5_2"]["message"] and skipped["mlx5_2"]["fix"]
    assert "empty GID table" in skipped["mlx5_3"]["message"]
    assert all(f["verdict"] == "warn" for f in skipped.values())
    memlock = next(f for f in rdma if "memlock" in f["data"])
    assert memlock["verdict"] == "ok" and memlock["data"]["needed"] == 64 << 20

    text = doctor(lib, MIXED, fabric, 1, "--rdma-settings", settings)
    assert text.returncode == 0, text.stderr[-3000:]
    assert (
        "[ok  ] rdma: mlx5_0 port 1 ACTIVE, Ethernet (RoCE), GID index 3 RoCE v2 "
        "0000:0000:0000:0000:0000:ffff:0a00:0101, MTU 4096, NUMA 0, nearest GPUs cuda:0 (PIX)"
    ) in text.stdout
    assert "[warn] rdma: mlx5_2 skipped: RDMA device mlx5_2 port 1 is not ACTIVE" in text.stdout

    engine = """
import json
from mooncake_connectors.config import EngineConfig
from mooncake_connectors.transfer_core import TransferEngine
from mooncake_connectors.transfer_core.metadata.http import MetadataHTTPServer
srv = MetadataHTTPServer("127.0.0.1", 0).start()
e = TransferEngine(EngineConfig(metadata=srv.url, transports=("rdma",))).start()
t = e.transports[0]
print(json.dumps({n: [s.nic.gid_index, s.nic.gid, 128 << s.nic.mtu] for n, s in t.nics.items()}))
e.close()
srv.stop()
"""
    run = subprocess.run(
        [sys.executable, "-c", engine], env=_env(lib, MIXED, fabric, 1), capture_output=True,
        text=True, timeout=90,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    used = json.loads(run.stdout.strip().splitlines()[-1])
    assert used == {n: [d["gid_index"], d["gid"], d["mtu"]] for n, d in nics.items()}


def test_a_low_memlock_limit_fails_with_the_fix(lib: Path, fabric: str) -> None:
    """Without CAP_IPC_LOCK (dropped here when we run as root) and ``ulimit -l`` at 1 MiB."""
    prefix = []
    if shutil.which("setpriv"):
        prefix = ["setpriv", "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock", "--"]
    probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"cannot drop CAP_IPC_LOCK here: {probe.stderr!r}")

    def low() -> None:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (1 << 20, 1 << 20))

    cmd = [*prefix, sys.executable, "-m", "mooncake_connectors", "doctor", "--json"]
    out = subprocess.run(
        cmd, env=_env(lib, MIXED, fabric, 1), capture_output=True, text=True, timeout=90,
        preexec_fn=low,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    (memlock,) = [f for f in findings(out.stdout) if "memlock" in f["data"]]
    assert memlock["verdict"] == "fail", memlock
    assert "1024 KiB, below the 65536 KiB" in memlock["message"]
    assert "ulimit -l unlimited" in memlock["fix"]
    assert memlock["data"]["memlock"] == 1 << 20 and not memlock["data"]["cap_ipc_lock"]


@pytest.mark.parametrize(
    ("here", "there", "agreed"),
    [("roce:4096", "roce:1024", 1024), ("ib:2048", "ib:4096", 2048), ("roce:512", "roce:512", 512)],
)
def test_peer_loop_between_two_processes(
    lib: Path, fabric: str, here: str, there: str, agreed: int
) -> None:
    """A READ of the server's bytes, a WRITE, a READ back, the server's own digest of what
    landed, and the round trip; the path MTU both use is the smaller of the two ports'."""
    srv = Server(lib, f"mlx5_0:{there}", fabric)
    try:
        out = doctor(lib, f"mlx5_0:{here}", fabric, 1, "--json", "--peer", srv.where,
                     "--bytes", "3000001")  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:] + out.stdout[-3000:]
        (peer,) = findings(out.stdout, "rdma-peer")
        d = peer["data"]
        assert peer["verdict"] == "ok", peer
        mtus = (int(here.split(":")[1]), int(there.split(":")[1]))
        assert (d["mtu"], d["local_mtu"], d["peer_mtu"]) == (agreed, *mtus)
        assert d["bytes_verified"] == 3 * 3000001  # a last work request shorter than 64 KiB
        assert d["rtt_us_min"] > 0 and d["rtt_us_median"] >= d["rtt_us_min"]
        if here.startswith("roce"):
            assert d["local_gid"].endswith("ffff:0a00:0101"), d
            assert d["peer_gid"].endswith("ffff:0a00:0201"), d
            assert (d["local_gid_type"], d["peer_gid_index"]) == ("RoCE v2", 3)
        else:
            assert (d["local_gid_type"], d["local_gid_index"]) == ("IB", 0)
        text = doctor(lib, f"mlx5_0:{here}", fabric, 1, "--peer", srv.where)
        assert text.returncode == 0, text.stderr[-3000:]
        line = next(x for x in text.stdout.splitlines() if x.startswith("[ok  ] rdma-peer:"))
        assert f"MTU {agreed}" in line and f"{3 << 20} bytes verified" in line
        if here != there:
            assert "(the smaller of" in line
    finally:
        srv.close()
    assert srv.proc.returncode == 0, srv.close_and_stderr()


def test_the_server_outlives_a_bad_client(lib: Path, fabric: str) -> None:
    """Bytes that are not the protocol, then a client that hangs up mid-session: the next
    loop still runs."""
    srv = Server(lib, "mlx5_0:roce:4096", fabric)
    try:
        host, port = srv.where.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(b"\xff\xff\xff\xffGET / HTTP/1.1\r\n\r\n")
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(b"\x00\x00")
        out = doctor(lib, "mlx5_0:roce:4096", fabric, 1, "--json", "--peer", srv.where)
        assert out.returncode == 0, out.stderr[-3000:]
        assert findings(out.stdout, "rdma-peer")[0]["verdict"] == "ok"
    finally:
        srv.close()


def test_unreachable_peers_fail_clearly_by_the_deadline(lib: Path, fabric: str) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        refused = closed.getsockname()[1]  # bound, never listening
        out = doctor(lib, "mlx5_0:roce:4096", fabric, 1, "--peer", f"127.0.0.1:{refused}")
    assert out.returncode == 1, out.stdout
    line = next(x for x in out.stdout.splitlines() if "rdma-peer" in x)
    assert line.startswith("[fail]") and "unreachable" in line and "--serve-rdma" in line
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts (backlog), never answers
        where = f"127.0.0.1:{silent.getsockname()[1]}"
        out = doctor(lib, "mlx5_0:roce:4096", fabric, 1, "--peer", where, "--timeout", "2")
    assert out.returncode == 1, out.stdout
    line = next(x for x in out.stdout.splitlines() if "rdma-peer" in x)
    assert "no answer within 2s" in line, line


def test_no_rdma_device_says_so_and_exits_non_zero(lib: Path, fabric: str) -> None:
    out = doctor(lib, "", fabric, 1, "--peer", "127.0.0.1:1")
    assert out.returncode == 1
    line = next(x for x in out.stdout.splitlines() if "rdma-peer" in x)
    assert line.startswith("[fail] rdma-peer: no RDMA device"), line
    out = doctor(lib, "mlx5_0:roce:4096:down", fabric, 1, "--serve-rdma")
    assert out.returncode == 1
    assert "no usable RDMA device here: mlx5_0: RDMA device mlx5_0 port 1 is not ACTIVE" in (
        out.stderr
    )
    out = doctor(lib, "", fabric, 1, "--serve-rdma")
    assert out.returncode == 1 and "no RDMA device" in out.stderr


def test_an_error_completion_fails_the_loop_with_what_it_means(lib: Path, fabric: str) -> None:
    """Here a RoCE v1 GID (index 2, forced), there RoCE v2 on a routed fabric: the READ is
    retried out, and the line says what retry exceeded means on first contact."""
    srv = Server(lib, "mlx5_0:roce:4096:routed", fabric)
    try:
        forced = json.dumps({"gid_index": 2})
        out = doctor(lib, "mlx5_0:roce:4096:routed", fabric, 1, "--peer", srv.where,
                     "--rdma-settings", forced)  # fmt: skip
    finally:
        srv.close()
    assert out.returncode == 1, out.stdout
    line = next(x for x in out.stdout.splitlines() if "rdma-peer" in x)
    assert line.startswith("[fail] rdma-peer: an RDMA READ on mlx5_0 completed with status 12")
    assert "RoCE v1 across a routed fabric" in line
    assert "GID index 2 RoCE v1" in out.stdout  # doctor shows the forced entry, as used
