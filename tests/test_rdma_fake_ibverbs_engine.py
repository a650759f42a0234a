"""The engine's rdma behaviour between processes over the emulated NIC (the FAKE libibverbs.so.1
under the real pyverbs; see test_rdma_fake_ibverbs.py): spraying over every rail, falling back
to tcp when every rail fails, a stale rkey, and the errors at start. These ran on the Python
stand-in (tests/fake_verbs.py) before; run in .venv-rdma."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import fake_ibverbs_lib as fib
import pytest
from helpers import Peer
from test_rdma_fake_ibverbs import ROOT, SPAN, Pair, _child, _sha, lib, pairs

from mooncake_connectors.transfer_core.metadata.http import MetadataHTTPServer

__all__ = ["lib", "pairs"]  # fixtures, used by name
DEVS = "mlx5_0:roce:4096,mlx5_1:roce:4096"
NICS = ("mlx5_0", "mlx5_1")


def test_slices_are_sprayed_over_every_rail(pairs: list[Pair], lib: Path) -> None:
    p = Pair(lib, DEVS, DEVS, gid_index=3)
    pairs.append(p)
    # The compiled path posts a request as a few runs of many WRs, all placed at submit, so a
    # rail not yet usable then gets none of them (seen once: one rail carried nothing, its rate
    # still the unmeasured initial one). So up to 4 rounds, until every rail carried some.
    rounds = 0
    while rounds < 4:
        rounds += 1
        for op in ("write", "read"):
            p.a.call(
                "transfer", op=op, peer=p.b.segment, local=p.addr_a, remote=p.addr_b, length=SPAN
            )
        assert _sha(p.a, p.addr_a, SPAN) == _sha(p.b, p.addr_b, SPAN)
        stats = p.a.call("rail_stats", peer=p.b.segment)["stats"]
        if all(v["carried"] > 0 for v in stats.values()):
            break
    assert sorted(stats) == [f"{a}>{b}" for a in NICS for b in NICS]
    assert all(v["carried"] > 0 for v in stats.values()), stats
    assert sum(v["carried"] for v in stats.values()) == rounds * 2 * SPAN // (64 << 10)


def test_every_rail_failing_falls_back_to_tcp_within_the_deadline(lib: Path) -> None:
    """The fabric carries only traffic class 26 (FAKE_IBV_TC) and the QPs send class 0: every
    WR is dropped and retried out, on every rail. Each rail cools down and the request
    completes over tcp within its deadline."""
    fabric = fib.new_fabric()
    srv = MetadataHTTPServer("127.0.0.1", 0).start()
    peers = [
        Peer(
            env={**fib.env(lib, DEVS, fabric, host), "FAKE_IBV_TC": "26"},
            metadata=srv.url,
            transports=["rdma", "tcp"],
            transport_settings={"rdma": {"gid_index": 3, "traffic_class": 0}},
            timeout=10,
            backoff_initial=30.0,  # a failed rail stays cool for the rest of the test
            backoff_max=60.0,
        )
        for host in (1, 2)
    ]
    a, b = peers
    try:
        addr_a = a.call("alloc", kind="numpy", size=SPAN, seed=5)["addr"]
        addr_b = b.call("alloc", kind="numpy", size=SPAN, seed=6)["addr"]
        a.call("transfer", op="write", peer=b.segment, local=addr_a, remote=addr_b, length=SPAN)
        assert _sha(b, addr_b, SPAN) == _sha(a, addr_a, SPAN)
        stats = a.call("rail_stats", peer=b.segment)["stats"]
        assert sorted(stats) == [f"{x}>{y}" for x in NICS for y in NICS]
        assert all(v["cooling"] and not v["carried"] for v in stats.values()), stats
    finally:
        for p in peers:
            p.close()
        srv.stop()
        fib.drop_fabric(fabric)


def test_stale_rkey_is_an_access_violation_and_not_retried(pairs: list[Pair], lib: Path) -> None:
    """b unregisters a region a has the descriptor of: its MRs are gone, so a's READ with the
    old rkey is refused by b's NIC (REM_ACCESS_ERR). That is final, and no rail cools down."""
    p = Pair(lib, DEVS, DEVS, gid_index=3)
    pairs.append(p)
    other = p.b.call("alloc", kind="numpy", size=1 << 20, seed=4)["addr"]
    p.a.call("transfer", op="read", peer=p.b.segment, local=p.addr_a, remote=other, length=4096)
    p.b.call("unregister", addr=other)
    with pytest.raises(AssertionError, match="AccessViolation"):
        p.a.call("transfer", op="read", peer=p.b.segment, local=p.addr_a, remote=other, length=4096)
    stats = p.a.call("rail_stats", peer=p.b.segment)["stats"]
    assert not any(v["cooling"] for v in stats.values()), stats  # the rail was not at fault


START = """
from mooncake_connectors.config import EngineConfig
from mooncake_connectors.errors import ConfigError
from mooncake_connectors.transfer_core import TransferEngine
try:
    TransferEngine(EngineConfig(metadata="memory", transports=("rdma",))).start()
except ConfigError as exc:
    assert MATCH in str(exc), exc
    print("ok")
"""


@pytest.mark.parametrize(
    ("devices", "match"), [("", "no RDMA device"), ("mlx5_0:roce:4096:down", "not ACTIVE")]
)
def test_no_device_or_a_port_down_is_a_clear_error(lib: Path, devices: str, match: str) -> None:
    _child(lib, devices, START.replace("MATCH", repr(match)))


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
def test_low_memlock_limit_is_a_clear_error(lib: Path) -> None:
    code = "import resource\nresource.setrlimit(resource.RLIMIT_MEMLOCK, (1 << 20, 1 << 20))\n"
    code += START.replace("MATCH", repr("ulimit -l"))
    fabric = fib.new_fabric()
    try:
        # without CAP_IPC_LOCK, as an unprivileged process, so the limit applies
        out = subprocess.run(
            [
                "setpriv",
                "--inh-caps=-ipc_lock",
                "--bounding-set=-ipc_lock",
                sys.executable,
                "-c",
                code,
            ],
            env={**fib.env(lib, DEVS, fabric, 1), "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        fib.drop_fabric(fabric)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
