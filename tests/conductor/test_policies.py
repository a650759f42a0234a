"""Each placement policy on hand-made scenarios whose answers are worked out in the comments.

Units (conftest): block = 100 tokens, prefill = 1 ms per uncached token, transfer = 0.5 ms per
token, prompt = 1000 tokens = blocks 1..10.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from mooncake_connectors.conductor.cache_index import BlockStored, CacheIndex
from mooncake_connectors.conductor.estimators import LinkBook
from mooncake_connectors.conductor.policies import PLACEMENTS, PlanContext
from mooncake_connectors.conductor.state import PrefillView
from mooncake_connectors.conductor.types import PlacementPolicy, ScheduleRequest

from .conftest import PREFILL, TRANSFER

REQ = ScheduleRequest(request_id=99, prompt_tokens=1000, block_hashes=tuple(range(1, 11)))
NAMES = ("p0", "p1", "p2")


def ctx(
    cached: dict[str, range],
    queued: dict[str, float],
    *,
    threshold: float = 1.5,
    seed: int = 0,
    links: LinkBook | None = None,
    pending: dict[str, tuple[int, ...]] | None = None,
) -> PlanContext:
    index = CacheIndex(NAMES)
    for name, blocks in cached.items():
        index.apply(BlockStored(name, tuple(blocks)))
    views = {n: PrefillView() for n in NAMES}
    for name, seconds in queued.items():
        keys = (pending or {}).get(name, ())
        views[name].add(1000 + NAMES.index(name), 0.0, 0.0, seconds, keys)
    return PlanContext(
        now=0.0, instances=NAMES, index=index, views=views, prefill_model=PREFILL,
        transfer=TRANSFER, links=links or LinkBook(TRANSFER), block_tokens=100,
        threshold=threshold, rng=random.Random(seed),
    )  # fmt: skip


def place(policy: PlacementPolicy, c: PlanContext):  # type: ignore[no-untyped-def]
    return PLACEMENTS[policy](c, REQ)


def test_random_is_seeded_and_spreads() -> None:
    picks = [place(PlacementPolicy.RANDOM, ctx({}, {}, seed=7)).instance for _ in range(3)]
    assert len(set(picks)) == 1  # same seed, same context: same pick
    c = ctx({}, {}, seed=1)
    counts = Counter(place(PlacementPolicy.RANDOM, c).instance for _ in range(300))
    assert set(counts) == set(NAMES)
    assert min(counts.values()) > 60


def test_random_still_reuses_what_it_lands_on() -> None:
    c = ctx({"p0": range(1, 9), "p1": range(1, 9), "p2": range(1, 9)}, {})
    plan = place(PlacementPolicy.RANDOM, c)
    assert plan.local_blocks == 8
    assert plan.prefill_s == pytest.approx(0.2)


def test_load_balance_ignores_cache() -> None:
    # p0 holds 8 of 10 blocks but has 0.5 s queued; p1 and p2 are idle -> p1 (first idle).
    c = ctx({"p0": range(1, 9)}, {"p0": 0.5, "p2": 0.1})
    plan = place(PlacementPolicy.LOAD_BALANCE, c)
    assert plan.instance == "p1"
    assert plan.ttft_s == pytest.approx(1.0)


def test_local_cache_trades_queue_for_hits() -> None:
    # p0: 0.5 queue + 0.2 prefill = 0.7 beats idle p1's full 1.0 s prefill.
    plan = place(PlacementPolicy.LOCAL_CACHE, ctx({"p0": range(1, 9)}, {"p0": 0.5}))
    assert (plan.instance, plan.local_blocks) == ("p0", 8)
    assert plan.ttft_s == pytest.approx(0.7)
    # With 2 s queued on p0 (2.2 s) the idle p1 (1.0 s) wins.
    plan = place(PlacementPolicy.LOCAL_CACHE, ctx({"p0": range(1, 9)}, {"p0": 2.0}))
    assert (plan.instance, plan.local_blocks) == ("p1", 0)
    assert plan.fetch_from is None


def _alg1_scene(threshold: float) -> PlanContext:
    # Best prefix: 8 blocks on p0, which has 2 s queued. p1 holds 3 blocks, idle.
    # p2 holds nothing, 0.2 s queued.
    return ctx({"p0": range(1, 9), "p1": range(1, 4)}, {"p0": 2.0, "p2": 0.2}, threshold=threshold)


def test_global_cache_fetches_the_best_prefix() -> None:
    # p1: 8/3 >= 1.5 -> fetch 500 tokens (0.25 s) + 0 queue + prefill of 200 tokens (0.2 s).
    # p2: fetch 800 tokens (0.4 s) + 0.2 + 0.2 = 0.8;  p0: 2.0 + 0.2 = 2.2.
    plan = place(PlacementPolicy.GLOBAL_CACHE, _alg1_scene(1.5))
    assert plan.instance == "p1"
    assert (plan.fetch_from, plan.local_blocks, plan.fetch_blocks) == ("p0", 3, 5)
    assert plan.transfer_s == pytest.approx(0.25)
    assert plan.ttft_s == pytest.approx(0.45)


def test_global_cache_threshold_keeps_a_good_enough_local_prefix() -> None:
    # threshold 3: p1's 8/3 < 3 -> computes from its own 3 blocks: 0.7 s (p2: 0.8 s).
    plan = place(PlacementPolicy.GLOBAL_CACHE, _alg1_scene(3.0))
    assert (plan.instance, plan.fetch_from, plan.local_blocks) == ("p1", None, 3)
    assert plan.ttft_s == pytest.approx(0.7)


def test_global_cache_beats_local_cache_in_hits() -> None:
    local = place(PlacementPolicy.LOCAL_CACHE, _alg1_scene(1.5))
    glob = place(PlacementPolicy.GLOBAL_CACHE, _alg1_scene(1.5))
    assert glob.local_blocks + glob.fetch_blocks > local.local_blocks
    assert glob.ttft_s < local.ttft_s


def _overlap_scene(links: LinkBook | None = None) -> PlanContext:
    # Best prefix 8 blocks on p0 (2 s queued); p1 empty with 1 s queued; p2 empty, 1.5 s queued.
    return ctx({"p0": range(1, 9)}, {"p0": 2.0, "p1": 1.0, "p2": 1.5}, links=links)


def test_adaptive_overlaps_the_fetch_with_the_queue() -> None:
    # Algorithm 1 adds: 0.4 transfer + 1.0 queue + 0.2 = 1.6 on p1.
    alg1 = place(PlacementPolicy.GLOBAL_CACHE, _overlap_scene())
    assert (alg1.instance, alg1.ttft_s) == ("p1", pytest.approx(1.6))
    # Ours: the fetch lands while p1 is busy: max(1.0, 0.4) + 0.2 = 1.2.
    ours = place(PlacementPolicy.ADAPTIVE, _overlap_scene())
    assert (ours.instance, ours.fetch_from) == ("p1", "p0")
    assert ours.ttft_s == pytest.approx(1.2)


def test_adaptive_sees_a_congested_holder() -> None:
    links = LinkBook(TRANSFER)
    links.book("p0", "elsewhere", 0.0, 6000)  # p0's NIC is busy until t = 3 s
    # Fetching from p0 now would land at 3.4 s; computing locally on p1 gives 1.0 + 1.0 = 2.0.
    ours = place(PlacementPolicy.ADAPTIVE, _overlap_scene(links))
    assert (ours.instance, ours.fetch_from) == ("p1", None)
    assert ours.ttft_s == pytest.approx(2.0)
    # Algorithm 1 prices the transfer by size alone and still plans the fetch.
    alg1 = place(PlacementPolicy.GLOBAL_CACHE, _overlap_scene(links))
    assert alg1.fetch_from == "p0"


def test_adaptive_counts_prefixes_queued_ahead() -> None:
    # Nothing is cached yet, but p0 (0.8 s queued) is computing blocks 1..8 of this conversation.
    c = ctx({}, {"p0": 0.8, "p1": 0.5, "p2": 0.5}, pending={"p0": tuple(range(1, 9))})
    ours = place(PlacementPolicy.ADAPTIVE, c)
    assert (ours.instance, ours.local_blocks) == ("p0", 8)
    assert ours.ttft_s == pytest.approx(1.0)
    # local-cache only sees stored blocks: p1 at 0.5 + 1.0 beats p0 at 0.8 + 1.0.
    assert place(PlacementPolicy.LOCAL_CACHE, c).instance == "p1"
