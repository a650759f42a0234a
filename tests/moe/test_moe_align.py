"""align_to_previous: a fresh plan renamed onto the running placement moves fewer experts and
keeps its balance, replica counts and node grouping."""

from __future__ import annotations

import pytest
import torch

from mooncake_connectors.errors import ConfigError
from mooncake_connectors.moe.align import align_to_previous, cross_rank_moves
from mooncake_connectors.moe.planner import plan_placement


def _skewed(seed: int, layers: int, n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(layers, n, generator=gen, dtype=torch.float64) ** 4 * 1000


@pytest.mark.parametrize(("nodes", "groups"), [(1, 1), (4, 8)])
def test_alignment_moves_fewer_experts_and_changes_nothing_else(nodes: int, groups: int) -> None:
    n, phys, ranks = 64, 80, 16
    before = plan_placement(_skewed(1, 3, n), phys, ranks, num_nodes=nodes, num_groups=groups)
    load = 0.7 * _skewed(1, 3, n) + 0.3 * _skewed(2, 3, n)
    plan = plan_placement(load, phys, ranks, num_nodes=nodes, num_groups=groups)
    aligned = align_to_previous(plan, before.physical_to_logical, num_nodes=nodes)
    old = before.physical_to_logical
    assert cross_rank_moves(old, aligned.physical_to_logical, ranks) < cross_rank_moves(
        old, plan.physical_to_logical, ranks
    )
    assert torch.equal(aligned.replica_count(), plan.replica_count())
    assert torch.allclose(aligned.balance(load), plan.balance(load))

    # Ranks are renamed whole: the multiset of per-rank expert sets is the plan's.
    def rank_sets(p2l: torch.Tensor) -> list[list[tuple[int, ...]]]:
        return [sorted(tuple(sorted(r)) for r in row.view(ranks, -1).tolist()) for row in p2l]

    assert rank_sets(aligned.physical_to_logical) == rank_sets(plan.physical_to_logical)
    if nodes > 1:  # a node's ranks stay together: each node holds whole groups
        per_node = phys // nodes
        group_of = aligned.physical_to_logical // (n // groups)
        for layer in range(3):
            for node in range(nodes):
                block = group_of[layer, node * per_node : (node + 1) * per_node]
                assert len(set(block.tolist())) == groups // nodes


def test_an_unchanged_plan_keeps_every_slot_and_a_new_shape_is_left_alone() -> None:
    plan = plan_placement(_skewed(3, 2, 32), 40, 8)
    shuffled = plan.physical_to_logical.view(2, 8, 5).flip(1).flip(2).reshape(2, 40)
    aligned = align_to_previous(plan, shuffled)
    assert torch.equal(aligned.physical_to_logical, shuffled)
    assert cross_rank_moves(shuffled, aligned.physical_to_logical, 8) == 0
    assert align_to_previous(plan, torch.zeros(2, 48, dtype=torch.int64)) is plan
    with pytest.raises(ConfigError):
        align_to_previous(plan, shuffled.double())
    with pytest.raises(ConfigError):
        align_to_previous(plan, shuffled, num_nodes=3)
    with pytest.raises(ConfigError):
        cross_rank_moves(shuffled, shuffled[:, :32], 8)
