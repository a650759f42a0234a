"""Engine map formats: vLLM's and SGLang's EPLB tensors to and from our placement."""

from __future__ import annotations

import dataclasses
from types import ModuleType, SimpleNamespace

import pytest
import torch

from mooncake_connectors.adapters.moe import (
    alive_from_active_ranks,
    apply_to_vllm_state,
    from_sglang,
    from_vllm,
    placement_from_sglang_metadata,
    placement_from_vllm_state,
    to_sglang,
    to_vllm,
)
from mooncake_connectors.errors import ConfigError
from mooncake_connectors.moe import ExpertRouter, Placement, plan_elastic, plan_placement

# vLLM's EplbModelState docstring example (2 layers, 6 physical, 4 logical, 3 EP ranks).
VLLM_P2L = torch.tensor([[0, 1, 2, 3, 0, 1], [0, 2, 0, 1, 0, 3]])
VLLM_L2P = torch.tensor(
    [
        [[0, 4, -1], [1, 5, -1], [2, -1, -1], [3, -1, -1]],
        [[0, 2, 4], [3, -1, -1], [1, -1, -1], [5, -1, -1]],
    ]
)
VLLM_COUNT = torch.tensor([[2, 2, 1, 1], [3, 1, 1, 1]])


def test_vllm_documented_example_converts_both_ways() -> None:
    placement = from_vllm(VLLM_P2L, VLLM_L2P, VLLM_COUNT, num_ranks=3)
    assert torch.equal(placement.physical_to_logical, VLLM_P2L)
    maps = to_vllm(placement)  # width P - N + 1 = 3, as vLLM sizes it
    assert torch.equal(maps.physical_to_logical_map, VLLM_P2L)
    assert torch.equal(maps.logical_to_physical_map, VLLM_L2P)
    assert torch.equal(maps.logical_replica_count, VLLM_COUNT)
    assert maps.logical_to_physical_map.dtype == torch.int64


def test_sglang_maps_pad_to_the_number_of_physical_experts() -> None:
    placement = Placement(VLLM_P2L, 4, 3)
    maps = to_sglang(placement, alive=torch.tensor([True, False, True]))
    assert maps.logical_to_all_physical_map.shape == (2, 4, 6)
    assert torch.equal(maps.logical_to_all_physical_map[..., :3], VLLM_L2P)
    assert bool((maps.logical_to_all_physical_map[..., 3:] == -1).all())
    assert torch.equal(maps.logical_to_all_physical_map_num_valid, VLLM_COUNT)
    assert maps.active_ranks.dtype == torch.int32
    assert maps.active_ranks.tolist() == [1, 0, 1]
    back = from_sglang(
        maps.physical_to_logical_map,
        maps.logical_to_all_physical_map,
        maps.logical_to_all_physical_map_num_valid,
        active_ranks=maps.active_ranks,
    )
    assert back.same_as(placement)
    assert alive_from_active_ranks(maps.active_ranks).tolist() == [True, False, True]


def test_empty_slots_survive_a_round_trip_through_both_formats() -> None:
    load = torch.arange(1.0, 17.0)
    placement = plan_placement(load, 24, 4)
    alive = torch.tensor([True, True, False, True])
    degraded = plan_elastic(placement, load, alive).placement
    sglang = to_sglang(degraded, alive=alive)
    # SGLang's elasticity-aware EPLB writes logical 0 into dead slots; so do we by default.
    assert bool((sglang.physical_to_logical_map[0, 12:18] == 0).all())
    assert from_sglang(
        sglang.physical_to_logical_map, sglang.logical_to_all_physical_map, num_ranks=4
    ).same_as(degraded)
    vllm = to_vllm(degraded, width=1024)  # older vLLM releases size the table this way
    assert from_vllm(
        vllm.physical_to_logical_map,
        vllm.logical_to_physical_map,
        vllm.logical_replica_count,
        num_ranks=4,
    ).same_as(degraded)


