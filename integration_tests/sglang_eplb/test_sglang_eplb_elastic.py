"""A rank dies under SGLang's elastic EP: our hook re-plans through SGLang's own classes.

SGLang's elasticity-aware EPLB reads ``ElasticEPStateManager``'s ``active_ranks`` (Mooncake EP
clears a failed rank's entry) and is called through ``eplb_algorithms.rebalance_experts`` by
the rebalance that ``maybe_rebalance_after_rank_fault`` starts. Here SGLang's own state manager
holds the mask, SGLang's own global ``ExpertLocationMetadata`` holds the map being served, and
SGLang's patched ``rebalance_experts`` is called the way ``init_by_eplb`` calls it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("sglang")

import torch
import torch.nn.functional as F
from sglang.srt.elastic_ep.elastic_ep import ElasticEPStateManager
from sglang.srt.eplb import eplb_algorithms, expert_location
from sglang.srt.eplb.eplb_algorithms import EplbAlgorithm
from sglang.srt.eplb.expert_location import ExpertLocationMetadata
from sglang.srt.plugins.hook_registry import HookRegistry

from mooncake_connectors.adapters.eplb_switch import EPLB_POLICY_ENV
from mooncake_connectors.adapters.moe.engine_maps import to_sglang
from mooncake_connectors.adapters.sglang import eplb, plugin
from mooncake_connectors.moe.planner import plan_placement

N, RANKS, LOCAL, LAYERS, DEAD = 32, 8, 6, 2, 3
PHYSICAL = RANKS * LOCAL


@pytest.fixture
def sglang_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """SGLang's hook registry, elastic state and global expert locations, restored after."""
    original = eplb_algorithms.rebalance_experts
    monkeypatch.setattr(eplb_algorithms, "rebalance_experts", original)
    monkeypatch.setattr(ElasticEPStateManager, "_instance", None)
    HookRegistry.reset()
    yield original
    HookRegistry.reset()
    expert_location.set_global_expert_location_metadata(None, allow_overwrite=True)


def _load(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(1, LAYERS, N, generator=gen) ** 4 * 1000).round() + 1


def _serve(maps: Any) -> None:
    """Put maps into SGLang's global ExpertLocationMetadata, as SGLang's startup does."""
    expert_location.set_global_expert_location_metadata(
        ExpertLocationMetadata(**maps.metadata_kwargs()), allow_overwrite=True
    )


def _kill(rank: int) -> Any:
    state = ElasticEPStateManager._build_state(ep_size=RANKS, device=torch.device("cpu"))
    state.active_ranks[rank] = 0  # what Mooncake EP does to a failed rank's entry
    ElasticEPStateManager._instance = state
    return state


def _call(algorithm: EplbAlgorithm, counts: torch.Tensor) -> Any:
    return eplb_algorithms.rebalance_experts(
        tokens_per_expert=counts,
        num_physical_experts=PHYSICAL,
        num_local_physical_experts=LOCAL,
        num_groups=4,
        num_nodes=1,
        algorithm=algorithm,
    )


