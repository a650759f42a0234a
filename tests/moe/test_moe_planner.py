"""EPLB planning: replication, packing, flat and hierarchical placement, balance vs DeepSeek."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mooncake_connectors.bench.moe_workload import (
    expert_load,
    no_replication,
    zipf_gate_scores,
)
from mooncake_connectors.errors import ConfigError
from mooncake_connectors.moe import (
    Placement,
    pack_balanced,
    plan_placement,
    replicate_experts,
)


def zipf_load(exponent: float, seed: int, n: int = 256) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return expert_load(zipf_gate_scores(8192, n, exponent, gen), 8)


def test_replication_gives_each_slot_to_the_heaviest_per_replica_load() -> None:
    counts = replicate_experts(torch.tensor([[9.0, 3.0, 1.0], [1.0, 1.0, 1.0]]), 6)
    # Row 0: 9 -> 4.5 -> 3 (vs 3.0 of expert 1; ties go to the lower id): 9 gets 3 extra.
    assert counts.tolist() == [[4, 1, 1], [2, 2, 2]]
    assert replicate_experts(torch.tensor([9.0, 3.0, 1.0]), 6, max_replicas=2).tolist() == [
        [2, 2, 2]
    ]


def test_replication_rejects_impossible_requests() -> None:
    with pytest.raises(ConfigError, match="must be >="):
        replicate_experts(torch.ones(4), 3)
    with pytest.raises(ConfigError, match="at most 2 replicas"):
        replicate_experts(torch.ones(2), 5, max_replicas=2)


def test_packing_fills_every_pack_equally_and_beats_plain_greedy() -> None:
    # Greedy LPT with equal pack sizes: 8 | 7, 7 | 8, 5 | 8, 5, 4 (full) | 7, 7, 1 -> 17.
    # The optimum, 8 + 7 + 1 = 16 against 7 + 5 + 4 = 16, needs one swap.
    weights = torch.tensor([[8.0, 7.0, 7.0, 5.0, 4.0, 1.0]])

    def heaviest(packs: torch.Tensor) -> float:
        per_pack = torch.zeros(2, dtype=torch.float64).index_add_(0, packs[0], weights[0].double())
        return float(per_pack.max())

    greedy, _ = pack_balanced(weights, 2, refine=False)
    refined, rank = pack_balanced(weights, 2)
    assert torch.bincount(refined[0]).tolist() == [3, 3]
    assert heaviest(greedy) == 17.0
    assert heaviest(refined) == 16.0
    assert sorted(rank[0].tolist()) == [0, 0, 1, 1, 2, 2]


def test_packing_keeps_labels_apart() -> None:
    # Two replicas of expert 0 (weight 4 each) and four light experts into 2 packs of 3.
    weights = torch.tensor([[4.0, 4.0, 1.0, 1.0, 1.0, 1.0]])
    labels = torch.tensor([[0, 0, 1, 2, 3, 4]])
    packs, _ = pack_balanced(weights, 2, labels=labels)
    assert packs[0, 0] != packs[0, 1]


def check_full_placement(p: Placement, n: int, num_ranks: int, num_physical: int) -> None:
    p2l = p.physical_to_logical
    assert p2l.shape[1] == num_physical and p.num_ranks == num_ranks
    assert bool((p2l >= 0).all()), "a full plan leaves no slot empty"
    counts = p.replica_count()
    assert bool((counts >= 1).all()), "every logical expert placed"
    assert torch.equal(counts.sum(1), torch.full((p.num_layers,), num_physical))
    assert int(counts.max()) <= num_ranks


def test_flat_plan_is_valid_and_balanced() -> None:
    load = zipf_load(1.0, seed=1)
    p = plan_placement(load, 288, 32)
    check_full_placement(p, 256, 32, 288)
    assert p.balance(load).item() < 1.01


def test_multi_layer_plan_plans_each_layer_on_its_own_load() -> None:
    load = torch.stack([zipf_load(1.0, seed=2, n=64), zipf_load(1.2, seed=3, n=64)])
    p = plan_placement(load, 80, 16)
    check_full_placement(p, 64, 16, 80)
    for layer in range(2):
        single = plan_placement(load[layer], 80, 16)
        assert torch.equal(single.physical_to_logical[0], p.physical_to_logical[layer])


def test_hierarchical_plan_keeps_groups_and_their_replicas_inside_one_node() -> None:
    n, num_ranks, num_physical, nodes, groups = 64, 16, 80, 4, 8
    load = zipf_load(1.0, seed=4, n=n)
    p = plan_placement(load, num_physical, num_ranks, num_nodes=nodes, num_groups=groups)
    check_full_placement(p, n, num_ranks, num_physical)
    node_of_slot = torch.arange(num_physical) // (num_physical // nodes)
    group_of_slot = p.physical_to_logical[0] // (n // groups)
    for g in range(groups):
        assert len(set(node_of_slot[group_of_slot == g].tolist())) == 1, f"group {g} split"
    for node in range(nodes):
        assert len(set(group_of_slot[node_of_slot == node].tolist())) == groups // nodes


def test_groups_that_do_not_divide_over_nodes_fall_back_to_global() -> None:
    load = zipf_load(1.0, seed=5, n=60)
    hier = plan_placement(load, 80, 16, num_nodes=4, num_groups=3)
    flat = plan_placement(load, 80, 16)
    assert hier.same_as(flat)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_physical": 250, "num_ranks": 32}, "multiple of num_ranks"),
        ({"num_physical": 224, "num_ranks": 32}, r"must lie in \[256"),
        ({"num_physical": 288, "num_ranks": 32, "num_nodes": 5}, "multiple of num_nodes"),
        ({"num_physical": 288, "num_ranks": 32, "num_groups": 7}, "groups"),
        ({"num_physical": 288, "num_ranks": 0}, "num_ranks"),
    ],
)
def test_plan_rejects_bad_shapes(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        plan_placement(torch.ones(256), **kwargs)


BALANCE_CASES = [  # (ranks, physical, nodes, groups)
    (32, 288, 1, 1),
    (64, 320, 1, 1),
    (32, 288, 4, 8),
    (64, 320, 8, 8),
]


@pytest.mark.parametrize("exponent", [0.8, 1.0, 1.2])
def test_balance_within_5_percent_of_deepseek_eplb_and_far_below_no_replication(
    reference: ModuleType, exponent: float
) -> None:
    n = 256
    load = zipf_load(exponent, seed=int(exponent * 10))
    best_ours = best_deepseek = float("inf")
    for num_ranks, num_physical, nodes, groups in BALANCE_CASES:
        ours = plan_placement(load, num_physical, num_ranks, num_nodes=nodes, num_groups=groups)
        ds_p2l = reference.reference_rebalance(
            load.unsqueeze(0), num_physical, groups, nodes, num_ranks
        )
        deepseek = Placement(ds_p2l, n, num_ranks)
        check_full_placement(deepseek, n, num_ranks, num_physical)  # the baseline is sane too
        ours_ratio = ours.balance(load).item()
        ds_ratio = deepseek.balance(load).item()
        none_ratio = no_replication(n, num_ranks).balance(load).item()
        case = (exponent, num_ranks, num_physical, nodes, groups, ours_ratio, ds_ratio)
        assert ours_ratio <= 1.05 * ds_ratio, case
        assert ours_ratio < 0.5 * none_ratio, (case, none_ratio)
        best_ours = min(best_ours, ours_ratio)
        best_deepseek = min(best_deepseek, ds_ratio)
    assert best_ours <= 1.05 * best_deepseek
    # Not just "within 5%": on these skewed loads the refined packing is at least as good.
    assert best_ours <= best_deepseek


def test_balance_of_global_plans_is_not_worse_than_deepseek_on_average(
    reference: ModuleType,
) -> None:
    ours_total = ds_total = 0.0
    for seed in range(3):
        load = zipf_load(1.1, seed=100 + seed)
        for num_ranks, num_physical in ((32, 288), (64, 320), (16, 272)):
            ours_total += plan_placement(load, num_physical, num_ranks).balance(load).item()
            p2l = reference.reference_rebalance(load.unsqueeze(0), num_physical, 1, 1, num_ranks)
            ds_total += Placement(p2l, 256, num_ranks).balance(load).item()
    assert ours_total <= ds_total


@st.composite
def plan_inputs(draw: st.DrawFn) -> tuple[torch.Tensor, int, int, int, int]:
    num_ranks = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    nodes = draw(st.sampled_from([d for d in (1, 2, 4) if num_ranks % d == 0]))
    groups = draw(st.sampled_from([1, 2, 4]))
    n = groups * draw(st.integers(1, 6))
    least = -(-n // num_ranks)  # slots per rank needed to hold every expert once
    slots = draw(st.integers(least, min(n, least + 3)))
    hierarchical = nodes > 1 and groups % nodes == 0
    if hierarchical and slots > n // nodes:
        nodes = 1  # a node could not spread its replicas over distinct ranks
    values = draw(st.lists(st.floats(0, 1e4, allow_nan=False), min_size=n, max_size=n))
    return torch.tensor(values, dtype=torch.float64), num_ranks * slots, num_ranks, nodes, groups


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan_inputs())
def test_property_every_expert_placed_and_capacities_respected(
    args: tuple[torch.Tensor, int, int, int, int],
) -> None:
    load, num_physical, num_ranks, nodes, groups = args
    n = load.shape[0]
    p = plan_placement(
        load,
        num_physical,
        num_ranks,
        num_nodes=nodes,
        num_groups=groups,
        spread_tolerance=float("inf"),
    )
    check_full_placement(p, n, num_ranks, num_physical)
    slots = num_physical // num_ranks
    per_rank = p.physical_to_logical[0].view(num_ranks, slots)
    assert all(len(row) == slots for row in per_rank.tolist())
