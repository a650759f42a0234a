"""Elastic re-planning: only live ranks, every expert placed, the fewest possible moves."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mooncake_connectors.bench.moe_workload import expert_load, zipf_gate_scores
from mooncake_connectors.errors import ConfigError
from mooncake_connectors.moe import (
    EMPTY_SLOT,
    Placement,
    placement_moves,
    plan_elastic,
    plan_placement,
)


def zipf_load(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return expert_load(zipf_gate_scores(4096, n, 1.0, gen), 8)


def fully_lost(p: Placement, alive: torch.Tensor) -> torch.Tensor:
    """[L, N] experts with no replica on a live rank (computed from scratch)."""
    rank = p.rank_of_physical()
    out = torch.ones(p.num_layers, p.num_logical, dtype=torch.bool)
    for layer in range(p.num_layers):
        for slot, e in enumerate(p.physical_to_logical[layer].tolist()):
            if e >= 0 and bool(alive[rank[slot]]):
                out[layer, e] = False
    return out


def check_live_only(plan_p: Placement, alive: torch.Tensor) -> None:
    slots = plan_p.physical_to_logical.view(plan_p.num_layers, plan_p.num_ranks, -1)
    assert bool((slots[:, ~alive] == EMPTY_SLOT).all()), "dead ranks hold nothing"
    assert bool((slots[:, alive] >= 0).all()), "live slots are all used"
    assert bool((plan_p.replica_count() >= 1).all()), "every expert placed"


def test_single_rank_loss_moves_exactly_the_lost_experts() -> None:
    n, num_ranks, num_physical = 64, 16, 80
    load = zipf_load(n, seed=1)
    before = plan_placement(load, num_physical, num_ranks)
    alive = torch.ones(num_ranks, dtype=torch.bool)
    alive[5] = False
    lost = fully_lost(before, alive)
    assert int(lost.sum()) > 0, "the scenario must lose some expert completely"
    plan = plan_elastic(before, load, alive)
    check_live_only(plan.placement, alive)
    assert torch.equal(plan.lost, lost)
    assert plan.num_moves == int(lost.sum())
    # Each move brings back a lost expert; nothing else changed on live ranks.
    assert sorted(plan.moves[:, 3].tolist()) == sorted(lost[0].nonzero().squeeze(1).tolist())
    assert torch.equal(plan.moves, placement_moves(before, plan.placement))


def test_extra_moves_buy_balance_back() -> None:
    n, num_ranks, num_physical = 256, 32, 288
    load = zipf_load(n, seed=2)
    before = plan_placement(load, num_physical, num_ranks)
    alive = torch.ones(num_ranks, dtype=torch.bool)
    alive[7] = False
    minimal = plan_elastic(before, load, alive)
    budget = plan_elastic(before, load, alive, max_extra_moves=24)
    check_live_only(budget.placement, alive)
    assert minimal.num_moves < budget.num_moves <= minimal.num_moves + 24
    assert (
        budget.placement.balance(load, alive).item() < minimal.placement.balance(load, alive).item()
    )


def test_rejoining_rank_gets_its_slots_filled() -> None:
    n, num_ranks, num_physical = 32, 8, 48
    load = zipf_load(n, seed=3)
    before = plan_placement(load, num_physical, num_ranks)
    alive = torch.ones(num_ranks, dtype=torch.bool)
    alive[2] = False
    degraded = plan_elastic(before, load, alive).placement
    healed = plan_elastic(degraded, load, torch.ones(num_ranks, dtype=torch.bool))
    check_live_only(healed.placement, torch.ones(num_ranks, dtype=torch.bool))
    slots = num_physical // num_ranks
    assert healed.num_moves == slots, "only the rejoined rank's slots are loaded"
    assert bool((healed.moves[:, 2] == EMPTY_SLOT).all())
    assert bool((healed.moves[:, 1] // slots == 2).all())
    assert healed.placement.balance(load).item() <= degraded.balance(load, alive).item() + 1e-9


def test_new_ranks_can_join_beyond_the_old_count() -> None:
    load = zipf_load(16, seed=4)
    before = plan_placement(load, 24, 4)
    grown = plan_elastic(before, load, torch.ones(6, dtype=torch.bool))
    assert grown.placement.num_ranks == 6 and grown.placement.num_physical == 36
    check_live_only(grown.placement, torch.ones(6, dtype=torch.bool))
    assert grown.num_moves == 12
    assert torch.equal(grown.placement.physical_to_logical[:, :24], before.physical_to_logical)


def test_co_located_replicas_are_handled() -> None:
    # Expert 0 twice on rank 0 (a planner may co-locate within its spread tolerance).
    before = Placement(torch.tensor([[0, 0, 1, 2, 3, 4, 5, 0, 1]]), 6, 3)
    alive = torch.tensor([True, False, True])
    plan = plan_elastic(before, torch.tensor([6.0, 3.0, 2.0, 2.0, 1.0, 1.0]), alive)
    check_live_only(plan.placement, alive)
    assert plan.num_moves == 3  # experts 2, 3 and 4 lived only on rank 1
    assert sorted(plan.moves[:, 3].tolist()) == [2, 3, 4]


def test_too_few_live_slots_raise() -> None:
    before = plan_placement(torch.ones(8), 8, 4)
    alive = torch.tensor([True, False, True, True])
    with pytest.raises(ConfigError, match="cannot hold 8 experts"):
        plan_elastic(before, torch.ones(8), alive)
    with pytest.raises(ConfigError, match="alive covers 3 ranks"):
        plan_elastic(before, torch.ones(8), torch.ones(3, dtype=torch.bool))
    with pytest.raises(ConfigError, match="max_extra_moves"):
        plan_elastic(before, torch.ones(8), torch.ones(4, dtype=torch.bool), max_extra_moves=-1)


@st.composite
def elastic_inputs(draw: st.DrawFn) -> tuple[torch.Tensor, int, int, int, int]:
    num_ranks = draw(st.integers(2, 8))
    n = draw(st.integers(1, 24))
    # Enough slots that one rank can go: (R - 1) * S >= N.
    least = -(-n // (num_ranks - 1))
    slots = draw(st.integers(least, min(n, least + 2)))
    layers = draw(st.integers(1, 2))
    values = draw(
        st.lists(st.floats(0, 1e4, allow_nan=False), min_size=layers * n, max_size=layers * n)
    )
    dead = draw(st.integers(0, num_ranks - 1))
    load = torch.tensor(values, dtype=torch.float64).view(layers, n)
    return load, num_ranks * slots, num_ranks, dead, draw(st.integers(0, 4))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(elastic_inputs())
def test_property_minimal_movement_after_single_rank_loss(
    args: tuple[torch.Tensor, int, int, int, int],
) -> None:
    load, num_physical, num_ranks, dead, extra = args
    before = plan_placement(load, num_physical, num_ranks)
    alive = torch.ones(num_ranks, dtype=torch.bool)
    alive[dead] = False
    lost = fully_lost(before, alive)
    plan = plan_elastic(before, load, alive)
    check_live_only(plan.placement, alive)
    # A lost expert needs one slot to come back; a plan cannot move fewer.
    assert plan.num_moves == int(lost.sum())
    budget = plan_elastic(before, load, alive, max_extra_moves=extra)
    check_live_only(budget.placement, alive)
    assert int(lost.sum()) <= budget.num_moves <= int(lost.sum()) + extra * load.shape[0]
