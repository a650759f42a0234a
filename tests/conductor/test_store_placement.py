"""Placement over a shared KV store, and the large-pool search that stays O(prompt blocks)."""

from __future__ import annotations

import random

import pytest

from mooncake_connectors.conductor import (
    Admission,
    BlockRemoved,
    BlockStored,
    CacheIndex,
    Conductor,
    Placement,
    PlacementPolicy,
    Rejection,
    ScheduleRequest,
    policies,
)
from mooncake_connectors.conductor.cache_index import AllBlocksCleared
from mooncake_connectors.conductor.types import STORE
from mooncake_connectors.errors import ConfigError

from .conftest import make_config

KEYS = tuple(range(1, 11))  # a 1000-token prompt of ten 100-token blocks


@pytest.mark.parametrize("policy", [PlacementPolicy.GLOBAL_CACHE, PlacementPolicy.ADAPTIVE])
def test_a_busy_holder_sends_the_prompt_elsewhere_to_load_from_the_store(
    policy: PlacementPolicy,
) -> None:
    c = Conductor(make_config(policy, store=True))
    c.apply_cache_event(BlockStored("p0", KEYS[:8]))
    # p0 is busy for 3 s; loading 800 tokens from the store costs 0.4 s
    c.set_external_load("p0", prefill_s=3.0)
    d = c.schedule(ScheduleRequest(1, 1000, KEYS, store_blocks=8), now=0.0)
    assert isinstance(d, Placement)
    assert d.prefill != "p0"
    assert (d.fetch_from, d.fetch_blocks, d.local_blocks) == (STORE, 8, 0)
    assert d.est_transfer_s == pytest.approx(0.4)
    assert d.est_ttft_s == pytest.approx(0.4 + 0.2)  # load, then the 200 uncached tokens


def test_store_blocks_come_from_store_events_when_the_request_does_not_say() -> None:
    c = Conductor(make_config(PlacementPolicy.GLOBAL_CACHE, store=True))
    c.apply_cache_event(BlockStored(STORE, KEYS[:5]))
    d = c.schedule(ScheduleRequest(1, 1000, KEYS), now=0.0)
    assert isinstance(d, Placement) and (d.fetch_from, d.fetch_blocks) == (STORE, 5)
    c.apply_cache_event(BlockRemoved(STORE, KEYS[:1]))
    d = c.schedule(ScheduleRequest(2, 1000, KEYS), now=0.0)
    assert isinstance(d, Placement) and d.fetch_from is None


def test_without_the_store_nothing_is_fetched_from_it() -> None:
    c = Conductor(make_config(PlacementPolicy.GLOBAL_CACHE))
    d = c.schedule(ScheduleRequest(1, 1000, KEYS, store_blocks=8), now=0.0)
    assert isinstance(d, Placement) and d.fetch_from is None
    with pytest.raises(ConfigError):
        make_config(PlacementPolicy.GLOBAL_CACHE, prefill=1, store=True).__class__(
            prefill_instances=(STORE,), decode_instances=("d0",),
            prefill_model=c.config.prefill_model, transfer_model=c.config.transfer_model,
            decode_model=c.config.decode_model,
        )  # fmt: skip


def test_admission_counts_the_store_load() -> None:
    # 1000 tokens: 1.0 s computed, or 0.4 s load + 0.2 s prefill from the store
    cfg = make_config(PlacementPolicy.GLOBAL_CACHE, Admission.EARLY, store=True, ttft_slo_s=0.5)
    c = Conductor(cfg)
    r = c.schedule(ScheduleRequest(1, 1000, KEYS, store_blocks=8), now=0.0)
    assert isinstance(r, Rejection) and r.est_ttft_s == pytest.approx(0.6)
    c2 = Conductor(make_config(PlacementPolicy.GLOBAL_CACHE, Admission.EARLY, store=True))
    ok = c2.schedule(ScheduleRequest(1, 1000, KEYS, store_blocks=8), now=0.0)
    assert isinstance(ok, Placement) and ok.est_ttft_s == pytest.approx(0.6)


