"""Saves during the prefill (``save_during_prefill``) in vLLM's real Scheduler, no model.

The scheduler's token budget is cut to 40 tokens, so the 100-token prompt is prefilled in three
chunks (40, 40, 20); each step's metadata must hand the workers the full blocks (16 tokens) that
step completes, and nothing twice. The end of the request (finished or aborted) must keep its
blocks until a last save, queued behind the step saves, is reported done.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")

from test_pd_scheduler import free_blocks, request, step
from test_vllm_store_scheduler import (  # noqa: F401  # fixtures: registered, store
    PROMPT,
    connected,
    make_scheduler,
    meta,
    registered,
    store,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

from mooncake_connectors.adapters.vllm.store_keys import prompt_block_hashes

pytestmark = pytest.mark.vllm


def chunked(model: Path, master: str) -> Scheduler:
    s = connected(make_scheduler(model, master, save_during_prefill=True))
    s.max_num_scheduled_tokens = 40  # vLLM's token budget per step: the prompt takes 3 steps
    return s


def test_each_step_hands_over_the_blocks_it_completes(tiny_model: Path, store) -> None:  # noqa: F811
    s = chunked(tiny_model, store[0])
    idle = free_blocks(s)
    s.add_request(request("r1", PROMPT, 2))
    hashes = prompt_block_hashes(PROMPT, 16)
    seen: list[list[str]] = []
    for want_tokens, blocks in ((40, 2), (40, 3), (20, 1)):  # 40 -> 2 blocks, 80 -> 5, 100 -> 6
        out, _ = step(s, {"r1": 5} if want_tokens == 20 else None, partial=True)
        assert out.num_scheduled_tokens == {"r1": want_tokens}
        (save,) = meta(out).saves
        assert save.step and save.request_id == "r1" and len(save.block_ids) == blocks
        assert save.parent == (seen[-1][-1] if seen else None)
        assert len(save.token_ids) == 16 * blocks
        seen.append(save.hashes)
    assert [h for hs in seen for h in hs] == hashes  # every full prompt block once, in order
    out, finished = step(s, {"r1": 6})  # a decode step: nothing new to save
    assert "r1" in finished
    assert not any(sv.step for sv in meta(out).saves)
    assert free_blocks(s) < idle  # kept: the step saves may still read them
    out, _ = step(s)
    (last,) = meta(out).saves
    assert not last.step and last.block_ids == [] and last.request_id == "r1"
    step(s, kv=KVConnectorOutput(finished_sending={"r1"}))
    assert free_blocks(s) == idle


def test_an_abort_mid_prefill_keeps_the_blocks_until_the_saves_are_done(
    tiny_model: Path,
    store,  # noqa: F811
) -> None:
    s = chunked(tiny_model, store[0])
    idle = free_blocks(s)
    s.add_request(request("r2", PROMPT, 2))
    out, _ = step(s, partial=True)
    (save,) = meta(out).saves
    assert save.step and len(save.block_ids) == 2
    s.finish_requests("r2", RequestStatus.FINISHED_ABORTED)
    assert free_blocks(s) < idle
    out, _ = step(s)
    (last,) = meta(out).saves
    assert not last.step and last.block_ids == []  # only the report, nothing more written
    step(s, kv=KVConnectorOutput(finished_sending={"r2"}))
    assert free_blocks(s) == idle
    # aborted before its first step: nothing handed over, freed at once
    s.add_request(request("r3", PROMPT, 2))
    s.finish_requests("r3", RequestStatus.FINISHED_ABORTED)
    assert free_blocks(s) == idle


def test_off_saves_only_when_the_request_finishes(tiny_model: Path, store) -> None:  # noqa: F811
    s = connected(make_scheduler(tiny_model, store[0]))  # save_during_prefill off
    s.max_num_scheduled_tokens = 40
    s.add_request(request("r4", PROMPT, 1))
    for _ in range(2):
        out, _ = step(s, partial=True)
        assert meta(out).saves == []
    out, finished = step(s, {"r4": 5}, partial=True)
    assert "r4" in finished and meta(out).saves == []
    out, _ = step(s)
    (save,) = meta(out).saves
    assert not save.step and len(save.block_ids) == 6
