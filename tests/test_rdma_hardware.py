"""The rdma transport on real NICs through pyverbs: runs wherever /sys/class/infiniband lists a
device (and pyverbs imports), skipped with that reason elsewhere; ``doctor`` and a ``doctor
--peer`` loop to a ``doctor --serve-rdma`` on this host too, and the direct QPs of the compiled
data path. Not yet run on hardware."""

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
from helpers import Peer, pattern, wait_until

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


def test_waited_for_requests_and_a_batch_go_on_direct_qps(link: Any) -> None:
    """On the compiled data path: once the direct QPs are connected (in the background, on
    first need), single requests and a shuffled batch of 32 KiB blocks go on them, and every
    byte reads back. Skipped where the compiled path is not built or turned off."""
    from mooncake_connectors.transfer_core import TransferRequest
    from mooncake_connectors.types import TransferOp

    e, peer, addr = link
    t = e.transports[0]
    assert isinstance(t, RdmaTransport)
    if t._direct is None:
        pytest.skip("no direct QPs here: the compiled rdma data path is not built or is off")
    buf = np.zeros(2 * SIZE, dtype=np.uint8)
    e.register(buf)
    local = int(buf.ctypes.data)
    try:

        def connected() -> bool:
            e.read(peer.segment, local, addr, 4096)  # (each is connected on first need)
            return all(v["direct"] for v in t.rail_stats(peer.segment).values())

        wait_until(connected, 30, "every direct QP to connect", interval=0.05)
        before = sum(v["direct_carried"] for v in t.rail_stats(peer.segment).values())
        for size in (1, 65537, 4 << 20):
            buf[:size] = pattern(size + 1, size)
            want = _sha(buf[:size])
            e.write(peer.segment, local, addr, size)
            buf[:size] = 0
            e.read(peer.segment, local, addr, size)
            assert _sha(buf[:size]) == want, size
        block, n = 32 << 10, SIZE // (32 << 10)
        order = list(np.random.default_rng(5).permutation(n))
        buf[:SIZE] = pattern(11, SIZE)
        seg, w, r = peer.segment, TransferOp.WRITE, TransferOp.READ
        e.transfer(
            [TransferRequest(w, seg, local + i * block, addr + int(j) * block, block)
             for i, j in enumerate(order)]
        )  # fmt: skip
        e.transfer(
            [TransferRequest(r, seg, local + SIZE + int(j) * block, addr + int(j) * block, block)
             for j in order]
        )  # fmt: skip
        for i, j in enumerate(order[:64]):
            got = buf[SIZE + int(j) * block : SIZE + (int(j) + 1) * block]
            assert _sha(got) == _sha(buf[i * block : (i + 1) * block]), (i, j)
        after = sum(v["direct_carried"] for v in t.rail_stats(peer.segment).values())
        assert after > before
    finally:
        e.unregister(local)


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
