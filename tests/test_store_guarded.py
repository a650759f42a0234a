"""GuardedStore against real store processes: lazy connect, cool-down, deadlines, clean-up.

A master (and, where data is stored, a store server) runs as the CLI runs it; the guarded client
is a real StoreClient. The functions handed to the guard are real store calls, except where a
test needs a call that blocks or has a bug.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from helpers import free_port, wait_until
from store_cluster import FAST, Proc, client, start_master, start_server, wait_servers

from mooncake_connectors.errors import ConfigError, MasterUnavailable
from mooncake_connectors.store import ClientConfig, StoreClient
from mooncake_connectors.store.guarded import FAILED, GuardedStore, RateLimitedLog

TIMEOUT = 1.0  # every guarded client's call deadline here


@pytest.fixture(scope="module")
def master() -> Iterator[str]:
    proc, addr = start_master(*FAST)
    server = start_server(addr, "16M")
    try:
        # a put before the server's segment is mounted finds no room: wait for it, not on luck
        probe = client(addr)
        try:
            wait_servers(probe, 1)
        finally:
            probe.close()
        yield addr
    finally:
        server.close()
        proc.close()


@pytest.fixture
def guards() -> Iterator[Any]:
    made: list[GuardedStore] = []

    def make(
        addr: str, cooldown: float = 30.0, workers: int = 2, timeout: float = TIMEOUT, **kw: Any
    ) -> GuardedStore:
        cfg = ClientConfig(
            master=addr, timeout=timeout, rpc_timeout=timeout, local_buffer_size=1 << 20
        )
        g = GuardedStore(cfg, cooldown=cooldown, workers=workers, name="t", **kw)
        made.append(g)
        return g

    yield make
    for g in made:
        g.close()


def stats(client: StoreClient) -> dict[str, Any]:
    return client.stats()


def test_connects_in_the_background_and_calls_run_on_the_right_threads(
    master: str, guards: Any
) -> None:
    # Deadlines are not what this test checks: a starved machine must not turn a call into FAILED.
    g = guards(master, timeout=10.0)
    assert g.wait_connected(30) and g.counters["connects"] == 1
    seen: list[str] = []

    def get(client: StoreClient) -> bytes | None:
        seen.append(threading.current_thread().name)
        return client.get("guarded/a")

    assert g.call("put", lambda c: c.put("guarded/a", b"value")) is None
    assert g.call("get", get) == b"value"
    assert asyncio.run(g.run("get", get)) == b"value"
    assert g.run_sync("get", get) == b"value"
    assert seen[0] == threading.current_thread().name
    assert all(name.startswith("t") for name in seen[1:]) and len(seen) == 3
    assert g.counters["calls"] == 4 and g.counters["failed"] == 0


def test_absent_store_answers_failed_at_once_then_is_found(guards: Any) -> None:
    port = free_port()
    g = guards(f"127.0.0.1:{port}", cooldown=0.3)
    assert not g.settle(30)  # the first attempt found nothing
    assert g.ready() is None and g.call("stats", stats) is FAILED
    assert g.run_sync("stats", stats) is FAILED
    proc, _ = start_master(*FAST, port=port)
    try:
        assert g.wait_connected(30)  # retried every cool-down until the master answered
        wait_until(lambda: not g.down(), 5, "the cool-down to end")
        got = g.call("stats", stats)
        assert got is not FAILED and got["servers"] == 0
    finally:
        proc.close()


def test_master_gone_opens_a_cooldown_then_the_store_is_probed_again(guards: Any) -> None:
    port = free_port()
    proc, addr = start_master(*FAST, port=port)
    procs: list[Proc] = [proc]
    try:
        g = guards(addr, cooldown=0.5)
        assert g.wait_connected(30)
        proc.kill()
        assert g.call("stats", stats) is FAILED  # waited one deadline, then tripped
        assert g.down() and g.counters["failed"] == 1
        calls = g.counters["calls"]
        for _ in range(3):
            assert g.call("stats", stats) is FAILED
        assert g.counters["calls"] == calls and g.counters["skipped"] == 3  # no store call
        procs.append(start_master(*FAST, port=port)[0])
        wait_until(lambda: g.call("stats", stats) is not FAILED, 30, "the store to answer again")
    finally:
        for p in procs:
            p.close()


def test_a_per_key_failure_does_not_open_the_cooldown(master: str, guards: Any) -> None:
    g = guards(master)
    assert g.wait_connected(30)
    # more than the one store server holds: that key fails, the store is fine
    assert g.call("put", lambda c: c.put("guarded/huge", bytes(64 << 20))) is FAILED
    assert not g.down() and g.counters["failed"] == 1
    assert g.call("stats", stats) is not FAILED


def test_a_bug_propagates_from_call_and_is_logged_by_run_sync(
    master: str, guards: Any, caplog: pytest.LogCaptureFixture
) -> None:
    g = guards(master)
    assert g.wait_connected(30)

    def bug(client: StoreClient) -> int:
        raise KeyError("oops")

    with pytest.raises(KeyError):
        g.call("get", bug)
    with caplog.at_level(logging.WARNING):
        assert g.run_sync("get", bug) is FAILED
    assert "oops" in caplog.text and not g.down()


def test_overdue_call_answers_failed_and_its_result_is_released(master: str, guards: Any) -> None:
    g = guards(master)
    assert g.wait_connected(30)
    gate, freed = threading.Event(), threading.Event()
    released: list[Any] = []

    def slow(client: StoreClient) -> dict[str, Any]:
        gate.wait(30)
        return client.stats()

    def unclaimed(result: dict[str, Any]) -> None:
        released.append(result)
        freed.set()

    assert asyncio.run(g.run("stats", slow, unclaimed=unclaimed)) is FAILED
    assert g.down() and g.counters["timeouts"] == 1 and not released
    gate.set()
    assert freed.wait(30) and "servers" in released[0]


def test_cancelled_caller_leaves_the_result_to_clean_up(master: str, guards: Any) -> None:
    g = guards(master)
    assert g.wait_connected(30)
    gate, started, freed = threading.Event(), threading.Event(), threading.Event()

    def slow(client: StoreClient) -> dict[str, Any]:
        started.set()
        gate.wait(30)
        return client.stats()

    async def main() -> None:
        task = asyncio.ensure_future(g.run("stats", slow, unclaimed=lambda r: freed.set()))
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert not freed.is_set()
    gate.set()
    assert freed.wait(30)


def test_ended_runs_once_whatever_happens_to_the_call(master: str, guards: Any) -> None:
    g = guards(master, workers=1)
    assert g.wait_connected(30)
    ended: list[str] = []
    gate, started = threading.Event(), threading.Event()

    async def main() -> None:
        got = await g.run("stats", stats, ended=lambda: ended.append("done"))
        assert got is not FAILED

        def blocker(client: StoreClient) -> int:
            started.set()
            gate.wait(30)
            return 2

        first = asyncio.ensure_future(g.run("put", blocker, ended=lambda: ended.append("first")))
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 30)
        queued = asyncio.ensure_future(g.run("put", stats, ended=lambda: ended.append("queued")))
        await asyncio.sleep(0)  # let it reach the pool's queue
        g.close(wait=0)  # drops the queued call
        gate.set()
        assert await queued is FAILED
        assert await first == 2

    asyncio.run(main())
    wait_until(lambda: len(ended) == 3, 30, "every ended() call")
    assert sorted(ended) == ["done", "first", "queued"]
    # closed: nothing is submitted, ended() still runs
    assert asyncio.run(g.run("put", stats, ended=lambda: ended.append("late"))) is FAILED
    assert ended[-1] == "late" and g.down() and g.ready() is None


def test_a_failing_on_connect_is_a_failed_attempt_and_retried(master: str, guards: Any) -> None:
    attempts: list[StoreClient] = []

    def on_connect(client: StoreClient) -> None:
        attempts.append(client)
        if len(attempts) == 1:
            raise ConfigError("memory not registrable yet")

    g = guards(master, cooldown=0.2, on_connect=on_connect)
    assert g.wait_connected(30) and len(attempts) == 2
    assert g.client() is attempts[1]


def test_client_raises_when_there_is_none(guards: Any) -> None:
    g = guards(f"127.0.0.1:{free_port()}")
    with pytest.raises(MasterUnavailable):
        g.client()
    with pytest.raises(RuntimeError, match="without worker threads"):
        guards(f"127.0.0.1:{free_port()}", workers=0).run_sync("stats", stats)


def test_rate_limited_log_counts_what_it_held_back(caplog: pytest.LogCaptureFixture) -> None:
    rl = RateLimitedLog(logging.getLogger("t.rl"), interval=0.2)
    with caplog.at_level(logging.WARNING, logger="t.rl"):
        assert rl.warn("k", "store %s", "down")
        assert not rl.warn("k", "store %s", "down")
        assert rl.warn("other", "different kind")
        wait_until(lambda: rl.warn("k", "store %s", "down"), 5, "the interval to pass")
    texts = [r.getMessage() for r in caplog.records]
    assert texts[0] == "store down" and texts[1] == "different kind"
    assert texts[2].startswith("store down (") and "more like this" in texts[2]
