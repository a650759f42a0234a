"""Restart survival: a single (non-HA) master killed the instant a put is acknowledged, then
restarted on its address, rebuilds its index from what the servers re-report, and no
acknowledged put is lost (the holdings deltas reach the servers before the put's answer)."""

from __future__ import annotations

from helpers import pattern
from store_cluster import FAST, client, start_master, start_server, wait_servers


def test_master_killed_right_after_an_ack_loses_no_acknowledged_put() -> None:
    m, addr = start_master(*FAST)
    port = int(addr.rsplit(":", 1)[1])
    servers = [start_server(addr, "16M") for _ in range(2)]
    try:
        with client(addr, timeout=20) as c:
            wait_servers(c, 2)
            acked = {}
            for i in range(40):
                k, v = f"a{i}", pattern(i, 2000 + i).tobytes()
                c.put(k, v, replicas=1 + i % 2)
                acked[k] = v
            m.kill()  # no wait for the next tick: the last puts' deltas must already be out
            m, _ = start_master(*FAST, port=port)
            wait_servers(c, 2)
            got = c.get_batch(list(acked))
            lost = [k for k, g in zip(acked, got, strict=True) if g is None]
            assert not lost, f"acknowledged puts lost across the restart: {lost}"
            assert got == list(acked.values())
    finally:
        for s in servers:
            s.close()
        m.close()
