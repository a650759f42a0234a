"""Saves during the prefill (``save_during_prefill``): a step's completed prompt blocks.

Called from the scheduler's ``build_connector_meta``, which vLLM calls before it adds the step's
tokens to each request: a scheduled request's blocks completed by the end of this step are
those below ``num_computed_tokens + num_scheduled_tokens`` (prompt tokens only). Each request's
blocks not handed over yet become one ``step`` save; the workers write it after the step's
forward pass (``wait_for_save``). With several KV cache groups each group's blocks of those
indices go with it (vLLM's null block, 0, where a sliding-window group holds none).
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
        done = min(done, len(hashes), *(len(g) for g in groups))
        if done <= first:
            continue
        spec = sched._rest_spec(request, groups, hashes, first, done)
        spec.step = True
        sched._saves.append(spec)
        sched._handed[rid] = done
