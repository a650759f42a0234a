"""vLLM 0.32's elastic EP scale-down with our policy, through vLLM's own EPLB functions.

vLLM 0.32 has no rank-health mask in EPLB: a rank leaves only by a planned scale-down
(``ElasticEPScalingExecutor.perform_scale_down_eplb_reshuffle``), whose ``rank_mapping`` keeps
ranks ``0 .. new - 1`` and sends the rest to -1, after which ``EplbState.rearrange`` calls the
policy with the survivors' ranks and replicas and the old, wider map, and
``rebalance_execute._map_new_expert_indices_with_rank_mapping`` lays the answer back over the old
ranks (the leaving ranks, still up, send their experts before they shut down). Here those
functions are called the way ``rearrange`` calls them; no engine runs.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch
from vllm.distributed.eplb import rebalance_execute
from vllm.distributed.eplb.eplb_state import compute_logical_maps
from vllm.distributed.eplb.policy.default import DefaultEplbPolicy

from mooncake_connectors.adapters.vllm.eplb import MooncakeEplbPolicy
from mooncake_connectors.moe.align import cross_rank_moves

N, OLD_RANKS, NEW_RANKS, LOCAL, LAYERS, GROUPS = 32, 8, 6, 6, 3, 4


def _load(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(LAYERS, N, generator=gen) ** 4 * 1000).round() + 1


@pytest.mark.parametrize("policy", [DefaultEplbPolicy, MooncakeEplbPolicy])
def test_scale_down_leaves_no_slot_on_the_leaving_ranks_and_covers_every_expert(
    policy: type,
) -> None:
    old = MooncakeEplbPolicy.rebalance_experts(_load(1), OLD_RANKS * LOCAL, GROUPS, 1, OLD_RANKS)
    # perform_scale_down_eplb_reshuffle's mapping, then rearrange's replica count.
    rank_mapping = {r: r if r < NEW_RANKS else -1 for r in range(OLD_RANKS)}
    replicas = OLD_RANKS * LOCAL // OLD_RANKS * NEW_RANKS
    new = policy.rebalance_experts(_load(2), replicas, GROUPS, 1, NEW_RANKS, old)
    assert tuple(new.shape) == (LAYERS, replicas)
    laid = rebalance_execute._map_new_expert_indices_with_rank_mapping(new, rank_mapping)
    assert tuple(laid.shape) == (LAYERS, OLD_RANKS * LOCAL)
    l2p, count = compute_logical_maps(laid, N)
    assert int(count.min()) >= 1 and bool((count.sum(1) == replicas).all())
    chosen = l2p[l2p >= 0]
    assert not bool(((chosen // LOCAL) >= NEW_RANKS).any())  # nothing on the leaving ranks


def test_our_scale_down_keeps_the_survivors_experts_in_place() -> None:
    """Ours aligns to the surviving ranks' part of the old map: fewer weights cross ranks
    than with vLLM's default, at the same balance or better."""
    old = MooncakeEplbPolicy.rebalance_experts(_load(3), OLD_RANKS * LOCAL, GROUPS, 1, OLD_RANKS)
    replicas = NEW_RANKS * LOCAL
    load = _load(3)  # same traffic: only the leaving ranks' experts need a new home
    ours = MooncakeEplbPolicy.rebalance_experts(load, replicas, GROUPS, 1, NEW_RANKS, old)
    theirs = DefaultEplbPolicy.rebalance_experts(load, replicas, GROUPS, 1, NEW_RANKS, old)
    survivors = old[:, :replicas]
    moved_ours = cross_rank_moves(survivors, ours, NEW_RANKS)
    moved_theirs = cross_rank_moves(survivors, theirs, NEW_RANKS)
    assert moved_ours < moved_theirs, (moved_ours, moved_theirs)
