"""StoreGuard: store calls off the caller's event loop, deadlines, cool-down, clean-up.

The guard is under test; the functions it runs stand in for store calls (they block, fail or
return), and the "client" they get is a plain object — no store is needed to test the guard.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import types
from collections.abc import Iterator
from typing import Any

import pytest
from helpers import wait_until

from mooncake_connectors.adapters.lmcache.guard import (
    FAILED,
    GRACE,
    RateLimitedLog,
    StoreGuard,
)
from mooncake_connectors.errors import CapacityExceeded, MasterUnavailable

CLIENT: Any = types.SimpleNamespace(close=lambda: None)  # what a call gets as its client


@pytest.fixture
def guards() -> Iterator[Any]:
    made: list[StoreGuard] = []

    def make(timeout: float = 1.0, cooldown: float = 30.0, workers: int = 2, connect: Any = None):
        g = StoreGuard(
            connect or (lambda: CLIENT),
            timeout=timeout,
            cooldown=cooldown,
            workers=workers,
            name="t",
        )
        made.append(g)
        return g

    yield make
    for g in made:
        g.close()


def test_results_come_back_from_a_pool_thread(guards: Any) -> None:
    g = guards()
    seen: list[str] = []

    def call(client: Any) -> int:
        assert client is CLIENT
        seen.append(threading.current_thread().name)
        return 7

    assert asyncio.run(g.run("op", call)) == 7
    assert g.run_sync("op", call) == 7
    assert all(name.startswith("t") for name in seen) and len(seen) == 2


def test_store_down_opens_a_cooldown_then_probes_again(guards: Any) -> None:
    g = guards(cooldown=0.3)
    calls = []

    def down(client: Any) -> int:
        calls.append(1)
        raise MasterUnavailable("gone")

    assert asyncio.run(g.run("get", down)) is FAILED
    assert g.down()
    t0 = time.monotonic()
    assert asyncio.run(g.run("get", down)) is FAILED
    assert g.run_sync("exists", down) is FAILED
    assert time.monotonic() - t0 < 0.2 and len(calls) == 1
    assert g.counters["skipped"] == 2
    wait_until(lambda: not g.down(), 5, "the cool-down to end")
    assert g.run_sync("exists", lambda c: 3) == 3


def test_per_key_errors_do_not_open_the_cooldown(guards: Any) -> None:
    g = guards()

    def full(client: Any) -> int:
        raise CapacityExceeded("no room", key="k")

    assert asyncio.run(g.run("put", full)) is FAILED
    assert not g.down() and g.run_sync("put", lambda c: 1) == 1


def test_a_bug_is_logged_not_raised(guards: Any, caplog: pytest.LogCaptureFixture) -> None:
    g = guards()

    def bug(client: Any) -> int:
        raise ValueError("oops")

    with caplog.at_level(logging.WARNING):
        assert g.run_sync("get", bug) is FAILED
    assert "oops" in caplog.text and not g.down()


def test_overdue_call_answers_failed_in_time_and_its_result_is_released(guards: Any) -> None:
    g = guards(timeout=0.3)
    gate = threading.Event()
    released: list[Any] = []
    freed = threading.Event()

    def slow(client: Any) -> str:
        gate.wait(10)
        return "objs"

    def unclaimed(result: str) -> None:
        released.append(result)
        freed.set()

    t0 = time.monotonic()
    assert asyncio.run(g.run("get", slow, unclaimed=unclaimed)) is FAILED
    assert time.monotonic() - t0 < 0.3 + GRACE + 0.5
    assert g.down() and g.counters["timeouts"] == 1 and not released
    gate.set()
    assert freed.wait(5) and released == ["objs"]


def test_cancelled_caller_leaves_the_result_to_clean_up(guards: Any) -> None:
    g = guards()
    gate, started, freed = threading.Event(), threading.Event(), threading.Event()

    def slow(client: Any) -> str:
        started.set()
        gate.wait(10)
        return "objs"

    async def main() -> None:
        task = asyncio.ensure_future(g.run("get", slow, unclaimed=lambda r: freed.set()))
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert not freed.is_set()
    gate.set()
    assert freed.wait(5)


def test_ended_runs_once_whatever_happens_to_the_call(guards: Any) -> None:
    g = guards(workers=1)
    ended: list[str] = []
    gate, started = threading.Event(), threading.Event()

    async def main() -> None:
        assert await g.run("put", lambda c: 1, ended=lambda: ended.append("done")) == 1

        def blocker(client: Any) -> int:
            started.set()
            gate.wait(10)
            return 2

        first = asyncio.ensure_future(g.run("put", blocker, ended=lambda: ended.append("first")))
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 5)
        queued = asyncio.ensure_future(
            g.run("put", lambda c: 3, ended=lambda: ended.append("queued"))
        )
        await asyncio.sleep(0)  # let it reach the pool's queue
        g.close()  # drops the queued call
        gate.set()
        assert await queued is FAILED
        assert await first == 2

    asyncio.run(main())
    wait_until(lambda: len(ended) == 3, 5, "every ended() call")
    assert sorted(ended) == ["done", "first", "queued"]
    # closed: nothing is submitted, ended() still runs
    assert asyncio.run(g.run("put", lambda c: 4, ended=lambda: ended.append("late"))) is FAILED
    assert ended[-1] == "late"


def test_client_connects_lazily_and_a_failed_connect_is_a_miss(guards: Any) -> None:
    attempts: list[int] = []

    def connect() -> Any:
        attempts.append(1)
        if len(attempts) == 1:
            raise MasterUnavailable("not yet")
        return CLIENT

    g = guards(cooldown=0.2, connect=connect)
    assert attempts == []
    assert g.run_sync("exists", lambda c: True) is FAILED and g.down()
    wait_until(lambda: not g.down(), 5, "the cool-down to end")
    assert g.run_sync("exists", lambda c: c is CLIENT) is True
    assert g.run_sync("exists", lambda c: True) is True and len(attempts) == 2


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
