"""Saves during the prefill (``save_during_prefill``): a step's completed prompt blocks.

Called from the scheduler's ``build_connector_meta``, which vLLM calls before it adds the step's
tokens to each request: a scheduled request's blocks completed by the end of this step are
those below ``num_computed_tokens + num_scheduled_tokens`` (prompt tokens only). Each request's
blocks not handed over yet become one ``step`` save; the workers write it after the step's
forward pass (``wait_for_save``). One KV cache group only (the scheduler tracks no request
otherwise).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .store_scheduler import StoreScheduler


def step_saves(sched: StoreScheduler, out: Any) -> None:
    """Queue on ``sched`` the step saves of the scheduler output ``out``."""
    state = getattr(out, "kv_connector_block_state", None)  # vLLM's block tables, this step
    if state is None or sched.store.ready() is None:
        return
    bs = sched.block_size
    for rid, scheduled in out.num_scheduled_tokens.items():
        request = sched._requests.get(rid)
        if request is None:
            continue
        computed = min(request.num_computed_tokens + scheduled, request.num_prompt_tokens)
        done, first = computed // bs, sched._handed.get(rid, 0)
        if done <= first:
            continue
        hashes = sched._prompt_hashes(request)
        groups = state.get_block_ids(rid)
        if not groups:
            continue
        done = min(done, len(hashes), len(groups[0]))
        if done <= first:
            continue
        spec = sched._save_spec(request, list(groups[0][first:done]), hashes[first:done], first)
        spec.step = True
        spec.parent = hashes[first - 1] if first else None
        sched._saves.append(spec)
        sched._handed[rid] = done
