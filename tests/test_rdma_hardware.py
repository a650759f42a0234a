"""The rdma transport on real NICs through pyverbs: runs wherever /sys/class/infiniband lists a
device (and pyverbs imports), skipped with that reason elsewhere; ``doctor`` and a ``doctor
--peer`` loop to a ``doctor --serve-rdma`` on this host too. Not yet run on hardware."""

from __future__ import annotations

import hashlib
import json
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import Peer, pattern

from mooncake_connectors.config import EngineConfig
from mooncake_connectors.transfer_core import TransferEngine
from mooncake_connectors.transfer_core.metadata.http import MetadataHTTPServer
from mooncake_connectors.transfer_core.transports.rdma import RdmaTransport

IB = "/sys/class/infiniband"
DEVICES = sorted(os.listdir(IB)) if os.path.isdir(IB) else []
pytestmark = pytest.mark.skipif(not DEVICES, reason=f"no RDMA device under {IB}")
SIZE = 16 << 20


@pytest.fixture(scope="module")
def link() -> Iterator[tuple[TransferEngine, Peer, int]]:
    pytest.importorskip("pyverbs", reason="pyverbs (python3-pyverbs) does not import here")
    srv = MetadataHTTPServer("127.0.0.1", 0).start()
    peer = Peer(metadata=srv.url, transports=["rdma"])
    e = TransferEngine(EngineConfig(metadata=srv.url, transports=("rdma",), timeout=20)).start()
    addr = peer.call("alloc", kind="numpy", size=SIZE, seed=1)["addr"]
    yield e, peer, addr
    e.close()
    peer.close()
    srv.stop()


def _sha(a: Any) -> str:
    return hashlib.sha256(bytes(a)).hexdigest()


@pytest.mark.parametrize("size", [1, 4096, 65537, SIZE])
def test_write_read_back_over_real_nics(link: Any, size: int) -> None:
    e, peer, addr = link
    buf = np.zeros(SIZE, dtype=np.uint8)
    e.register(buf)
    try:
        buf[:size] = pattern(size, size)
        want = _sha(buf[:size])
        e.write(peer.segment, int(buf.ctypes.data), addr, size)
        assert peer.call("digest", addr=addr, length=size)["sha"] == want
        buf[:] = 0
        e.read(peer.segment, int(buf.ctypes.data), addr, size)
        assert _sha(buf[:size]) == want
    finally:
        e.unregister(int(buf.ctypes.data))
    t = e.transports[0]
    assert isinstance(t, RdmaTransport)
    assert sum(v["carried"] for v in t.rail_stats(peer.segment).values()) > 0


def test_a_large_transfer_is_sprayed_over_every_active_nic() -> None:
    """With two or more active NICs on this host, the first 16 MiB write between a fresh pair
    (no rail measured yet, so none preferred) uses rails from more than one local NIC, and it
    reads back intact; with one NIC there is nothing to spray over."""
    pytest.importorskip("pyverbs", reason="pyverbs (python3-pyverbs) does not import here")
    srv = MetadataHTTPServer("127.0.0.1", 0).start()
    peer = Peer(metadata=srv.url, transports=["rdma"])
    e = TransferEngine(EngineConfig(metadata=srv.url, transports=("rdma",), timeout=20)).start()
    buf = np.zeros(SIZE, dtype=np.uint8)
    try:
        addr = peer.call("alloc", kind="numpy", size=SIZE, seed=1)["addr"]
        e.register(buf)
        buf[:] = pattern(7, SIZE)
        want = _sha(buf)
        e.write(peer.segment, int(buf.ctypes.data), addr, SIZE)
        t = e.transports[0]
        assert isinstance(t, RdmaTransport)
        stats = t.rail_stats(peer.segment)
        buf[:] = 0
        e.read(peer.segment, int(buf.ctypes.data), addr, SIZE)
        assert _sha(buf) == want
        e.unregister(int(buf.ctypes.data))
    finally:
        e.close()
        peer.close()
        srv.stop()
    if len({k.split(">")[0] for k in stats}) < 2:
        pytest.skip(f"one active NIC here ({sorted(stats)}): nothing to spray over")
    used = {k.split(">")[0] for k, v in stats.items() if v["carried"] > 0}
    assert len(used) >= 2, stats


def _doctor(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "mooncake_connectors", "doctor", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_ENV)


_ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}


def test_doctor_lists_the_nics_the_transport_opens() -> None:
    pytest.importorskip("pyverbs", reason="pyverbs (python3-pyverbs) does not import here")
    out = _doctor("--json")
    assert out.returncode == 0, out.stderr[-3000:]
    rdma = [f for f in json.loads(out.stdout) if f["area"] == "rdma"]
    nics = [f["data"] for f in rdma if "gid_index" in f["data"]]
    assert nics, rdma  # this host has an ACTIVE port, or the transport tests above failed too
    for n in nics:
        assert n["state"] == "ACTIVE" and n["mtu"] in (256, 512, 1024, 2048, 4096), n
        assert n["gid_type"] in ("IB", "RoCE v1", "RoCE v2") and n["gid"].strip("0:"), n


def test_doctor_peer_loop_to_itself_over_the_first_active_port() -> None:
    pytest.importorskip("pyverbs", reason="pyverbs (python3-pyverbs) does not import here")
    cmd = [sys.executable, "-m", "mooncake_connectors", "doctor", "--serve-rdma", "--json"]
    srv = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_ENV)
    try:
        lines: queue.Queue[str] = queue.Queue()
        stdout = srv.stdout
        assert stdout is not None
        threading.Thread(target=lambda: lines.put(stdout.readline()), daemon=True).start()
        first = lines.get(timeout=60)
        assert first, srv.communicate(timeout=10)[1][-3000:]
        where = json.loads(first)["serving"]
        out = _doctor("--json", "--peer", where)
        assert out.returncode == 0, out.stderr[-3000:] + out.stdout[-3000:]
        (peer,) = [f for f in json.loads(out.stdout) if f["area"] == "rdma-peer"]
        d = peer["data"]
        assert peer["verdict"] == "ok" and d["bytes_verified"] == 3 << 20, peer
        assert d["mtu"] == min(d["local_mtu"], d["peer_mtu"])
    finally:
        srv.terminate()
        srv.wait(10)
