"""The rdma transport over the real pyverbs over an emulated NIC: the FAKE libibverbs.so.1 in
tests/fake_ibverbs/, built here with gcc and loaded by child processes through LD_LIBRARY_PATH.

Nothing of ours is replaced: each child runs the real TransferEngine, verbs.py and Debian's
pyverbs; only libibverbs below pyverbs is the emulation, which checks what a fabric checks (QP
state order and masks, GID index and type, LID, PSNs, path MTU both ways, rkeys, bounds).
Skipped where pyverbs does not import (it is built for /usr/bin/python3: run in .venv-rdma) or
gcc / infiniband/verbs.h are missing."""

from __future__ import annotations

import hashlib
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fake_ibverbs_lib as fib
import msgspec
import pytest
from helpers import Peer, pattern, wait_until

from mooncake_connectors.transfer_core.descriptor import RegionDesc, SegmentDesc, encode_segment
from mooncake_connectors.transfer_core.metadata.base import SEGMENT_PREFIX
from mooncake_connectors.transfer_core.metadata.http import HttpClient, MetadataHTTPServer
from mooncake_connectors.transfer_core.transports import wire

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

    def __init__(
        self,
        lib: Path,
        devs_a: str,
        devs_b: str,
        caps: dict[str, str] | None = None,
        only_b: dict[str, Any] | None = None,
        **rdma: Any,
    ) -> None:
        self.fabric = fib.new_fabric()
        self.srv = MetadataHTTPServer("127.0.0.1", 0).start()
        self.peers: list[Peer] = []
        for host, devs in ((1, devs_a), (2, devs_b)):
            self.peers.append(
                Peer(
                    env={**fib.env(lib, devs, self.fabric, host), **(caps or {})},
                    metadata=self.srv.url,
                    transports=["rdma"],  # no tcp to fall back to: what moves, moved by rdma
                    transport_settings={
                        "rdma": {
                            "rail_timeout": 2.0,
                            **rdma,
                            **((only_b or {}) if host == 2 else {}),
                        }
                    },
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


def _child(lib: Path, devices: str, code: str) -> None:
    """Run ``code`` in a child over the emulated NIC; it prints "ok" when its checks hold."""
    fabric = fib.new_fabric()
    try:
        out = subprocess.run(
            [sys.executable, "-c", code],
            env={**fib.env(lib, devices, fabric, 1), "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        fib.drop_fabric(fabric)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


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
    _child(lib, "mlx5_0:roce:4096,mlx5_1:roce:4096", code)


def test_the_emulated_nic_refuses_what_verbs_refuse(lib: Path) -> None:
    """Through the real pyverbs: REMOTE_WRITE without LOCAL_WRITE, RTS before RTR, a GID index
    past the table, a path MTU above the port's, and a CQ polled after it overran."""
    code = """
import ctypes
from pyverbs import addr, cq, device, mr, pd, qp, wr
from mooncake_connectors.transfer_core.transports.rdma.pyverbs_load import load
e = load("pyverbs").e  # the IBV_* constants of either module layout (<= 58 or 59+)
from pyverbs.pyverbs_error import PyverbsError
def refused(fn):
    try:
        fn()
    except PyverbsError:
        return True
    return False
ctx = device.Context(name="mlx5_0")
p = pd.PD(ctx)
buf = ctypes.create_string_buffer(4096)
at = ctypes.addressof(buf)
assert refused(lambda: mr.MR(p, 4096, e.IBV_ACCESS_REMOTE_WRITE, address=at))
m = mr.MR(p, 4096, 7, address=at)
c = cq.CQ(ctx, 2)
cap = qp.QPCap(max_send_wr=8, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
q = qp.QP(p, qp.QPInitAttr(qp_type=e.IBV_QPT_RC, scq=c, rcq=c, cap=cap))
a = qp.QPAttr(qp_state=e.IBV_QPS_RTS, cur_qp_state=e.IBV_QPS_RESET)
assert refused(lambda: q.modify(a, e.IBV_QP_STATE | e.IBV_QP_SQ_PSN))  # RESET -> RTS
a = qp.QPAttr(qp_state=e.IBV_QPS_INIT)
a.qp_access_flags = 7
q.to_init(a)
def rtr(sgid_index, mtu):
    a = qp.QPAttr(qp_state=e.IBV_QPS_RTR)
    a.path_mtu, a.dest_qp_num, a.rq_psn = mtu, q.qp_num, 0
    a.max_dest_rd_atomic, a.min_rnr_timer = 1, 1
    gr = addr.GlobalRoute(dgid=ctx.query_gid(1, 3), sgid_index=sgid_index)
    a.ah_attr = addr.AHAttr(is_global=1, port_num=1, gr=gr)
    q.to_rtr(a)
assert refused(lambda: rtr(4, 5))  # four GIDs: index 4 does not exist
assert refused(lambda: rtr(3, 6))  # no IBV_MTU above 4096
rtr(3, 5)  # a loopback QP, aimed at itself
a = qp.QPAttr(qp_state=e.IBV_QPS_RTS)
a.sq_psn, a.timeout, a.retry_cnt, a.rnr_retry, a.max_rd_atomic = 0, 14, 7, 7, 1
q.to_rts(a)
for i in range(3):
    sge = wr.SGE(at, 64, m.lkey)
    w = wr.SendWR(wr_id=i, opcode=e.IBV_WR_RDMA_WRITE, num_sge=1, sg=[sge],
                  send_flags=e.IBV_SEND_SIGNALED)
    w.set_wr_rdma(m.rkey, at + 1024)
    q.post_send(w)
assert refused(lambda: c.poll(4))  # three completions in a CQ of two: overrun
print("ok")
"""
    _child(lib, "mlx5_0:roce:4096", code)


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


def test_roce_v2_gid_is_probed_on_a_routed_fabric(pairs: list[Pair], lib: Path) -> None:
    """No gid_index set: index 0 is the RoCE v1 link-local GID, which a routed fabric drops
    (every WR would retry out, every rail cool down). Each NIC's RoCE v2 IPv4-mapped GID is
    found and used instead, so the data moves over rdma."""
    p = Pair(lib, "mlx5_0:roce:4096:routed", "mlx5_0:roce:4096:routed,mlx5_1:roce:4096:routed")
    pairs.append(p)
    p.a.call("transfer", op="write", peer=p.b.segment, local=p.addr_a, remote=p.addr_b, length=SPAN)
    assert _sha(p.b, p.addr_b, SPAN) == _sha(p.a, p.addr_a, SPAN)
    assert p.carried(p.a, p.b) > 0


def test_infiniband_keeps_gid_0_and_routes_by_lid(pairs: list[Pair], lib: Path) -> None:
    p = Pair(lib, "mlx5_0:ib:4096", "mlx5_0:ib:4096")
    pairs.append(p)
    p.a.call("transfer", op="write", peer=p.b.segment, local=p.addr_a, remote=p.addr_b, length=SPAN)
    assert _sha(p.b, p.addr_b, SPAN) == _sha(p.a, p.addr_a, SPAN)


def test_path_mtu_is_the_smaller_of_both_ends(pairs: list[Pair], lib: Path) -> None:
    """a's port runs MTU 4096, b's 1024 (a 1500-byte netdev). Using each side's own MTU, a's
    WRITEs are NAKed by b as invalid requests and b's READs get responses too long to accept;
    with the minimum both directions work."""
    p = Pair(lib, "mlx5_0:roce:4096:routed", "mlx5_0:roce:1024:routed", gid_index=3)
    pairs.append(p)
    n = 1 << 20
    p.a.call("transfer", op="write", peer=p.b.segment, local=p.addr_a, remote=p.addr_b, length=n)
    assert _sha(p.b, p.addr_b, n) == _sha(p.a, p.addr_a, n)
    p.b.call("transfer", op="read", peer=p.a.segment, local=p.addr_b + n, remote=p.addr_a, length=n)
    assert _sha(p.b, p.addr_b + n, n) == _sha(p.a, p.addr_a, n)


class BadTarget:
    """An rdma target that answers the connect exchange (no token) with a LID no port has:
    values a peer sends reach pyverbs, whose Cython setters raise OverflowError on them."""

    def __init__(self, reply: dict[str, Any]) -> None:
        self.reply = msgspec.msgpack.encode(reply)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(10)
                try:
                    conn.sendall(wire.HELLO.pack(wire.MAGIC, wire.VERSION, 0, 0, bytes(16)))
                    wire.recv_exact(conn, memoryview(bytearray(wire.AUTH.size)))
                    conn.sendall(wire.VERDICT.pack(wire.MAGIC, wire.VERDICT_OK, 0, bytes(32)))
                    head = bytearray(wire.REQ.size)
                    wire.recv_exact(conn, memoryview(head))
                    _, _, _, _, rid, _, length = wire.REQ.unpack(head)
                    wire.recv_exact(conn, memoryview(bytearray(length)))
                    resp = wire.RESP.pack(wire.RESP_MAGIC, wire.ST_OK, 0, 0, rid, len(self.reply))
                    conn.sendall(resp + self.reply)
                    conn.recv(1)  # until the initiator hangs up
                except (OSError, ConnectionError):
                    continue

    def publish(self, url: str, name: str) -> None:
        desc = SegmentDesc(
            name=name,
            host_id="another-host",
            pid=1,
            endpoints={"rdma": f"127.0.0.1:{self.port}"},
            regions=[RegionDesc(addr=1 << 40, length=SPAN, rdma_rkeys={"mlx5_0": 0x1234})],
            rdma_gids={"mlx5_0": "0000:0000:0000:0000:0000:ffff:0a00:0201"},
            rdma_lids={"mlx5_0": 0},
        )
        client = HttpClient(url, timeout=5, token=None)
        status, _ = client.request("PUT", {"key": SEGMENT_PREFIX + name}, encode_segment(desc))
        client.close()
        assert status in (200, 201, 204), status


def test_a_foreign_error_while_connecting_fails_the_rail(lib: Path) -> None:
    """The peer's LID is out of range: pyverbs raises OverflowError in the connect thread. The
    rail fails with that cause and cools down, instead of staying CONNECTING with its requests
    queued until the deadline says only that time ran out."""
    srv = MetadataHTTPServer("127.0.0.1", 0).start()
    bad = BadTarget({"qpn": 0x123, "psn": 1, "gid": "0" * 4 + ":0000" * 7, "lid": 1 << 20})
    fabric = fib.new_fabric()
    a = Peer(
        env=fib.env(lib, "mlx5_0:roce:4096", fabric, 1),
        metadata=srv.url,
        transports=["rdma"],
        timeout=3,
        backoff_initial=30.0,  # the failed rail stays cool for the rest of the test
        backoff_max=60.0,
    )
    try:
        bad.publish(srv.url, "bad-target")
        addr = a.call("alloc", kind="numpy", size=SPAN, seed=1)["addr"]
        with pytest.raises(AssertionError, match=r"cannot connect a QP.*lid=1048576"):
            a.call(
                "transfer", op="write", peer="bad-target", local=addr, remote=1 << 40, length=4096
            )
        stats = a.call("rail_stats", peer="bad-target")["stats"]
        assert [v["cooling"] for v in stats.values()] == [1.0], stats
    finally:
        a.close()
        bad.sock.close()
        srv.stop()
        fib.drop_fabric(fabric)


def test_a_failed_gpu_registration_leaves_nothing_registered(pairs: list[Pair], lib: Path) -> None:
    """c's GPU memory (the fake CUDA driver) cannot get an MR: ``gpu_mr="dmabuf"`` and its NIC
    imports no dma-buf. Registering it fails, and leaves nothing behind: before, the
    region stayed in the segment, every later publish tried its MR again and raised, so no
    other region could be registered or unregistered."""
    devs = "mlx5_0:roce:4096"
    p = Pair(lib, devs, devs, gid_index=3)
    pairs.append(p)
    c = Peer(
        env={**fib.env(lib, devs, p.fabric, 3), "FAKE_IBV_NO_DMABUF": "1"},
        metadata=p.srv.url,
        transports=["rdma"],
        transport_settings={"rdma": {"rail_timeout": 2.0, "gid_index": 3, "gpu_mr": "dmabuf"}},
        timeout=10,
        fake_cuda=True,
    )
    p.peers.append(c)
    with pytest.raises(AssertionError, match=r"ConfigError: registering"):
        c.call("alloc", kind="cuda", size=SPAN, seed=3)
    addr = c.call("alloc", kind="numpy", size=SPAN, seed=4)["addr"]  # raised here before
    p.a.call("transfer", op="write", peer=c.segment, local=p.addr_a, remote=addr, length=SPAN)
    assert _sha(c, addr, SPAN) == _sha(p.a, p.addr_a, SPAN)
    c.call("unregister", addr=addr)


def test_devices_that_cannot_carry_rc_are_skipped(lib: Path) -> None:
    """Of five devices only mlx5_0 joins: an iWARP RNIC (its QPs need the RDMA CM), an EFA
    device (unspecified link and transport: no RC), a port DOWN and a NIC with an empty GID
    table are each skipped with one log line naming it. Before, iWARP and EFA devices were
    opened and put in the mesh of rails."""
    code = """
import logging
from mooncake_connectors.config import EngineConfig
from mooncake_connectors.transfer_core import TransferEngine
from mooncake_connectors.transfer_core.metadata.http import MetadataHTTPServer
lines = []
class Keep(logging.Handler):
    def emit(self, record):
        lines.append(record.getMessage())
log = logging.getLogger("mooncake_connectors")
log.addHandler(Keep())
log.setLevel(logging.INFO)
srv = MetadataHTTPServer("127.0.0.1", 0).start()
eng = TransferEngine(EngineConfig(metadata=srv.url, transports=("rdma",))).start()
(t,) = [t for t in eng.transports if t.name == "rdma"]
assert sorted(t.nics) == ["mlx5_0"], sorted(t.nics)
skips = [line for line in lines if "skipping a device" in line]
for name, why in (("iw0", "transport type 1"), ("efa0", "transport type 4"),
                  ("mlx5_1", "not ACTIVE"), ("mlx5_2", "GID")):
    mine = [line for line in skips if f" {name} " in line]
    assert len(mine) == 1 and why in mine[0], (name, skips)
assert len(skips) == 4, skips
eng.close()
srv.stop()
print("ok")
"""
    devs = "mlx5_0:roce:4096,iw0:iwarp:4096,efa0:efa:4096,mlx5_1:roce:4096:down"
    devs += ",mlx5_2:roce:4096:nogid"
    _child(lib, devs, code)


def test_a_small_device_bounds_qps_and_the_cq(pairs: list[Pair], lib: Path) -> None:
    """A device with max_cqe 8, max_qp_wr 32 and 4 rd_atomic. Before, its CQ (4096) and rd_atomic
    (16) were refused and the NIC never opened. Now the caps are queried, and with every WR
    signalled no more WRs are outstanding than the CQ holds: posting max_wr (128) at once would
    overrun it, after which every poll fails and the NIC is lost."""
    devs = "mlx5_0:roce:4096,mlx5_1:roce:4096"
    caps = {"FAKE_IBV_MAX_CQE": "8", "FAKE_IBV_MAX_QP_WR": "32", "FAKE_IBV_MAX_RD_ATOM": "4"}
    p = Pair(lib, devs, devs, caps, gid_index=3, signal_every=1, slice_size=4096)
    pairs.append(p)
    p.a.call("transfer", op="write", peer=p.b.segment, local=p.addr_a, remote=p.addr_b, length=SPAN)
    assert _sha(p.b, p.addr_b, SPAN) == _sha(p.a, p.addr_a, SPAN)
    p.a.call("transfer", op="read", peer=p.b.segment, local=p.addr_a, remote=p.addr_b, length=SPAN)
    assert _sha(p.a, p.addr_a, SPAN) == _sha(p.b, p.addr_b, SPAN)
    stats = p.a.call("rail_stats", peer=p.b.segment)["stats"]
    assert sum(v["carried"] for v in stats.values()) >= 2 * SPAN // 4096, stats
    assert not any(v["cooling"] for v in stats.values()), stats


def test_passive_qps_of_initiators_gone_are_reaped(pairs: list[Pair], lib: Path) -> None:
    """b makes at most two QPs for peers (max_passive=2): a's, then c1's. c1 closes (its
    segment leaves the metadata); c2 connects, and b destroys c1's QP instead of refusing c2,
    which before stayed off rdma for good (here: with no tcp, its transfer failed). a's QP,
    whose initiator is alive, stays and still carries data. (Without direct QPs, which would
    take a second passive QP per initiator, made in the background.)"""
    devs = "mlx5_0:roce:4096"
    p = Pair(lib, devs, devs, gid_index=3, max_passive=2, direct_qps=False)
    pairs.append(p)

    def initiator(host: int) -> Peer:
        c = Peer(
            env=fib.env(lib, devs, p.fabric, host),
            metadata=p.srv.url,
            transports=["rdma"],
            transport_settings={"rdma": {"rail_timeout": 2.0, "gid_index": 3, "direct_qps": False}},
            timeout=10,
        )
        p.peers.append(c)
        return c

    p.a.call("transfer", op="write", peer=p.b.segment, local=p.addr_a, remote=p.addr_b, length=4096)
    c1 = initiator(3)
    addr1 = c1.call("alloc", kind="numpy", size=SPAN, seed=5)["addr"]
    c1.call("transfer", op="write", peer=p.b.segment, local=addr1, remote=p.addr_b, length=4096)
    c1.close()
    c2 = initiator(4)
    addr2 = c2.call("alloc", kind="numpy", size=SPAN, seed=6)["addr"]
    c2.call("transfer", op="write", peer=p.b.segment, local=addr2, remote=p.addr_b, length=SPAN)
    assert _sha(p.b, p.addr_b, SPAN) == _sha(c2, addr2, SPAN)
    p.a.call("transfer", op="write", peer=p.b.segment, local=p.addr_a, remote=p.addr_b, length=SPAN)
    assert _sha(p.b, p.addr_b, SPAN) == _sha(p.a, p.addr_a, SPAN)


@pytest.mark.parametrize(
    ("link", "env"),
    [
        ("roce:4096:routed", {"FAKE_IBV_TC": "106", "MC_IB_TC": "106"}),  # DSCP 26 << 2
        ("ib:4096", {"FAKE_IBV_SL": "3", "MC_IB_SL": "3"}),
    ],
)
def test_traffic_class_and_service_level_come_from_mc_ib_tc_and_sl(
    pairs: list[Pair], lib: Path, link: str, env: dict[str, str]
) -> None:
    """The fabric carries one class only (a PFC/ECN-configured RoCE fabric's lossless DSCP,
    an IB fabric's SL); the emulation drops the rest. MC_IB_TC / MC_IB_SL put every QP in it;
    before, QPs used traffic class 0 and SL 0, every WR retried out and nothing moved."""
    devs = f"mlx5_0:{link}"
    p = Pair(lib, devs, devs, env)
    pairs.append(p)
    p.a.call("transfer", op="write", peer=p.b.segment, local=p.addr_a, remote=p.addr_b, length=SPAN)
    assert _sha(p.b, p.addr_b, SPAN) == _sha(p.a, p.addr_a, SPAN)
    p.b.call("transfer", op="read", peer=p.a.segment, local=p.addr_b, remote=p.addr_a, length=SPAN)
    assert p.carried(p.a, p.b) > 0 and p.carried(p.b, p.a) > 0


def test_a_port_that_goes_down_is_left_out_until_it_is_back(pairs: list[Pair], lib: Path) -> None:
    """a's mlx5_0 loses its link after carrying data (a NIC retries 16 s here, retry scale 30).
    Before, nothing watched the port: its rails stayed up, and the next WRs posted on mlx5_0
    hung in retries until the engine gave up on them (the transfer took about 10 s more).
    Now the port's state is followed: its rails go down with it, the data takes mlx5_1 at
    once, and once the port is back mlx5_0 carries again."""
    devs = "mlx5_0:roce:4096,mlx5_1:roce:4096"
    slow = {"FAKE_IBV_RETRY_SCALE": "30"}
    p = Pair(lib, devs, "mlx5_0:roce:4096", slow, gid_index=3, rail_timeout=30.0)
    pairs.append(p)

    def write() -> dict[str, float]:
        p.a.call("transfer", op="write", peer=p.b.segment, local=p.addr_a, remote=p.addr_b,
                 length=SPAN, timeout=20)  # fmt: skip
        stats = p.a.call("rail_stats", peer=p.b.segment)["stats"]
        return {k: v["carried"] for k, v in stats.items()}

    first = write()
    assert first["mlx5_0>mlx5_0"] > 0 and first["mlx5_1>mlx5_0"] > 0, first
    down = fib.port_down_file(p.fabric, 1, "mlx5_0")
    down.touch()

    def cooling() -> bool:
        stats = p.a.call("rail_stats", peer=p.b.segment)["stats"]
        return bool(stats["mlx5_0>mlx5_0"]["cooling"])

    wait_until(cooling, 10, "a's mlx5_0 rail to go down with its port")
    second = write()
    assert second["mlx5_0>mlx5_0"] == first["mlx5_0>mlx5_0"], second
    assert second["mlx5_1>mlx5_0"] > first["mlx5_1>mlx5_0"], second
    assert _sha(p.b, p.addr_b, SPAN) == _sha(p.a, p.addr_a, SPAN)
    down.unlink()
    wait_until(lambda: write()["mlx5_0>mlx5_0"] > second["mlx5_0>mlx5_0"], 20, "mlx5_0 back")


@pytest.mark.parametrize("offset", [0, 12288])
def test_gpu_memory_gets_a_dma_buf_mr_addressed_by_its_iova(
    pairs: list[Pair], lib: Path, offset: int
) -> None:
    """b's GPU region (fake CUDA device memory, a memfd standing for its dma-buf) is registered
    with pyverbs' real DmaBufMR, which places it at iova = its offset in the dma-buf; peers
    address it from there (``rdma_iova``), and b addresses its own the same way when it
    writes from it. Before, DmaBufMR(iova=) raised TypeError and no GPU region ever got a
    dma-buf MR."""
    devs = "mlx5_0:roce:4096"
    p = Pair(lib, devs, devs, gid_index=3)
    pairs.append(p)
    c = Peer(
        env=fib.env(lib, devs, p.fabric, 3),
        metadata=p.srv.url,
        transports=["rdma"],
        transport_settings={"rdma": {"rail_timeout": 2.0, "gid_index": 3, "gpu_mr": "dmabuf"}},
        timeout=10,
        fake_cuda=True,
    )
    p.peers.append(c)
    gpu = c.call("alloc", kind="cuda", size=SPAN, seed=7)["addr"]
    n = SPAN - offset
    p.a.call("transfer", op="write", peer=c.segment, local=p.addr_a, remote=gpu + offset, length=n)
    assert _sha(c, gpu + offset, n) == _sha(p.a, p.addr_a, n)
    c.call("transfer", op="write", peer=p.b.segment, local=gpu, remote=p.addr_b, length=SPAN)
    assert _sha(p.b, p.addr_b, SPAN) == _sha(c, gpu, SPAN)
    assert c.call("fake_calls")["calls"].get("dmabuf_export", 0) >= 1


def _two_socket_sysfs(root: Path, swap: bool = False) -> Path:
    """A sysfs tree where mlx5_0 sits on NUMA node 0 and mlx5_1 on node 1 (other host bridge),
    or the other way round."""
    for name, path, numa in (
        ("mlx5_0", "pci0000:00/0000:00:01.0/0000:01:00.0", int(swap)),
        ("mlx5_1", "pci0000:80/0000:80:01.0/0000:81:00.0", int(not swap)),
    ):
        d = root / "devices" / path
        d.mkdir(parents=True)
        (d / "numa_node").write_text(f"{numa}\n")
        ib = root / "class" / "infiniband" / name
        ib.mkdir(parents=True)
        (ib / "device").symlink_to(d)
    return root


def test_the_remote_nic_is_the_one_nearest_the_remote_memory(
    pairs: list[Pair], lib: Path, tmp_path: Path
) -> None:
    """All memory here is on NUMA node 0 (by its pages). a's mlx5_0 is on node 0, b's mlx5_1
    is (b's tree is the other way round); b publishes that its region is nearest its mlx5_1
    (rdma_near). Every WR takes a's mlx5_0 to b's mlx5_1. Before, only the local side was
    chosen by topology; the remote NIC was whichever rail predicted the earliest finish, so
    about half the bytes reached b's memory through its far NIC."""
    devs = "mlx5_0:roce:4096,mlx5_1:roce:4096"
    sys_a, sys_b = _two_socket_sysfs(tmp_path / "a"), _two_socket_sysfs(tmp_path / "b", True)
    p = Pair(lib, devs, devs, None, {"sysfs": str(sys_b)}, gid_index=3, sysfs=str(sys_a))
    pairs.append(p)
    p.a.call("transfer", op="write", peer=p.b.segment, local=p.addr_a, remote=p.addr_b, length=SPAN)
    assert _sha(p.b, p.addr_b, SPAN) == _sha(p.a, p.addr_a, SPAN)
    stats = p.a.call("rail_stats", peer=p.b.segment)["stats"]
    carried = {k: v["carried"] for k, v in stats.items()}
    assert carried == {
        "mlx5_0>mlx5_0": 0,
        "mlx5_0>mlx5_1": SPAN // (64 << 10),
        "mlx5_1>mlx5_0": 0,
        "mlx5_1>mlx5_1": 0,
    }, carried


def test_host_memory_is_placed_by_its_pages_not_its_label(
    pairs: list[Pair], lib: Path, tmp_path: Path
) -> None:
    """a registers memory labelled ``cpu:1`` whose pages the kernel put on node 0 (this host
    has one node); the sysfs tree says mlx5_0 is on node 0. The NICs near it are found from the
    pages (move_pages), on both ends: every WR takes mlx5_0 to mlx5_0. Before, the label chose
    (a's mlx5_1), and unlabelled memory counted as node 0 wherever its pages were."""
    if Path("/sys/devices/system/node/node1").exists():
        pytest.skip("more than one NUMA node here: the pages' node is not known in advance")
    from mooncake_connectors.transfer_core.transports.rdma import topology

    probe = bytearray(b"x" * 8192)  # any address of this heap: is move_pages answered here?
    if hasattr(topology, "page_node") and topology.page_node(id(probe), 1) < 0:
        pytest.skip("the kernel does not report NUMA nodes of pages here")
    devs = "mlx5_0:roce:4096,mlx5_1:roce:4096"
    p = Pair(lib, devs, devs, gid_index=3, sysfs=str(_two_socket_sysfs(tmp_path)))
    pairs.append(p)
    mine = p.a.call("alloc", kind="numpy", size=SPAN, seed=9, location="cpu:1")["addr"]
    p.a.call("transfer", op="write", peer=p.b.segment, local=mine, remote=p.addr_b, length=SPAN)
    assert _sha(p.b, p.addr_b, SPAN) == _sha(p.a, mine, SPAN)
    stats = p.a.call("rail_stats", peer=p.b.segment)["stats"]
    carried = {k: v["carried"] for k, v in stats.items()}
    assert carried["mlx5_0>mlx5_0"] == SPAN // (64 << 10), carried
