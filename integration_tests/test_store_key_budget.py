"""The key budget under large batches of long keys: every new key past the budget evicts an old
one, and a 14,000-key put of 4 KiB keys (57 MB, under the frame limit) must not hold the master's
one thread so long that its store server's heartbeats wait past server_ttl (it held it 6.5 s,
and the live server was declared gone again and again)."""

from __future__ import annotations

from store_cluster import client, start_master, start_server, wait_servers

N = 14_000
TIMERS = ["--heartbeat-interval", "0.5", "--server-ttl", "2.0", "--put-lease-ttl", "30"]


def test_large_batches_at_the_key_budget_never_cost_the_server_its_liveness() -> None:
    m, addr = start_master(*TIMERS, "--key-budget", "64M")
    s = start_server(addr, "64M")
    try:
        with client(addr, timeout=60) as c:
            wait_servers(c, 1)
            for r in range(3):  # the first fills the budget, each later one evicts as many keys
                keys = [f"{r}-{i:08d}".ljust(4096, "k") for i in range(N)]
                results = c.put_batch(keys, [b"v"] * N)
                assert results == [None] * N, next(x for x in results if x is not None)
            stats = c.stats()
            assert stats["evictions"] >= N
            assert stats["key_bytes"] <= 64 << 20
            lost = stats["servers_lost"]
            assert lost == 0, f"the live server was declared gone {lost:g} time(s)\n{m.output()}"
            assert c.get(keys[-1]) == b"v"
    finally:
        s.close()
        m.close()