def test_deepseek_style_rebalance_output_is_accepted(reference: ModuleType) -> None:
    load = torch.rand(2, 32, generator=torch.Generator().manual_seed(0)) * 100
    p2l = reference.reference_rebalance(load, 48, 4, 2, 8)
    placement = Placement(p2l, 32, 8)
    maps = to_vllm(placement)
    again = from_vllm(
        maps.physical_to_logical_map,
        maps.logical_to_physical_map,
        maps.logical_replica_count,
        num_ranks=8,
    )
    assert torch.equal(again.physical_to_logical, p2l)
    # And our router runs on an engine-made placement.
    ids = torch.randint(0, 32, (64, 4), generator=torch.Generator().manual_seed(1))
    phys = ExpertRouter(again).route(ids, layer=1).physical_ids
    assert torch.equal(p2l[1][phys], ids)


def test_vllm_state_is_updated_in_place() -> None:
    old = Placement(VLLM_P2L, 4, 3)
    maps = to_vllm(old, width=8)
    # The seam: whatever object carries vLLM's three tensors; the model keeps references.
    state = SimpleNamespace(**dataclasses.asdict(maps))
    held = state.logical_to_physical_map
    new = Placement(VLLM_P2L.flip(1), 4, 3)
    apply_to_vllm_state(state, new)
    assert state.logical_to_physical_map is held
    assert placement_from_vllm_state(state, num_ranks=3).same_as(new)
    with pytest.raises(ConfigError, match="physical_to_logical_map"):
        apply_to_vllm_state(state, Placement(torch.tensor([[0, 1, 2, 3]]), 4, 2))


@pytest.mark.parametrize(
    ("p2l", "l2p", "count", "message"),
    [
        (VLLM_P2L, VLLM_L2P, VLLM_COUNT + 1, "replica count disagrees"),
        (VLLM_P2L.flip(1), VLLM_L2P, VLLM_COUNT, "disagrees"),
        (VLLM_P2L, VLLM_L2P.clamp(max=3), None, "more than one"),
        (VLLM_P2L, VLLM_L2P + 3, None, "slot >= 6"),
        (VLLM_P2L[:1], VLLM_L2P, VLLM_COUNT, "layers"),
        (VLLM_P2L.float(), VLLM_L2P, VLLM_COUNT, "integer"),
    ],
)
def test_inconsistent_maps_raise(
    p2l: torch.Tensor, l2p: torch.Tensor, count: torch.Tensor | None, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        from_vllm(p2l, l2p, count, num_ranks=3)


def test_sglang_needs_a_rank_count() -> None:
    with pytest.raises(ConfigError, match="num_ranks or active_ranks"):
        from_sglang(VLLM_P2L, VLLM_L2P)


# ------------------------------------------------------------- the engines' own classes


def test_round_trip_through_sglang_expert_location_metadata() -> None:
    module = pytest.importorskip(
        "sglang.srt.eplb.expert_location", reason="SGLang is not installed here (large engine)"
    )
    placement = plan_placement(torch.arange(1.0, 33.0), 48, 8)
    # Its __post_init__ checks that the three maps agree on layers and expert counts.
    meta = module.ExpertLocationMetadata(**to_sglang(placement).metadata_kwargs())
    assert placement_from_sglang_metadata(meta, num_ranks=8).same_as(placement)


def test_round_trip_through_vllm_eplb_model_state() -> None:
    module = pytest.importorskip(
        "vllm.distributed.eplb.eplb_state", reason="vLLM is not installed here (large engine)"
    )
    cls = getattr(module, "EplbModelState", None) or module.EplbState
    names = {f.name for f in dataclasses.fields(cls)}
    ours = {"physical_to_logical_map", "logical_to_physical_map", "logical_replica_count"}
    assert ours <= names, f"vLLM renamed its EPLB maps: {sorted(names)}"
    placement = plan_placement(torch.arange(1.0, 33.0), 48, 8)
    required = {
        f.name: None
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    state = cls(**{**required, **dataclasses.asdict(to_vllm(placement, width=1024))})
    assert placement_from_vllm_state(state, num_ranks=8).same_as(placement)
    other = plan_placement(torch.arange(32.0, 0.0, -1.0), 48, 8)
    apply_to_vllm_state(state, other)
    assert placement_from_vllm_state(state, num_ranks=8).same_as(other)
