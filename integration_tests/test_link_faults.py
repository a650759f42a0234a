"""Lossy, slow and cut links (a userspace relay: this kernel may lack tc netem; see
mooncake_connectors/bench/faultlink.py for what the relay reproduces and what it cannot).

Every operation either completes with the right bytes or fails with a typed error within its
deadline (plus a margin for a loaded machine: this checks the deadline, not speed), and a
healed partition recovers without restarting anything."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from helpers import EtcdServer, pattern
from store_cluster import FAST, client, start_master, start_server, wait_servers

from mooncake_connectors.bench.faultlink import FaultLink
from mooncake_connectors.config import EngineConfig
from mooncake_connectors.errors import MooncakeConnectorsError
from mooncake_connectors.store.ha import LeaderResolver
from mooncake_connectors.transfer_core import TransferEngine
from mooncake_connectors.transfer_core.descriptor import decode_segment, encode_segment
from mooncake_connectors.transfer_core.metadata.base import SEGMENT_PREFIX

MARGIN = 2.0
MiB = 1 << 20
TIMEOUT = 3.0


class TePair:
    """Two engines in this process whose tcp traffic goes through a FaultLink: the target's
    published descriptor names the relay's address instead of its own."""

    def __init__(self) -> None:
        ns = f"memory://lf-{uuid.uuid4().hex[:8]}"
        cfg = {"metadata": ns, "transports": ("tcp",), "timeout": TIMEOUT}
        self.target = TransferEngine(EngineConfig(**cfg)).start()  # type: ignore[arg-type]
        self.src = pattern(7, 4 * MiB)
        self.target.register(self.src)
        self.sink = np.zeros(4 * MiB, dtype=np.uint8)
        self.target.register(self.sink)
        md = self.target.metadata
        assert md is not None
        key = SEGMENT_PREFIX + self.target.segment_name
        desc = decode_segment(md.get(key) or b"")
        host, port = desc.endpoints["tcp"].rsplit(":", 1)
        self.link = FaultLink((host, int(port)))
        relayed = {**desc.endpoints, "tcp": self.link.address}
        md.put(key, encode_segment(type(desc)(**{**_fields(desc), "endpoints": relayed})))
        self.client = TransferEngine(EngineConfig(**cfg)).start()  # type: ignore[arg-type]
        self.dst = np.zeros(4 * MiB, dtype=np.uint8)
        self.client.register(self.dst)

    def read(self, n: int, timeout: float = TIMEOUT) -> bool:
        """Read n bytes; True when they arrived right, False on a typed error; never a hang."""
        self.dst[:n] = 0
        return self._move(self.client.read, self.src, n, timeout, self.dst, self.src)

    def write(self, n: int, timeout: float = TIMEOUT) -> bool:
        self.dst[:n] = pattern(n % 251, n)
        return self._move(self.client.write, self.sink, n, timeout, self.sink, self.dst)

    def _move(
        self,
        op: Callable[..., None],
        remote: np.ndarray,
        n: int,
        timeout: float,
        got: np.ndarray,
        want: np.ndarray,
    ) -> bool:
        t0 = time.monotonic()
        try:
            op(
                self.target.segment_name,
                self.dst.ctypes.data,
                remote.ctypes.data,
                n,
                timeout=timeout,
            )
        except MooncakeConnectorsError:
            assert time.monotonic() - t0 < timeout + MARGIN
            return False
        assert time.monotonic() - t0 < timeout + MARGIN
        assert np.array_equal(got[:n], want[:n]), "wrong bytes"
        return True

    def close(self) -> None:
        self.client.close()
        self.link.close()
        self.target.close()


def _fields(desc: object) -> dict[str, object]:
    return {f: getattr(desc, f) for f in desc.__struct_fields__}  # type: ignore[attr-defined]


@pytest.fixture
def te() -> Iterator[TePair]:
    p = TePair()
    yield p
    p.close()


@pytest.mark.parametrize(
    ("delay", "jitter", "loss"),
    [(0.0, 0.0, 0.01), (0.0, 0.0, 0.10), (0.05, 0.02, 0.0), (0.02, 0.03, 0.05)],
    ids=["loss1pct", "loss10pct", "delay50ms-jitter", "reorder-like-jitter+loss5pct"],
)
def test_te_batches_on_a_bad_link_complete_right_or_fail_typed(
    te: TePair, delay: float, jitter: float, loss: float
) -> None:
    te.link.shape(delay=delay, jitter=jitter, loss=loss)
    ok = 0
    for i in range(12):
        n = [4096, 300_000, 2 * MiB][i % 3]
        ok += te.read(n) + te.write(n)
    assert ok >= 12  # a bad link, not a dead one: most succeed (each one was checked above)
    assert te.link.connections >= 1


