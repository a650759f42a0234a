"""The store failing under SGLang: every backend call returns within its deadline, as a miss or
False, and the backend comes back by itself when the store does."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("sglang", reason="SGLang is not installed (it lives in its own venv)")
pytestmark = pytest.mark.sglang

from helpers import free_port, wait_until  # noqa: E402
from hicache_helpers import alloc_pages, fill_random, make_backend, make_pool, page_keys  # noqa: E402
from store_cluster import FAST, cluster, start_master, start_server  # noqa: E402

TIMEOUT = 3.0  # the backends' deadline (hicache_helpers.make_backend)
SLACK = 2.0  # scheduling on a shared 2-core machine


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.monotonic()
    out = fn()
    return out, time.monotonic() - t0


def test_store_server_killed_pages_read_as_misses_within_the_deadline() -> None:
    with cluster(1, "32M", tuple(FAST)) as (addr, servers, probe, _):
        pool = make_pool("mha", "page_first")
        fill_random(pool, 11)
        backend = make_backend(addr, pool)
        try:
            keys = page_keys(4)
            idx = alloc_pages(pool, 4)
            assert backend.batch_set_v1(keys, idx) == [True] * 4
            servers[0].kill()
            got, took = timed(lambda: backend.batch_get_v1(keys, idx))
            assert took < TIMEOUT + SLACK
            # The dead server's memory may still be mapped here until the master drops it.
            wait_until(lambda: probe.stats()["servers"] == 0, 20, "the master to drop it")
            got, took = timed(lambda: backend.batch_get_v1(keys, idx))
            assert got == [False] * 4 and took < TIMEOUT + SLACK
            n, took = timed(lambda: backend.batch_exists(keys))
            assert n == 0 and took < TIMEOUT + SLACK
            ok, took = timed(lambda: backend.batch_set_v1(page_keys(2), idx[:8]))
            assert ok == [False, False] and took < TIMEOUT + SLACK
            assert backend.counters().objects_put_failed >= 4
        finally:
            backend.close()


def test_master_killed_calls_answer_misses_then_recover_when_it_returns() -> None:
    port = free_port()
    master, addr = start_master(*FAST, port=port)
    server = start_server(addr, "32M")
    pool = make_pool("mla", "layer_first")
    fill_random(pool, 12)
    backend = make_backend(addr, pool, mla=True)
    try:
        keys = page_keys(3)
        idx = alloc_pages(pool, 3)
        wait_until(lambda: backend.batch_set_v1(keys, idx) == [True] * 3, 30, "a first put")
        master.kill()
        n, took = timed(lambda: backend.batch_exists(keys))
        assert n == 0 and TIMEOUT - 0.5 < took < TIMEOUT + SLACK  # waited its deadline once
        # For the cool-down after that, calls do not wait on the dead master at all.
        for call in (
            lambda: backend.batch_get_v1(keys, idx),
            lambda: backend.batch_set_v1(keys, idx),
            lambda: backend.batch_exists(keys),
        ):
            out, took = timed(call)
            assert out in ([False] * 3, 0) and took < TIMEOUT / 3  # not one deadline waited
        assert backend.counters().skipped_while_down >= 3
        # A new master on the same address; the server re-registers, the backend retries.
        master.close()
        master, _ = start_master(*FAST, port=port)
        fresh = page_keys(3)
        wait_until(lambda: backend.batch_set_v1(fresh, idx) == [True] * 3, 30, "puts again")
        assert backend.batch_exists(fresh) == 3
        assert backend.batch_get_v1(fresh, idx) == [True] * 3
    finally:
        backend.close()
        server.close()
        master.close()


def test_store_unreachable_at_start_serves_misses_and_connects_later() -> None:
    port = free_port()
    addr = f"127.0.0.1:{port}"
    pool = make_pool("mha", "layer_first")
    fill_random(pool, 13)
    backend, took = timed(lambda: make_backend(addr, pool))
    procs = []
    try:
        assert took < TIMEOUT + SLACK and not backend.store.connected
        keys = page_keys(2)
        idx = alloc_pages(pool, 2)
        for call in (
            lambda: backend.batch_set_v1(keys, idx),
            lambda: backend.batch_get_v1(keys, idx),
            lambda: backend.batch_exists(keys),
        ):
            out, took = timed(call)
            assert out in ([False, False], 0) and took < TIMEOUT + SLACK
        master, _ = start_master(*FAST, port=port)
        procs = [master, start_server(addr, "32M")]
        wait_until(lambda: backend.batch_set_v1(keys, idx) == [True] * 2, 30, "a lazy connect")
        assert backend.store.connected and backend.batch_exists(keys) == 2
    finally:
        backend.close()
        for p in procs:
            p.close()