def test_store_loads_book_only_the_receiving_instance() -> None:
    c = Conductor(make_config(PlacementPolicy.ADAPTIVE, store=True, prefill=2))
    a = c.schedule(ScheduleRequest(1, 1000, KEYS, store_blocks=8), now=0.0)
    other = tuple(range(101, 111))
    b = c.schedule(ScheduleRequest(2, 1000, other, store_blocks=8), now=0.0)
    assert isinstance(a, Placement) and isinstance(b, Placement)
    assert a.prefill != b.prefill  # two instances load at once: the store is no single NIC
    assert a.est_transfer_s == pytest.approx(b.est_transfer_s) == pytest.approx(0.4)


def test_holder_matches_agree_with_a_scan_of_every_instance() -> None:
    rng = random.Random(3)
    names = [f"p{i}" for i in range(12)]
    idx = CacheIndex(names)
    prompts = [tuple(rng.randrange(40) for _ in range(rng.randrange(1, 8))) for _ in range(30)]
    for step in range(400):
        name = rng.choice(names)
        keys = rng.choice(prompts)
        kind = rng.random()
        if kind < 0.6:
            idx.apply(BlockStored(name, keys[: rng.randrange(1, len(keys) + 1)]))
        elif kind < 0.95:
            idx.apply(BlockRemoved(name, keys[rng.randrange(len(keys)) :]))
        else:
            idx.apply(AllBlocksCleared(name))
        probe = rng.choice(prompts)
        full = {n: m for n, m in idx.matches(probe).items() if m}
        assert idx.holder_matches(probe) == full, step


@pytest.mark.parametrize(
    "policy",
    [
        PlacementPolicy.LOAD_BALANCE,
        PlacementPolicy.LOCAL_CACHE,
        PlacementPolicy.GLOBAL_CACHE,
        PlacementPolicy.ADAPTIVE,
    ],
)
@pytest.mark.parametrize("store", [False, True])
@pytest.mark.parametrize("lazy", [False, True])
def test_the_large_pool_search_finds_plans_as_good_as_a_full_scan(
    policy: PlacementPolicy, store: bool, lazy: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same traffic through both searches: every decision's estimate is equally good.

    ``lazy``: every prefix counts as popular (held by many), so instances are matched one by
    one in load order instead of through the holder sets. 20 instances stay within the walk's
    limit, where the search is exact.
    """
    if lazy:
        monkeypatch.setattr(policies, "_EXPLICIT_HOLDERS", 0)
    full = Conductor(make_config(policy, prefill=20, store=store, exhaustive_up_to=1000))
    fast = Conductor(make_config(policy, prefill=20, store=store, exhaustive_up_to=0))
    rng = random.Random(11)
    stems = [tuple(rng.randrange(1 << 30) for _ in range(8)) for _ in range(6)]
    done: list[int] = []
    for rid in range(1, 301):
        now = rid * 0.05
        stem = rng.choice(stems)
        keys = stem[: rng.randrange(1, 9)]
        n = len(keys) * 100 + rng.randrange(100)
        sreq = ScheduleRequest(rid, n, keys, store_blocks=rng.randrange(len(keys) + 1))
        a, b = full.schedule(sreq, now), fast.schedule(sreq, now)
        assert isinstance(a, Placement) and isinstance(b, Placement)
        if policy is PlacementPolicy.LOAD_BALANCE:  # the cache plays no part in the choice
            assert b.est_queue_s == pytest.approx(a.est_queue_s), rid
        else:
            assert b.est_ttft_s == pytest.approx(a.est_ttft_s), rid
        # keep both in the same state: report what the full scan chose to both
        for c, d in ((full, a), (fast, b)):
            c.apply_cache_event(BlockStored(d.prefill, keys))
        if rid % 7 == 0:
            ext, load = rng.choice(full.config.prefill_instances), rng.random()
            for c in (full, fast):
                c.set_external_load(ext, prefill_s=load)
        done.append(rid)
        while len(done) > 12:
            old = done.pop(0)
            for c in (full, fast):
                c.prefill_finished(old, now)
                c.decode_finished(old, now, 10)
        if a.prefill != b.prefill:
            # equal estimates, different instance: both now diverge; restart the comparison
            full = Conductor(make_config(policy, prefill=20, store=store, exhaustive_up_to=1000))
            fast = Conductor(make_config(policy, prefill=20, store=store, exhaustive_up_to=0))
            done.clear()
