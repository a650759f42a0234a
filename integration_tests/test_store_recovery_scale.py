"""Recovery at scale: a store server holding 10^5 objects with 4 KiB keys re-reports them all
to a restarted master and to a new HA leader. Its holdings are about 420 MB of keys, several
times the master's 64 MiB frame limit: reports sized in parts alone made one frame too large,
the master closed the connection, and it recovered nothing."""

from __future__ import annotations

import random
import uuid

import pytest
from helpers import EtcdServer, wait_until
from store_cluster import Proc, client, start_master, start_server, wait_servers

from mooncake_connectors.store import StoreClient
from mooncake_connectors.store.ha import LeaderResolver

N = 100_000
BATCH = 5_000  # 5,000 keys of 4 KiB: a 21 MB put, well under the frame limit
# a long server_ttl: the test is about recovery, not liveness on a loaded machine
TIMERS = ["--heartbeat-interval", "0.5", "--server-ttl", "10", "--read-lease-ttl", "1.0"]


def key(i: int) -> str:
    return f"{i:08d}".ljust(4096, "k")


def fill(c: StoreClient) -> None:
    for start in range(0, N, BATCH):
        keys = [key(i) for i in range(start, min(N, start + BATCH))]
        results = c.put_batch(keys, [b"v"] * len(keys))
        failed = [r for r in results if r is not None]
        assert not failed, f"{len(failed)} puts failed, e.g. {failed[0]!r}"
    assert c.stats()["keys"] == N
    # The holdings deltas are pushed before each put is answered, but a 21 MB push can still
    # sit in the master's buffer when the answer goes out: the kill waits until it is written.
    wait_until(lambda: c.stats()["unsent_bytes"] == 0, 30, "the holdings pushes to go out")


def all_known(c: StoreClient, procs: list[Proc]) -> None:
    """Every object is known again: the master's count, and a sample read back."""
    try:
        wait_until(lambda: c.stats()["keys"] == N, 120, f"{N} keys known to the master")
    except AssertionError:
        print("\n=====\n".join(p.output() for p in procs))
        raise
    sample = [key(i) for i in random.Random(3).sample(range(N), 200)]
    assert all(c.batch_exists(sample))
    assert c.get_batch(sample[:20]) == [b"v"] * 20


@pytest.mark.slow
def test_a_restarted_master_recovers_every_object_of_a_server_with_long_keys() -> None:
    m, addr = start_master(*TIMERS)
    port = int(addr.rsplit(":", 1)[1])
    s = start_server(addr, "64M")
    try:
        with client(addr, timeout=60) as c:
            wait_servers(c, 1)
            fill(c)
            m.kill()
            m, _ = start_master(*TIMERS, port=port)
            all_known(c, [m, s])
    finally:
        s.close()
        m.close()


@pytest.mark.slow
@pytest.mark.etcd
def test_a_new_leader_recovers_every_object_of_a_server_with_long_keys(etcd: EtcdServer) -> None:
    url = f"{etcd.url}/ha-{uuid.uuid4().hex[:8]}"
    args = (*TIMERS, "--ha", url, "--ha-lease-ttl", "2.0", "--metadata", url)
    masters = [start_master(*args)[0], start_master(*args)[0]]
    s = start_server(url, "64M")
    try:
        with client(url, timeout=60) as c:
            wait_servers(c, 1)
            fill(c)
            resolver = LeaderResolver(url, 2.0)
            try:
                first = resolver.leader()
            finally:
                resolver.close()
            assert first is not None
            victim = next(p for p in masters if first.endswith(":" + p.args[2]))
            victim.kill()  # the standby takes over, starts empty, and hears from the server
            all_known(c, [*masters, s])
    finally:
        s.close()
        for p in masters:
            p.close()
