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

In a store deployment (``PlanContext.store_blocks`` set) the two fetching policies fetch from the
store: every prefill instance saves its prompts' KV there and loads any prefix held there, so the
prefix source is the store rather than one instance, and the transfer model is a store load.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Mapping, Sequence

from .cache_index import CacheIndex
from .estimators import LinkBook, PrefillModel, TransferModel
from .state import LoadOrder, PrefillView
from .types import STORE, PlacementPolicy, ScheduleRequest


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
    # Store deployment: leading blocks of the prompt the store holds, the only fetch source.
    # None: fetches copy from the instance holding the longest prefix (the paper's setting).
    store_blocks: int | None = None
    # Large pools: look only at holders and the least loaded others (see _search).
    order: LoadOrder | None = None
    queued_first: Mapping[int, Mapping[str, int]] | None = None  # first key -> instances queued
    min_slowdown: float = 1.0


def _tokens(blocks: int, req: ScheduleRequest, block_tokens: int) -> int:
    return min(blocks * block_tokens, req.prompt_tokens)


def _local_plan(ctx: PlanContext, req: ScheduleRequest, inst: str, local: int) -> PrefillPlan:
    queue = ctx.views[inst].queue_time(ctx.now)
    prefill = ctx.prefill_model.time(req.prompt_tokens, _tokens(local, req, ctx.block_tokens))
    prefill *= ctx.views[inst].slowdown
    return PrefillPlan(inst, local, None, 0, queue, 0.0, prefill, queue + prefill, ctx.now)


PlanFor = Callable[[str, int], PrefillPlan]
# floor(q, m, may_pend): a lower bound of key[0] for an instance whose queue is at least q seconds
# and whose own cached prefix is at most m blocks (plus blocks its queued work will store when
# may_pend)
Floor = Callable[[float, int, bool], float]

# Large pools: a prompt whose first block is held by more than the larger of _EXPLICIT_HOLDERS
# and one in _POPULAR_SHARE instances is searched lazily (the least loaded instances first, each
# matched as it comes: with that share, a walk of _MAX_WALK instances misses every holder with
# odds below 1e-3), and at most _MAX_WALK instances are taken from the load order per decision.
_EXPLICIT_HOLDERS = 64
_POPULAR_SHARE = 16
_MAX_WALK = 128


