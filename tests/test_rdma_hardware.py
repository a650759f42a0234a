"""The rdma transport on real NICs through pyverbs: runs wherever /sys/class/infiniband lists a
device (and pyverbs imports), skipped with that reason elsewhere. Not yet run on hardware."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
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
