"""The rdma transport on the test-only Python stand-in for pyverbs (tests/fake_verbs.py): two
NICs in this process, two in the peer process, so four rails. What needs faults injected from
the test into this process's NICs (weights from per-request latency, error completions, QPs
forced to ERR, a vanishing NIC, requests outlasting a rail timeout or a deadline), a slice
submitted to the transport object itself, and the control listener. Spraying, falling back to
tcp, a stale rkey and the errors at start run over the real pyverbs and the emulated NIC
instead (test_rdma_fake_ibverbs_engine.py, .venv-rdma)."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from typing import Any

import fake_nic
import fake_verbs
import msgspec
import numpy as np
import pytest
from helpers import Peer, pattern

from mooncake_connectors.config import EngineConfig
from mooncake_connectors.errors import AccessViolation, ConfigError
from mooncake_connectors.transfer_core import TransferEngine, TransferRequest
from mooncake_connectors.transfer_core.metadata.http import MetadataHTTPServer
from mooncake_connectors.transfer_core.transport import Slice
from mooncake_connectors.transfer_core.transports.rdma import RdmaTransport
from mooncake_connectors.types import TransferOp

FAKE = {"verbs": "fake_verbs"}
SPAN = 4 << 20
NICS = ("mlx5_0", "mlx5_1")


@pytest.fixture(scope="module", autouse=True)
def _own_fabric() -> Iterator[None]:
    # configure() changes this process's environment, which later modules' peers inherit.
    with fake_nic.isolated():
        yield


@pytest.fixture(scope="module")
def peer() -> Iterator[tuple[Peer, str, int]]:
    srv = MetadataHTTPServer("127.0.0.1", 0).start()
    p = Peer(metadata=srv.url, transports=["rdma", "tcp"], transport_settings={"rdma": FAKE})
    addr = p.call("alloc", kind="numpy", size=SPAN, seed=1)["addr"]
    yield p, srv.url, addr
    p.close()
    srv.stop()


def _engine(url: str, *transports: str, **rdma: Any) -> TransferEngine:
    return TransferEngine(
        EngineConfig(
            metadata=url,
            transports=transports or ("rdma",),
            transport_settings={"rdma": {**FAKE, **rdma}},
            timeout=20,
            backoff_initial=5.0,  # a failed rail stays cool for the rest of the test
            backoff_max=10.0,
        )
    ).start()


@pytest.fixture
def link(peer: tuple[Peer, str, int]) -> Iterator[tuple[TransferEngine, Peer, int, Any]]:
    fake_verbs.configure(",".join(NICS))
    p, url, addr = peer
    e = _engine(url)
    buf = np.zeros(SPAN, dtype=np.uint8)
    e.register(buf)
    yield e, p, addr, buf
    e.close()


def _rdma(e: TransferEngine) -> RdmaTransport:
    t = next(t for t in e.transports if t.name == "rdma")
    assert isinstance(t, RdmaTransport)
    return t


def _sha(a: Any) -> str:
    return hashlib.sha256(bytes(a)).hexdigest()


def _roundtrip(e: TransferEngine, p: Peer, addr: int, buf: Any, n: int, seed: int) -> None:
    buf[:n] = pattern(seed, n)
    want = _sha(buf[:n])
    e.write(p.segment, int(buf.ctypes.data), addr, n)
    assert p.call("digest", addr=addr, length=n)["sha"] == want
    buf[:n] = 0
    e.read(p.segment, int(buf.ctypes.data), addr, n)
    assert _sha(buf[:n]) == want


def _carried(e: TransferEngine, p: Peer, nic: str) -> float:
    stats = _rdma(e).rail_stats(p.segment)
    return sum(v["carried"] for k, v in stats.items() if k.startswith(nic + ">"))


def test_weights_follow_measured_throughput(link: Any) -> None:
    e, p, addr, buf = link
    fake_verbs.device("mlx5_1").latency = 0.01  # one NIC 10 ms per request: a slow rail
    for i in range(4):
        _roundtrip(e, p, addr, buf, 1 << 20, i)
    slow, fast = _carried(e, p, "mlx5_1"), _carried(e, p, "mlx5_0")
    assert slow * 3 < fast, (slow, fast)


def test_error_completion_cools_the_rail_and_the_slice_moves(link: Any) -> None:
    e, p, addr, buf = link
    _roundtrip(e, p, addr, buf, 1 << 20, 1)  # rails connected
    fake_verbs.device("mlx5_0").fail(2)  # the next two requests sent from mlx5_0 fail
    _roundtrip(e, p, addr, buf, 1 << 20, 2)
    stats = _rdma(e).rail_stats(p.segment)
    assert any(v["cooling"] for k, v in stats.items() if k.startswith("mlx5_0>")), stats
    assert not any(v["cooling"] for k, v in stats.items() if k.startswith("mlx5_1>")), stats
    assert not fake_verbs.device("mlx5_0").failures  # both failures were met


def test_qp_in_error_state_moves_its_requests(link: Any) -> None:
    e, p, addr, buf = link
    _roundtrip(e, p, addr, buf, 1 << 20, 1)
    fake_verbs.device("mlx5_1").qps_to_error()  # flushes whatever is posted there next
    _roundtrip(e, p, addr, buf, 2 << 20, 2)
    stats = _rdma(e).rail_stats(p.segment)
    assert any(v["cooling"] for k, v in stats.items() if k.startswith("mlx5_1>")), stats


def test_a_vanishing_nic_leaves_the_others_serving(link: Any) -> None:
    e, p, addr, buf = link
    _roundtrip(e, p, addr, buf, 1 << 20, 1)
    fake_verbs.device("mlx5_0").vanish()
    before = _carried(e, p, "mlx5_0")
    for i in range(3):
        _roundtrip(e, p, addr, buf, 1 << 20, 10 + i)
    assert _carried(e, p, "mlx5_0") == before
    assert _carried(e, p, "mlx5_1") > 0


def _slice(e: TransferEngine, p: Peer, buf: Any, addr: int, n: int, grow: int) -> Any:
    """Submit one READ slice to the transport directly, its region claiming ``grow`` bytes more
    than the peer registered (a descriptor the NIC must not trust); returns its outcome."""
    t = _rdma(e)
    desc = e.peer(p.segment)
    region = desc.find_region(addr, 1)
    assert region is not None
    out: list[Any] = []
    s = Slice(
        TransferOp.READ,
        int(buf.ctypes.data),
        addr,
        n,
        time.monotonic() + 10,
        lambda _s, err: out.append(err),
    )
    s.region = msgspec.structs.replace(region, length=region.length + grow)
    t.submit(desc, [s])
    end = time.monotonic() + 10
    while not out and time.monotonic() < end:
        time.sleep(0.01)
    assert out, "the slice never completed"
    return out[0]


def test_bounds_are_checked_by_the_nic(link: Any) -> None:
    e, p, addr, buf = link
    assert _slice(e, p, buf, addr, 4096, 0) is None
    err = _slice(e, p, buf, addr + SPAN - 4096, 8192, 1 << 20)  # past the peer's MR
    assert isinstance(err, AccessViolation), err
    assert _slice(e, p, buf, addr, 4096, 0) is None  # the rail reconnects and serves


def test_deregistration_waits_for_requests_in_flight(peer: tuple[Peer, str, int]) -> None:
    fake_verbs.configure(",".join(NICS))
    p, url, addr = peer
    e = _engine(url)
    try:
        buf = np.zeros(1 << 20, dtype=np.uint8)
        region = e.register(buf)
        e.write(p.segment, int(buf.ctypes.data), addr, 4096)  # rails connected
        for nic in NICS:
            fake_verbs.device(nic).latency = 0.02
        buf[:] = pattern(6, buf.size)
        batch = e.submit(
            [TransferRequest(TransferOp.WRITE, p.segment, int(buf.ctypes.data), addr, buf.size)]
        )
        e.unregister(region)
        assert batch.done()  # unregister returned only once the NICs were done with it
        batch.raise_for_status()
        assert p.call("digest", addr=addr, length=buf.size)["sha"] == _sha(buf)
        assert not any(fake_verbs.device(n).lkeys for n in NICS)  # and its MRs are gone
    finally:
        e.close()


def test_without_pyverbs_the_error_says_how_to_install_it(peer: tuple[Peer, str, int]) -> None:
    try:
        import pyverbs  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("pyverbs is importable here")
    with pytest.raises(ConfigError, match="python3-pyverbs"):
        _engine(peer[1], verbs="pyverbs")


def test_the_control_listener_refuses_data_and_garbage(link: Any) -> None:
    from mooncake_connectors.transfer_core.transports import wire
    from mooncake_connectors.transfer_core.transports.tcp import open_connection

    e, p, addr, _ = link
    t = _rdma(e)
    endpoint = e.peer(p.segment).endpoints["rdma"]
    deadline = time.monotonic() + 10

    def ask(op: int, payload: bytes, length: int | None = None) -> tuple[int, bytes]:
        sock = open_connection(t.ctx, p.segment, endpoint, "test", deadline)
        try:
            n = len(payload) if length is None else length
            wire.send_until(sock, [wire.REQ.pack(wire.REQ_MAGIC, op, 0, 0, 1, addr, n) + payload],
                            deadline)  # fmt: skip
            hdr = bytearray(wire.RESP.size)
            wire.recv_until(sock, memoryview(hdr), deadline)
            _, status, _, _, _, k = wire.RESP.unpack(hdr)
            body = bytearray(k)
            wire.recv_until(sock, memoryview(body), deadline)
            return status, bytes(body)
        finally:
            sock.close()

    assert ask(wire.OP_READ, b"", 16)[0] == wire.ST_PROTOCOL  # no data on this listener
    status, why = ask(wire.OP_CONTROL, b"\xc1garbage")
    assert status == wire.ST_PROTOCOL and b"connect request" in why
    status, _ = ask(wire.OP_CONTROL, b"", wire.MAX_CONTROL + 1)
    assert status == wire.ST_PROTOCOL
    _roundtrip(e, p, addr, link[3], 1 << 16, 9)  # the peer still serves


def test_a_rail_owing_completions_past_its_timeout_is_failed(peer: tuple[Peer, str, int]) -> None:
    fake_verbs.configure(",".join(NICS))
    p, url, addr = peer
    e = _engine(url, rail_timeout=0.2)
    try:
        buf = np.zeros(1 << 20, dtype=np.uint8)
        e.register(buf)
        _roundtrip(e, p, addr, buf, 1 << 20, 1)
        fake_verbs.device("mlx5_0").latency = 1.0  # each request there takes longer than 0.2 s
        _roundtrip(e, p, addr, buf, 1 << 20, 2)
        stats = _rdma(e).rail_stats(p.segment)
        assert any(v["cooling"] for k, v in stats.items() if k.startswith("mlx5_0>")), stats
    finally:
        e.close()


def test_a_missed_deadline_lands_no_late_bytes(peer: tuple[Peer, str, int]) -> None:
    from helpers import wait_until

    from mooncake_connectors.errors import TransferTimeout

    fake_verbs.configure(",".join(NICS))
    p, url, _ = peer
    target = p.call("alloc", kind="numpy", size=1 << 20, seed=8)["addr"]
    before = p.call("digest", addr=target, length=1 << 20)["sha"]
    e = _engine(url, rail_timeout=30.0)
    try:
        buf = np.full(1 << 20, 0xAB, dtype=np.uint8)
        e.register(buf)
        e.read(p.segment, int(buf.ctypes.data), target, 4096)  # rails connected
        for n in NICS:
            fake_verbs.device(n).latency = 0.5  # every request outlasts the deadline below
        with pytest.raises(TransferTimeout):
            e.write(p.segment, int(buf.ctypes.data), target, 1 << 20, timeout=0.3)
        # what the NICs had taken up finishes after the deadline: flushed, not written
        wait_until(
            lambda: not any(fake_verbs.device(n).in_flight for n in NICS),
            20,
            "the emulated NICs to finish the requests they had taken up",
        )
        assert p.call("digest", addr=target, length=1 << 20)["sha"] == before
    finally:
        e.close()


def test_rdma_beside_tcp_on_a_fixed_port(peer: tuple[Peer, str, int]) -> None:
    from helpers import free_port

    fake_verbs.configure(",".join(NICS))
    port = free_port()
    cfg = EngineConfig(
        metadata=peer[1],
        port=port,
        transports=("rdma", "tcp"),
        transport_settings={"rdma": FAKE},
    )
    with TransferEngine(cfg) as e:
        desc = e.peer(e.segment_name)
        assert desc.endpoints["tcp"].endswith(f":{port}")
        assert not desc.endpoints["rdma"].endswith(f":{port}")  # its own listener


class _ConnectRequestBefore(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The connect request as versions before direct QPs decode it."""

    segment: str
    nic: str
    peer_nic: str
    qpn: int
    psn: int
    gid: str
    lid: int
    mtu: int = 0


def test_a_rails_connect_request_is_what_older_versions_decode() -> None:
    """A rail's connect request carries no ``direct`` field, so a peer of an earlier version
    connects it as before; a direct QP's request is refused there (an unknown field), which
    leaves that peer's direct QPs off and its rails working."""
    from mooncake_connectors.transfer_core.transports.rdma import control

    args = ("a", "mlx5_0", "mlx5_1", 7, 9, "fe80::1", 0, 5)
    enc = msgspec.msgpack.Encoder()
    rail = enc.encode(control.ConnectRequest(*args))
    assert msgspec.msgpack.decode(rail, type=_ConnectRequestBefore) == _ConnectRequestBefore(*args)
    direct = enc.encode(control.ConnectRequest(*args, direct=True))
    with pytest.raises(msgspec.ValidationError, match="direct"):
        msgspec.msgpack.decode(direct, type=_ConnectRequestBefore)
    assert control.decode_request(direct).direct and not control.decode_request(rail).direct