def _popular(ctx: PlanContext, req: ScheduleRequest) -> bool:
    keys = req.block_hashes
    limit = max(_EXPLICIT_HOLDERS, len(ctx.instances) // _POPULAR_SHARE)
    return bool(keys) and ctx.index.holder_count(keys[0]) > limit


def _search(
    ctx: PlanContext,
    req: ScheduleRequest,
    plan_for: PlanFor,
    floor: Floor,
    key: Callable[[PrefillPlan], tuple[float, ...]],
    matches: Mapping[str, int] | None = None,
) -> PrefillPlan:
    """The plan of least ``key`` over the instances (the first in instance order on ties).

    Small pools (no ``ctx.order``): every instance is costed. Large ones: the instances holding
    part of the prompt (or queued work that will) are costed, then the others from the least
    loaded up, until ``floor`` of the next one reaches the best so far. A prefix held by many
    instances is not expanded holder by holder: instances come from the load order and are
    matched one by one, and the floor assumes the longest prefix held anywhere. At most
    ``_MAX_WALK`` instances come from the load order: past that, an instance could beat the
    best plan found only by a longer cached prefix than the ones seen, behind a longer queue.
    """
    keys = req.block_hashes
    if ctx.order is None:
        m = ctx.index.matches(keys) if matches is None else matches
        return min((plan_for(i, m[i]) for i in ctx.instances), key=key)
    lazy = _popular(ctx, req)
    holders: dict[str, int] = {}
    if not lazy:
        holders = dict(ctx.index.holder_matches(keys) if matches is None else matches)
        if keys and ctx.queued_first is not None:
            for name in ctx.queued_first.get(keys[0], ()):
                holders.setdefault(name, 0)
    cap = ctx.index.prefix_upper_bound(keys) if lazy else 0
    best: PrefillPlan | None = None
    if holders:
        # least loaded first; stop once even the longest prefix held cannot beat the best
        order = ctx.order
        cap_h = max(holders.values())
        for free_at, inst in sorted((order.bound(i), i) for i in holders):
            q = max(0.0, free_at - ctx.now)
            if best is not None and floor(q, cap_h, q > 0) >= key(best)[0]:
                break
            plan = plan_for(inst, holders[inst])
            if best is None or key(plan) < key(best):
                best = plan
    popped: list[tuple[float, int, int, str]] = []
    try:
        while len(popped) < _MAX_WALK and (item := ctx.order.pop()) is not None:
            popped.append(item)
            free_at, _, _, name = item
            if name in holders:
                continue
            q = max(0.0, free_at - ctx.now)
            if best is not None and floor(q, cap, lazy and q > 0) >= key(best)[0]:
                break
            plan = plan_for(name, ctx.index.match(name, keys) if lazy else 0)
            if best is None or key(plan) < key(best):
                best = plan
    finally:
        ctx.order.restore(popped)
    assert best is not None  # instances is never empty (checked by the config)
    return best


def _ttft(p: PrefillPlan) -> tuple[float, ...]:
    return (p.ttft_s,)


def place_random(ctx: PlanContext, req: ScheduleRequest) -> PrefillPlan:
    inst = ctx.rng.choice(list(ctx.instances))
    return _local_plan(ctx, req, inst, ctx.index.match(inst, req.block_hashes))


def place_load_balance(ctx: PlanContext, req: ScheduleRequest) -> PrefillPlan:
    if ctx.order is None:
        inst = min(ctx.instances, key=lambda i: ctx.views[i].queue_time(ctx.now))
        return _local_plan(ctx, req, inst, ctx.index.match(inst, req.block_hashes))
    return _search(
        ctx, req, lambda i, _m: _local_plan(ctx, req, i, ctx.index.match(i, req.block_hashes)),
        lambda q, _m, _p: q, lambda p: (p.queue_s,), matches={},
    )  # fmt: skip


def place_local_cache(ctx: PlanContext, req: ScheduleRequest) -> PrefillPlan:
    def floor(q: float, m: int, _pend: bool) -> float:
        cached = _tokens(m, req, ctx.block_tokens)
        return q + ctx.min_slowdown * ctx.prefill_model.time(req.prompt_tokens, cached)

    # equal estimates (a flat profile, rounding): the longer cached prefix wins
    return _search(
        ctx, req, lambda i, m: _local_plan(ctx, req, i, m), floor,
        lambda p: (p.ttft_s, -p.local_blocks),
    )  # fmt: skip


def _source(
    ctx: PlanContext, req: ScheduleRequest, matches: Mapping[str, int] | None
) -> tuple[str | None, int]:
    """Where a fetched prefix comes from and how many leading blocks it has."""
    if ctx.store_blocks is not None:
        return STORE, min(ctx.store_blocks, len(req.block_hashes))
    if not matches:  # None only with the store (see _matches)
        return None, 0
    if ctx.order is None:
        holder = max(ctx.instances, key=lambda i: matches[i])
    else:
        holder = min(matches, key=lambda i: (-matches[i], i))
    return holder, matches[holder]


def _best_source(
    ctx: PlanContext, req: ScheduleRequest, matches: Mapping[str, int] | None
) -> tuple[str | None, int, int, float]:
    """The fetch source, its leading blocks and their tokens, and the prefill time of the rest
    once they are here (on an instance of slowdown 1)."""
    holder, blocks = _source(ctx, req, matches)
    tokens = _tokens(blocks, req, ctx.block_tokens)
    return holder, blocks, tokens, ctx.prefill_model.time(req.prompt_tokens, tokens)


def _matches(ctx: PlanContext, req: ScheduleRequest) -> dict[str, int] | None:
    """Every instance's match (small pools), the holders' (large), or None: searched lazily."""
    if ctx.order is None:
        return ctx.index.matches(req.block_hashes)
    if ctx.store_blocks is not None and _popular(ctx, req):
        return None  # the store is the source: no holder needs naming
    return ctx.index.holder_matches(req.block_hashes)


def place_global_cache(ctx: PlanContext, req: ScheduleRequest) -> PrefillPlan:
    """Algorithm 1 of the paper (lines 1-23, 28-30)."""
    matches = _matches(ctx, req)
    best_holder, best, best_tokens, prefill_best = _best_source(ctx, req, matches)

    def plan_for(inst: str, local: int) -> PrefillPlan:
        # Division by a zero local prefix counts as "infinitely better elsewhere".
        if best_holder is None or not (
            best > local and (local == 0 or best / local >= ctx.threshold)
        ):
            return _local_plan(ctx, req, inst, local)
        queue = ctx.views[inst].queue_time(ctx.now)
        transfer = ctx.transfer.time(best_tokens - _tokens(local, req, ctx.block_tokens))
        prefill = ctx.views[inst].slowdown * prefill_best
        return PrefillPlan(
            inst, local, best_holder, best - local, queue, transfer, prefill,
            transfer + queue + prefill, ctx.now + transfer,
        )  # fmt: skip

    s = ctx.min_slowdown

    def floor(q: float, m: int, _pend: bool) -> float:
        own = _tokens(m, req, ctx.block_tokens)
        local = s * ctx.prefill_model.time(req.prompt_tokens, own)
        if best_holder is None or best <= m:
            return q + local
        return q + min(local, ctx.transfer.time(best_tokens - own) + s * prefill_best)

    return _search(ctx, req, plan_for, floor, _ttft, matches)


def place_adaptive(ctx: PlanContext, req: ScheduleRequest) -> PrefillPlan:
    """Ours: cost both options everywhere; overlap fetch with queueing; booked NIC times."""
    matches = _matches(ctx, req)
    best_holder, best, best_tokens, prefill_best = _best_source(ctx, req, matches)

    def plan_for(inst: str, local: int) -> PrefillPlan:
        # Blocks that requests queued ahead will have stored by the time this one starts count
        # as local: a follow-up turn queued behind its predecessor reuses its KV for free.
        plan = _local_plan(ctx, req, inst, ctx.views[inst].pending_match(req.block_hashes, local))
        if best_holder is not None and best > plan.local_blocks:
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
        return plan

    s = ctx.min_slowdown
    n_keys = len(req.block_hashes)

    def floor(q: float, m: int, pend: bool) -> float:
        own = _tokens(m, req, ctx.block_tokens)
        cached = _tokens(n_keys, req, ctx.block_tokens) if pend else own
        local = q + s * ctx.prefill_model.time(req.prompt_tokens, cached)
        if best_holder is None or best <= m:
            return local
        return min(local, max(q, ctx.transfer.time(best_tokens - own)) + s * prefill_best)

    return _search(ctx, req, plan_for, floor, _ttft, matches)


PLACEMENTS: Mapping[PlacementPolicy, Callable[[PlanContext, ScheduleRequest], PrefillPlan]] = {
    PlacementPolicy.RANDOM: place_random,
    PlacementPolicy.LOAD_BALANCE: place_load_balance,
    PlacementPolicy.LOCAL_CACHE: place_local_cache,
    PlacementPolicy.GLOBAL_CACHE: place_global_cache,
    PlacementPolicy.ADAPTIVE: place_adaptive,
}
