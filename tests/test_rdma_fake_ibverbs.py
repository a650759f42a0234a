"""The rdma transport over the real pyverbs over an emulated NIC: the FAKE libibverbs.so.1 in
tests/fake_ibverbs/, built here with gcc and loaded by child processes through LD_LIBRARY_PATH.

Nothing of ours is replaced: each child runs the real TransferEngine, verbs.py and Debian's
pyverbs; only libibverbs below pyverbs is the emulation, which checks what a fabric checks (QP
state order and masks, GID index and type, LID, PSNs, path MTU both ways, rkeys, bounds).
Skipped where pyverbs does not import (it is built for /usr/bin/python3: run in .venv-rdma) or
gcc / infiniband/verbs.h are missing."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fake_ibverbs_lib as fib
import pytest
from helpers import Peer, pattern

from mooncake_connectors.transfer_core.metadata.http import MetadataHTTPServer

pytest.importorskip("pyverbs.device", reason="pyverbs (python3-pyverbs) does not import here")
if fib.missing():
    pytest.skip(f"cannot build the fake libibverbs: {fib.missing()}", allow_module_level=True)

SPAN = 4 << 20
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def lib() -> Path:
    return fib.build()


class Pair:
    """Two engine processes, a (here) and b, each with its own emulated NICs on one fabric."""

    def __init__(self, lib: Path, devs_a: str, devs_b: str, **rdma: Any) -> None:
        self.fabric = fib.new_fabric()
        self.srv = MetadataHTTPServer("127.0.0.1", 0).start()
        self.peers: list[Peer] = []
        for host, devs in ((1, devs_a), (2, devs_b)):
            self.peers.append(
                Peer(
                    env=fib.env(lib, devs, self.fabric, host),
                    metadata=self.srv.url,
                    transports=["rdma"],  # no tcp to fall back to: what moves, moved by rdma
                    transport_settings={"rdma": {"rail_timeout": 2.0, **rdma}},
                    timeout=10,
                )
            )
        self.a, self.b = self.peers
        self.addr_a = self.a.call("alloc", kind="numpy", size=SPAN, seed=1)["addr"]
        self.addr_b = self.b.call("alloc", kind="numpy", size=SPAN, seed=2)["addr"]

    def close(self) -> None:
        for p in self.peers:
            p.close()
        self.srv.stop()
        fib.drop_fabric(self.fabric)

    def carried(self, p: Peer, other: Peer) -> float:
        stats = p.call("rail_stats", peer=other.segment)["stats"]
        return sum(v["carried"] for v in stats.values())


@pytest.fixture
def pairs(lib: Path) -> Iterator[list[Pair]]:
    made: list[Pair] = []
    yield made
    for p in made:
        p.close()


def _sha(p: Peer, addr: int, n: int) -> str:
    return str(p.call("digest", addr=addr, length=n)["sha"])


def test_real_pyverbs_opens_the_emulated_nic(lib: Path) -> None:
    """In one child: device list, port, GID table, PD, MR, CQ and an RC QP pair through verbs.py,
    then a WRITE, a READ, and a WRITE past the peer MR's end (REM_ACCESS_ERR, QP to ERR)."""
    code = """
import ctypes
from mooncake_connectors.transfer_core.transports.rdma.verbs import QpAddr, Verbs
v = Verbs("pyverbs")
assert v.devices() == ["mlx5_0", "mlx5_1"], v.devices()
a, b = v.open("mlx5_0", 1, 3), v.open("mlx5_1", 1, 3)
assert a.gid.endswith("ffff:0a00:0101") and b.gid.endswith("ffff:0a00:0102"), (a.gid, b.gid)
n = 8192
src, dst = ctypes.create_string_buffer(b"ab" * (n // 2), n), ctypes.create_string_buffer(n)
ma = a.reg_mr(ctypes.addressof(src), n, v.REMOTE_ACCESS)
mb = b.reg_mr(ctypes.addressof(dst), n, v.REMOTE_ACCESS)
qa, qb = a.create_qp(16), b.create_qp(16)
a.connect(qa, QpAddr(qb.qp_num, 7, b.gid, b.lid), 5)
b.connect(qb, QpAddr(qa.qp_num, 5, a.gid, a.lid), 7)
a.post(qa, 1, True, ctypes.addressof(src), 4096, ma.lkey, ctypes.addressof(dst), mb.rkey, True)
(c,) = a.poll(4)
assert c.ok and c.wr_id == 1 and dst.raw[:4096] == src.raw[:4096] and dst.raw[4096] == 0
ctypes.memset(src, 0, n)
a.post(qa, 2, False, ctypes.addressof(src), 4096, ma.lkey, ctypes.addressof(dst), mb.rkey, True)
(c,) = a.poll(4)
assert c.ok and src.raw[:4096] == b"ab" * 2048
past = ctypes.addressof(dst) + 8000  # 4096 bytes from here overrun the 8192-byte MR
a.post(qa, 3, True, ctypes.addressof(src), 4096, ma.lkey, past, mb.rkey, True)
(c,) = a.poll(4)
assert not c.ok and c.status == 10, c  # IBV_WC_REM_ACCESS_ERR
a.post(qa, 4, True, ctypes.addressof(src), 16, ma.lkey, ctypes.addressof(dst), mb.rkey, False)
(c,) = a.poll(4)
assert c.status == 5, c  # IBV_WC_WR_FLUSH_ERR: the QP is in ERR now
print("ok")
"""
    fabric = fib.new_fabric()
    try:
        out = subprocess.run(
            [sys.executable, "-c", code],
            env={
                **fib.env(lib, "mlx5_0:roce:4096,mlx5_1:roce:4096", fabric, 1),
                "PYTHONPATH": str(ROOT),
            },
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        fib.drop_fabric(fabric)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


@pytest.mark.parametrize("size", [1, 4096, 65537, SPAN])
def test_write_and_read_between_processes(pairs: list[Pair], lib: Path, size: int) -> None:
    p = Pair(
        lib, "mlx5_0:roce:4096,mlx5_1:roce:4096", "mlx5_0:roce:4096,mlx5_1:roce:4096", gid_index=3
    )
    pairs.append(p)
    p.a.call("transfer", op="write", peer=p.b.segment, local=p.addr_a, remote=p.addr_b, length=size)
    want = hashlib.sha256(bytes(pattern(1, SPAN)[:size])).hexdigest()
    assert _sha(p.b, p.addr_b, size) == want
    p.b.call(
        "transfer",
        op="read",
        peer=p.a.segment,
        local=p.addr_b + SPAN - size,
        remote=p.addr_a,
        length=size,
    )
    assert _sha(p.b, p.addr_b + SPAN - size, size) == want
    assert p.carried(p.a, p.b) > 0 and p.carried(p.b, p.a) > 0
