"""Placement: the value type, its derived maps and its load arithmetic."""

from __future__ import annotations

import pytest
import torch

from mooncake_connectors.errors import ConfigError
from mooncake_connectors.moe import Placement

# vLLM's EplbModelState docstring example: 2 layers, 6 physical and 4 logical experts, 3 ranks.
VLLM_P2L = torch.tensor([[0, 1, 2, 3, 0, 1], [0, 2, 0, 1, 0, 3]])
VLLM_L2P = torch.tensor(
    [
        [[0, 4, -1], [1, 5, -1], [2, -1, -1], [3, -1, -1]],
        [[0, 2, 4], [3, -1, -1], [1, -1, -1], [5, -1, -1]],
    ]
)
VLLM_COUNT = torch.tensor([[2, 2, 1, 1], [3, 1, 1, 1]])


def test_derived_maps_match_the_vllm_example() -> None:
    p = Placement(VLLM_P2L, num_logical=4, num_ranks=3)
    assert (p.num_layers, p.num_physical, p.slots_per_rank) == (2, 6, 2)
    assert torch.equal(p.replica_count(), VLLM_COUNT)
    assert torch.equal(p.logical_to_physical(3), VLLM_L2P)
    assert torch.equal(p.logical_to_physical(), VLLM_L2P)  # widest count is 3 already
    assert p.logical_to_physical(5).shape == (2, 4, 5)
    assert torch.equal(p.rank_of_physical(), torch.tensor([0, 0, 1, 1, 2, 2]))


def test_empty_slots_are_left_out_of_the_maps() -> None:
    p = Placement(torch.tensor([[0, 1, -1, -1, 1, 0]]), num_logical=2, num_ranks=3)
    assert torch.equal(p.replica_count(), torch.tensor([[2, 2]]))
    assert torch.equal(p.logical_to_physical(), torch.tensor([[[0, 5], [1, 4]]]))


def test_rank_load_splits_each_expert_evenly_over_its_replicas() -> None:
    p = Placement(VLLM_P2L, num_logical=4, num_ranks=3)
    load = torch.tensor([[8.0, 4.0, 2.0, 1.0], [9.0, 3.0, 5.0, 7.0]])
    # layer 0: slots hold 4, 2, 2, 1, 4, 2 -> ranks 6, 3, 6
    # layer 1: slots hold 3, 5, 3, 3, 3, 7 -> ranks 8, 6, 10
    assert torch.equal(
        p.rank_load(load), torch.tensor([[6.0, 3.0, 6.0], [8.0, 6.0, 10.0]], dtype=torch.float64)
    )
    ratio = p.balance(load)
    assert ratio[0].item() == pytest.approx(6.0 / 5.0)
    assert ratio[1].item() == pytest.approx(10.0 / 8.0)
    # One [N] load row applies to every layer.
    assert p.rank_load(torch.tensor([8.0, 4.0, 2.0, 1.0])).shape == (2, 3)


def test_balance_over_live_ranks_only() -> None:
    p = Placement(torch.tensor([[0, 1, -1, -1, 1, 0]]), num_logical=2, num_ranks=3)
    load = torch.tensor([4.0, 2.0])
    alive = torch.tensor([True, False, True])
    assert p.balance(load, alive).item() == pytest.approx(1.0)
    assert p.balance(load).item() == pytest.approx(3.0 / 2.0)


@pytest.mark.parametrize(
    ("p2l", "n", "r", "message"),
    [
        (torch.tensor([[0, 1, 2]]), 3, 2, "divide evenly"),
        (torch.tensor([[0, 1, 3, 0]]), 3, 2, r"\[-1, 3\)"),
        (torch.tensor([[0, 1, -2, 0]]), 3, 2, r"\[-1, 3\)"),
        (torch.tensor([[0, 1, 1, 0]]), 3, 2, "expert 2 has no slot in layer 0"),
        (torch.tensor([[0.0, 1.0]]), 2, 1, "integer"),
        (torch.zeros(0, 4, dtype=torch.int64), 2, 1, "L, P > 0"),
        (torch.tensor([[0, 1]]), 0, 1, "num_logical"),
        (torch.tensor([[0, 1]]), 2, 0, "num_ranks"),
    ],
)
def test_invalid_placements_raise(p2l: torch.Tensor, n: int, r: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Placement(p2l, num_logical=n, num_ranks=r)


@pytest.mark.parametrize(
    "load",
    [
        torch.tensor([1.0, float("nan"), 1.0, 1.0]),
        torch.tensor([1.0, -1.0, 1.0, 1.0]),
        torch.tensor([1.0, 1.0, 1.0]),
        torch.ones(3, 4),
    ],
)
def test_invalid_load_raises(load: torch.Tensor) -> None:
    p = Placement(VLLM_P2L, num_logical=4, num_ranks=3)
    with pytest.raises(ConfigError):
        p.rank_load(load)


def test_placement_is_normalised_to_int64_cpu_and_compares() -> None:
    p = Placement(VLLM_P2L.to(torch.int32), num_logical=4, num_ranks=3)
    assert p.physical_to_logical.dtype == torch.int64
    assert p.same_as(Placement(VLLM_P2L, 4, 3))
    assert not p.same_as(Placement(VLLM_P2L.flip(0), 4, 3))
    with pytest.raises(ConfigError, match="width"):
        p.logical_to_physical(2)
