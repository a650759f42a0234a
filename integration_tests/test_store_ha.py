"""Store HA with a real etcd: the leader master killed under a workload, and etcd itself stopped
and restarted while the store keeps serving."""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from helpers import EtcdServer, pattern, wait_until
from store_cluster import FAST, Proc, client, start_master, start_server, wait_servers

from mooncake_connectors.errors import MooncakeConnectorsError
from mooncake_connectors.store import StoreClient
from mooncake_connectors.store.ha import LeaderResolver

pytestmark = pytest.mark.etcd
TTL = 2.0


@dataclass
class Workload:
    """Puts fresh keys and reads back acknowledged ones, counting what happens."""

    c: StoreClient
    acked: dict[str, bytes] = field(default_factory=dict)
    ops: int = 0
    failed_puts: int = 0
    misses: int = 0
    corrupt: int = 0
    stop: threading.Event = field(default_factory=threading.Event)
    errors: list[str] = field(default_factory=list)

    def run(self) -> None:
        rng = random.Random(1)
        i = 0
        while not self.stop.is_set():
            key = f"w{i}"
            v = pattern(i, rng.choice([100, 4096, 16_000]))
            try:
                self.c.put(key, v, replicas=2)
                self.acked[key] = v.tobytes()
            except MooncakeConnectorsError as exc:
                self.failed_puts += 1
                self.errors.append(f"{time.monotonic():.2f} {exc}")
            k = rng.choice(list(self.acked)) if self.acked else key
            got = self.c.get(k)
            if got is None:
                self.misses += 1
            elif got != self.acked.get(k, got):
                self.corrupt += 1
            self.ops += 1
            i += 1


@pytest.fixture
def ha(etcd: EtcdServer) -> Iterator[tuple[str, list[Proc], list[Proc]]]:
    url = f"{etcd.url}/ha-{uuid.uuid4().hex[:8]}"
    args = (*FAST, "--ha", url, "--ha-lease-ttl", str(TTL), "--metadata", url)
    masters: list[Proc] = []
    servers: list[Proc] = []
    try:
        masters.append(start_master(*args)[0])
        masters.append(start_master(*args)[0])
        servers.extend(start_server(url, "96M") for _ in range(2))
        yield url, masters, servers
    finally:
        for p in servers + masters:
            p.close()


def leader(url: str) -> str | None:
    r = LeaderResolver(url, 2.0)
    try:
        return r.leader()
    finally:
        r.close()


def run_workload(c: StoreClient) -> tuple[Workload, threading.Thread]:
    w = Workload(c)
    t = threading.Thread(target=w.run, daemon=True)
    t.start()
    return w, t


def test_killed_leader_standby_takes_over_and_nothing_is_lost(
    ha: tuple[str, list[Proc], list[Proc]],
) -> None:
    url, masters, servers = ha
    with client(url, timeout=20) as c:
        wait_servers(c, 2)
        first = leader(url)
        assert first is not None
        w, t = run_workload(c)
        try:
            wait_until(lambda: w.ops >= 100, 60, "workload before the kill")
            victim = next(m for m in masters if first.endswith(m.args[2]))
            victim.kill()
            killed = time.monotonic()
            wait_until(lambda: leader(url) not in (None, first), 4 * TTL, "a new leader")
            took = time.monotonic() - killed
            assert took <= 2 * TTL, f"standby took {took:.2f}s to lead (lease TTL {TTL}s)"
            resumed = len(w.acked)
            wait_until(lambda: len(w.acked) >= resumed + 100, 60, "the workload to resume")
        finally:
            w.stop.set()
            t.join(60)
        assert w.corrupt == 0
        wait_servers(c, 2)  # both re-reported to the new leader
        got = c.get_batch(list(w.acked))
        lost = [k for k, v in zip(w.acked, got, strict=True) if v != w.acked[k]]
        if lost:
            print("\n=====\n".join(p.output() for p in masters + servers))
        assert not lost, f"{len(lost)} acknowledged objects lost, e.g. {lost[:5]}"
        assert w.failed_puts == 0, w.errors[:5]


def test_etcd_outage_and_restart_keep_the_store_serving(
    etcd: EtcdServer, ha: tuple[str, list[Proc], list[Proc]]
) -> None:
    url, masters, servers = ha
    with client(url, timeout=20) as c:
        try:
            wait_servers(c, 2)
        except AssertionError:
            print("\n=====\n".join(p.output() for p in masters + servers))
            raise
        first = leader(url)
        w, t = run_workload(c)
        try:
            wait_until(lambda: w.ops >= 50, 60, "workload before the outage")
            etcd.stop()
            during = w.ops
            wait_until(lambda: w.ops >= during + 100, 60, "the workload while etcd is down")
            etcd.start()
            after = w.ops
            wait_until(lambda: w.ops >= after + 100, 60, "the workload after etcd returns")
        finally:
            if etcd.proc is None:
                etcd.start()
            w.stop.set()
            t.join(60)
        assert leader(url) == first  # the leader kept its lease through the outage
        assert w.corrupt == 0 and w.failed_puts == 0 and w.misses == 0
        assert c.get_batch(list(w.acked)) == list(w.acked.values())
