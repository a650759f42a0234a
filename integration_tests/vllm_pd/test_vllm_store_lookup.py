"""Non-blocking store lookups (``lookup_async``) inside vLLM's real Scheduler, engine-free.

vLLM 0.32 skips a waiting request for a step when the connector answers ``None``; the store
connector answers so while its ``batch_exists`` runs on its lookup thread. A hit is offered once
the lookup answered; a store that hangs never holds a scheduler step, and the request is
computed once the lookup is past its deadline.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from store_cluster import cluster, in_process_store

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")

from test_pd_scheduler import BS, request, step
from test_vllm_store_scheduler import (
    PROMPT,
    connected,
    make_scheduler,
    meta,
    registered,  # noqa: F401  # fixture
    store_blocks,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from mooncake_connectors.adapters.vllm.store_keys import prompt_block_hashes
from mooncake_connectors.store.server import StoreServer

pytestmark = pytest.mark.vllm


@pytest.fixture
def store() -> Iterator[tuple[str, StoreServer]]:
    with in_process_store(64 << 20) as store:
        yield store


def steps_until(
    s: Scheduler, done, what: str, sampled=None, limit: int = 3000, timeout: float = 20.0
):
    """Step (bounded in count and time) until ``done(out)``; the outputs seen."""
    seen: list[SchedulerOutput] = []
    deadline = time.monotonic() + timeout
    for _ in range(limit):
        out, _ = step(s, sampled)
        seen.append(out)
        if done(out):
            return seen
        assert time.monotonic() < deadline, f"{what}: not within {timeout}s"
        time.sleep(0.01)  # let the lookup thread run on a loaded machine
    raise AssertionError(f"{what}: not within {limit} steps")


def test_hit_is_offered_once_the_lookup_answered(tiny_model: Path, store) -> None:
    store_blocks(tiny_model, store[0], PROMPT, list(range(6)))
    s = connected(make_scheduler(tiny_model, store[0], lookup_async=True))
    try:
        r = request("a1", PROMPT, 3)
        s.add_request(r)
        seen = steps_until(s, lambda out: bool(meta(out).loads), "the load")
        first = seen[0]
        assert first.num_scheduled_tokens == {} and meta(first).loads == []
        (load,) = meta(seen[-1]).loads
        assert load.hashes == prompt_block_hashes(PROMPT, BS) and load.error is None
        assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert s.connector.scheduler.lookups.in_flight() == 0  # the answer was taken
    finally:
        s.connector.shutdown()


def test_a_hung_store_never_holds_a_scheduler_step(tiny_model: Path) -> None:
    with cluster(1) as (addr, _servers, _client, master):
        s = connected(make_scheduler(tiny_model, addr, lookup_async=True, lookup_timeout=2.0))
        os.kill(master.pid, signal.SIGSTOP)
        try:
            s.add_request(request("h1", PROMPT, 1))
            t0 = time.monotonic()
            out, _ = step(s, {"h1": 1})
            # the synchronous lookup would hold this step for its whole deadline (2 s)
            assert time.monotonic() - t0 < 1.0
            assert out.num_scheduled_tokens == {}
            seen = steps_until(
                s, lambda o: bool(o.num_scheduled_tokens), "the prompt computed", {"h1": 1}
            )
            assert seen[-1].num_scheduled_tokens == {"h1": 100}  # a miss past the deadline
            assert meta(seen[-1]).loads == []
        finally:
            os.kill(master.pid, signal.SIGCONT)
            s.connector.shutdown()