def _check_served_by_live_ranks(out: Any, dead: int) -> None:
    """What SGLang's dispatch reads: no slot of the dead rank, every expert on a live slot."""
    p2l, l2p, count = out
    assert tuple(p2l.shape) == (LAYERS, PHYSICAL) and tuple(l2p.shape[:2]) == (LAYERS, N)
    assert int(count.min()) >= 1  # coverage: every logical expert has a live replica
    assert bool((count.sum(1) == (RANKS - 1) * LOCAL).all())
    assert torch.equal(torch.count_nonzero(l2p != -1, dim=-1), count)
    selected = l2p[l2p >= 0]
    assert not bool(((selected // LOCAL) == dead).any())  # nothing routed to the dead rank
    for layer in range(LAYERS):
        for expert in range(N):
            slots = l2p[layer, expert, : int(count[layer, expert])]
            assert bool((p2l[layer, slots] == expert).all())
    # SGLang's metadata accepts it as its _init_raw builds it (table padded to P).
    padded = F.pad(l2p, (0, PHYSICAL - l2p.shape[-1]), value=-1)
    ExpertLocationMetadata(
        physical_to_logical_map=p2l,
        physical_to_logical_map_cpu=p2l,
        logical_to_all_physical_map=padded,
        logical_to_all_physical_map_cpu=padded,
        logical_to_all_physical_map_num_valid=count,
        ep_size=RANKS,
        logical_to_rank_dispatch_physical_map=None,
    )


@pytest.mark.parametrize(
    "algorithm", [EplbAlgorithm.elasticity_aware, EplbAlgorithm.elasticity_aware_hierarchical]
)
def test_a_dead_rank_is_masked_and_its_experts_rehomed_with_the_fewest_moves(
    sglang_state: Any, monkeypatch: pytest.MonkeyPatch, algorithm: EplbAlgorithm
) -> None:
    counts = _load(11)
    served = plan_placement(counts.sum(0), PHYSICAL, RANKS)
    _serve(to_sglang(served))
    _kill(DEAD)
    theirs = sglang_state(counts, PHYSICAL, LOCAL, 4, 1, algorithm)  # SGLang's own answer
    monkeypatch.setenv(EPLB_POLICY_ENV, "mooncake")
    plugin.register()
    HookRegistry.apply_hooks()
    ours = _call(algorithm, counts)
    _check_served_by_live_ranks(theirs, DEAD)  # the checks SGLang's own answer passes
    _check_served_by_live_ranks(ours, DEAD)
    # Re-homed from the map being served: on live ranks only the experts that lived only on
    # the dead rank took a slot; every other live slot keeps its expert (no restart, no reload).
    before = served.physical_to_logical.view(LAYERS, RANKS, LOCAL)
    after = ours[0].view(LAYERS, RANKS, LOCAL)
    live = [r for r in range(RANKS) if r != DEAD]
    for layer in range(LAYERS):
        on_dead_only = set(before[layer, DEAD].tolist()) - set(
            before[layer, live].flatten().tolist()
        )
        changed = (before[layer, live] != after[layer, live]).sum()
        assert int(changed) == len(on_dead_only)
        assert (
            set(after[layer, live][before[layer, live] != after[layer, live]].tolist())
            == on_dead_only
        )
    # SGLang's own algorithm plans afresh over the live ranks and moves more.
    moved_theirs = int((theirs[0].view(LAYERS, RANKS, LOCAL)[:, live] != before[:, live]).sum())
    moved_ours = int((after[:, live] != before[:, live]).sum())
    assert moved_ours < moved_theirs


def test_without_a_served_map_the_live_ranks_get_a_fresh_plan(
    sglang_state: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    expert_location.set_global_expert_location_metadata(None, allow_overwrite=True)
    _kill(0)
    monkeypatch.setenv(EPLB_POLICY_ENV, "mooncake")
    plugin.register()
    HookRegistry.apply_hooks()
    _check_served_by_live_ranks(_call(EplbAlgorithm.elasticity_aware, _load(12)), 0)


def test_all_ranks_live_is_a_plain_plan_and_too_few_live_slots_are_refused(
    sglang_state: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    counts = _load(13)
    ElasticEPStateManager._instance = ElasticEPStateManager._build_state(
        ep_size=RANKS, device=torch.device("cpu")
    )
    monkeypatch.setenv(EPLB_POLICY_ENV, "mooncake")
    plugin.register()
    HookRegistry.apply_hooks()
    p2l, _l2p, count = _call(EplbAlgorithm.elasticity_aware, counts)
    assert torch.equal(p2l, eplb.rebalance(counts, PHYSICAL, LOCAL, 4, 1, False)[0])
    assert bool((count.sum(1) == PHYSICAL).all())
    state = ElasticEPStateManager._instance
    state.active_ranks[:] = 0
    state.active_ranks[:2] = 1  # 2 live ranks x 6 slots cannot hold 32 experts
    _serve(to_sglang(plan_placement(counts.sum(0), PHYSICAL, RANKS)))
    with pytest.raises(ValueError, match="cannot hold 32 experts"):
        _call(EplbAlgorithm.elasticity_aware, counts)


def test_a_served_map_of_another_size_is_not_used(
    sglang_state: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After an elastic scale SGLang's served map can have another slot count (here 7 x 6 =
    42 slots, which 8 ranks cannot split); the hook then plans afresh instead of failing."""
    counts = _load(14)
    _serve(to_sglang(plan_placement(counts.sum(0), 7 * LOCAL, 7)))
    _kill(DEAD)
    monkeypatch.setenv(EPLB_POLICY_ENV, "mooncake")
    plugin.register()
    HookRegistry.apply_hooks()
    _check_served_by_live_ranks(_call(EplbAlgorithm.elasticity_aware, counts), DEAD)
    assert tuple(_call(EplbAlgorithm.deepseek, counts)[0].shape) == (LAYERS, PHYSICAL)