def test_te_partition_that_heals_recovers_without_restart(te: TePair) -> None:
    assert te.read(64 * 1024)
    te.link.partition()
    assert not te.read(64 * 1024, timeout=1.5)  # typed error within its deadline
    assert not te.write(4096, timeout=1.5)
    te.link.heal()
    deadline = time.monotonic() + 20
    while not te.read(64 * 1024):  # the same engines: a new connection after the failed one
        assert time.monotonic() < deadline, "no recovery after the partition healed"
    assert te.write(MiB)


def test_te_partition_that_never_heals_fails_every_call_in_time(te: TePair) -> None:
    assert te.read(4096)
    te.link.partition()
    for _ in range(3):
        assert not te.read(4096, timeout=1.0)
        assert not te.write(4096, timeout=1.0)


def test_store_through_a_bad_then_cut_then_healed_link_to_the_master() -> None:
    """Clients and servers reach the master through the relay; puts with 2 replicas and gets
    under delay and loss, then a partition: typed errors in time; healed: everything back, and
    every acknowledged put reads back exact."""
    m, addr = start_master(*FAST)
    host, port = addr.rsplit(":", 1)
    link = FaultLink((host, int(port)))
    servers = [start_server(link.address, "16M") for _ in range(3)]
    try:
        with client(link.address, timeout=TIMEOUT) as c:
            wait_servers(c, 3)
            acked: dict[str, bytes] = {}
            link.shape(delay=0.05, jitter=0.02, loss=0.05)
            for i in range(24):
                k, v = f"lf{i}", pattern(i, 5000 + i * 100).tobytes()
                t0 = time.monotonic()
                try:
                    c.put(k, v, replicas=2)
                    acked[k] = v
                except MooncakeConnectorsError:
                    pass
                assert time.monotonic() - t0 < 2 * TIMEOUT + MARGIN
            assert len(acked) >= 12
            assert c.get_batch(list(acked)) == list(acked.values())
            link.partition()
            t0 = time.monotonic()
            with pytest.raises(MooncakeConnectorsError):
                c.put("cut", b"x" * 100, replicas=2)
            assert time.monotonic() - t0 < 2 * TIMEOUT + MARGIN
            link.heal()
            link.shape()
            deadline = time.monotonic() + 30
            while True:
                try:
                    if c.get_batch(list(acked)) == list(acked.values()):
                        break
                except MooncakeConnectorsError:
                    pass
                assert time.monotonic() < deadline, "the store did not recover after healing"
                time.sleep(0.2)
            c.put("after", b"ok", replicas=2)
            assert c.get("after") == b"ok"
    finally:
        for s in servers:
            s.close()
        link.close()
        m.close()


@pytest.mark.etcd
def test_ha_failover_over_a_lossy_slow_link_to_etcd(etcd: EtcdServer) -> None:
    """Masters, servers and the client reach etcd (election, leader key, metadata) through the
    relay, with 50 +- 20 ms delay and 5 % loss; the leader is killed mid-workload: the standby
    takes over, every call ends right or typed within its deadline, and no acknowledged put is
    lost."""
    link = FaultLink(("127.0.0.1", etcd.client_port))
    url = f"etcd://{link.address}/lf-{uuid.uuid4().hex[:8]}"
    args = (*FAST, "--ha", url, "--ha-lease-ttl", "2.0", "--metadata", url)
    masters = [start_master(*args)[0], start_master(*args)[0]]
    servers = [start_server(url, "32M") for _ in range(2)]
    try:
        with client(url, timeout=TIMEOUT * 2) as c:
            wait_servers(c, 2)
            link.shape(delay=0.05, jitter=0.02, loss=0.05)
            acked: dict[str, bytes] = {}
            first = _leader(url)
            assert first is not None
            for i in range(60):
                if i == 20:
                    victim = next(m for m in masters if first.endswith(m.args[2]))
                    victim.kill()
                k, v = f"ha{i}", pattern(i, 3000 + i).tobytes()
                t0 = time.monotonic()
                try:
                    c.put(k, v, replicas=2)
                    acked[k] = v
                except MooncakeConnectorsError:
                    pass
                assert time.monotonic() - t0 < 3 * TIMEOUT * 2 + MARGIN
            assert _leader(url) not in (None, first)
            assert len(acked) >= 30
            link.shape()
            wait_servers(c, 2)
            got = c.get_batch(list(acked))
            lost = [k for k, g in zip(acked, got, strict=True) if g != acked[k]]
            assert not lost, f"acknowledged puts lost: {lost[:5]}"
    finally:
        for p in servers + masters:
            p.close()
        link.close()


def _leader(url: str) -> str | None:
    r = LeaderResolver(url, 5.0)
    try:
        return r.leader()
    finally:
        r.close()
