"""Prefill placement policies: pure functions of the conductor's picture at one instant.

Each policy turns (request, instances' caches and queues) into a :class:`PrefillPlan`. They are
the four of the Mooncake paper's Figure 5 plus ours:

- ``random``: any instance; it still reuses whatever prefix it happens to hold.
- ``load-balance``: the shortest estimated queue; cache ignored when choosing.
- ``local-cache``: min(queue + prefill) where prefill reuses only the instance's own prefix.
- ``global-cache``: Algorithm 1. An instance whose own prefix is much shorter than the best one
  anywhere (``best / local >= threshold``) is costed as fetching the best prefix first:
  ``transfer + queue + prefill(best)``; the fetch replicates a hot prefix as a side effect.
- ``adaptive`` (ours): both options costed on every instance, no fixed threshold; the fetch runs
  while the request waits in the queue (``max(queue, transfer) + prefill``), and transfer time
  comes from NIC bookings, so a hot prefix's congested holder is seen as slow.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Mapping, Sequence

from .cache_index import CacheIndex
from .estimators import LinkBook, PrefillModel, TransferModel
from .state import PrefillView
from .types import PlacementPolicy, ScheduleRequest


@dataclasses.dataclass(frozen=True)
class PrefillPlan:
    """A chosen prefill instance and the estimate behind it (times in seconds)."""

    instance: str
    local_blocks: int
    fetch_from: str | None
    fetch_blocks: int
    queue_s: float
    transfer_s: float
    prefill_s: float
    ttft_s: float
    ready_at: float  # absolute time the fetched prefix is expected in place (now if no fetch)


@dataclasses.dataclass
class PlanContext:
    now: float
    instances: Sequence[str]
    index: CacheIndex
    views: Mapping[str, PrefillView]
    prefill_model: PrefillModel
    transfer: TransferModel
    links: LinkBook
    block_tokens: int
    threshold: float
    rng: random.Random


def _tokens(blocks: int, req: ScheduleRequest, block_tokens: int) -> int:
    return min(blocks * block_tokens, req.prompt_tokens)


def _local_plan(ctx: PlanContext, req: ScheduleRequest, inst: str, local: int) -> PrefillPlan:
    queue = ctx.views[inst].queue_time(ctx.now)
    prefill = ctx.prefill_model.time(req.prompt_tokens, _tokens(local, req, ctx.block_tokens))
    prefill *= ctx.views[inst].slowdown
    return PrefillPlan(inst, local, None, 0, queue, 0.0, prefill, queue + prefill, ctx.now)


def place_random(ctx: PlanContext, req: ScheduleRequest) -> PrefillPlan:
    inst = ctx.rng.choice(list(ctx.instances))
    return _local_plan(ctx, req, inst, ctx.index.match(inst, req.block_hashes))


def place_load_balance(ctx: PlanContext, req: ScheduleRequest) -> PrefillPlan:
    inst = min(ctx.instances, key=lambda i: ctx.views[i].queue_time(ctx.now))
    return _local_plan(ctx, req, inst, ctx.index.match(inst, req.block_hashes))


def place_local_cache(ctx: PlanContext, req: ScheduleRequest) -> PrefillPlan:
    plans = (_local_plan(ctx, req, i, ctx.index.match(i, req.block_hashes)) for i in ctx.instances)
    # equal estimates (a flat profile, rounding): the longer cached prefix wins
    return min(plans, key=lambda p: (p.ttft_s, -p.local_blocks))


def place_global_cache(ctx: PlanContext, req: ScheduleRequest) -> PrefillPlan:
    """Algorithm 1 of the paper (lines 1-23, 28-30)."""
    matches = ctx.index.matches(req.block_hashes)
    best_holder = max(ctx.instances, key=lambda i: matches[i])
    best = matches[best_holder]
    best_plan: PrefillPlan | None = None
    for inst in ctx.instances:
        local = matches[inst]
        # Division by a zero local prefix counts as "infinitely better elsewhere".
        if best > local and (local == 0 or best / local >= ctx.threshold):
            queue = ctx.views[inst].queue_time(ctx.now)
            fetch_tokens = _tokens(best, req, ctx.block_tokens) - _tokens(
                local, req, ctx.block_tokens
            )
            transfer = ctx.transfer.time(fetch_tokens)
            prefill = ctx.views[inst].slowdown * ctx.prefill_model.time(
                req.prompt_tokens, _tokens(best, req, ctx.block_tokens)
            )
            plan = PrefillPlan(
                inst, local, best_holder, best - local, queue, transfer, prefill,
                transfer + queue + prefill, ctx.now + transfer,
            )  # fmt: skip
        else:
            plan = _local_plan(ctx, req, inst, local)
        if best_plan is None or plan.ttft_s < best_plan.ttft_s:
            best_plan = plan
    assert best_plan is not None  # instances is never empty (checked by the config)
    return best_plan


def place_adaptive(ctx: PlanContext, req: ScheduleRequest) -> PrefillPlan:
    """Ours: cost both options everywhere; overlap fetch with queueing; booked NIC times."""
    matches = ctx.index.matches(req.block_hashes)
    best_holder = max(ctx.instances, key=lambda i: matches[i])
    best = matches[best_holder]
    best_tokens = _tokens(best, req, ctx.block_tokens)
    prefill_best = ctx.prefill_model.time(req.prompt_tokens, best_tokens)
    best_plan: PrefillPlan | None = None
    for inst in ctx.instances:
        local = matches[inst]
        # Blocks that requests queued ahead will have stored by the time this one starts count
        # as local: a follow-up turn queued behind its predecessor reuses its KV for free.
        plan = _local_plan(ctx, req, inst, ctx.views[inst].pending_match(req.block_hashes, local))
        if best > plan.local_blocks:
            drain = ctx.views[inst].drain_time(ctx.now)
            fetch_tokens = best_tokens - _tokens(local, req, ctx.block_tokens)
            ready = ctx.links.estimate(best_holder, inst, ctx.now, fetch_tokens)
            prefill = prefill_best * ctx.views[inst].slowdown
            ttft = max(drain, ready) + prefill - ctx.now
            if ttft < plan.ttft_s:
                plan = PrefillPlan(
                    inst, local, best_holder, best - local, drain - ctx.now, ready - ctx.now,
                    prefill, ttft, ready,
                )  # fmt: skip
        if best_plan is None or plan.ttft_s < best_plan.ttft_s:
            best_plan = plan
    assert best_plan is not None  # instances is never empty (checked by the config)
    return best_plan


PLACEMENTS: Mapping[PlacementPolicy, Callable[[PlanContext, ScheduleRequest], PrefillPlan]] = {
    PlacementPolicy.RANDOM: place_random,
    PlacementPolicy.LOAD_BALANCE: place_load_balance,
    PlacementPolicy.LOCAL_CACHE: place_local_cache,
    PlacementPolicy.GLOBAL_CACHE: place_global_cache,
    PlacementPolicy.ADAPTIVE: place_adaptive,
}
