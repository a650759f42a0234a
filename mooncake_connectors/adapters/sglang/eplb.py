"""Our expert placement as SGLang's EPLB algorithm, through SGLang's own plugin mechanism.

SGLang 0.5.23 plans expert locations in ``sglang.srt.eplb.eplb_algorithms.rebalance_experts``
(called by ``ExpertLocationMetadata.init_by_eplb`` for the initial layout and for every EPLB
rebalance) and selects among its built-in algorithms by ``--eplb-algorithm`` (an enum with no
registry). Its general plugin framework, though, loads every ``sglang.srt.plugins`` entry point
in each process and applies the hooks the plugins register on any dotted target. Our entry point
(:func:`register`) puts an AROUND hook on ``rebalance_experts`` when
``MOONCAKE_CONNECTORS_EPLB_POLICY=mooncake`` is set (the same switch as for vLLM): the DeepSeek
algorithms (``deepseek``, ``deepseek_vec``, hierarchical or not, or ``auto``) are answered by
:func:`plan_placement`.

The elasticity-aware ones plan around SGLang's live-rank mask (``ElasticEPStateManager``'s
``active_ranks``, which Mooncake EP clears for a failed rank; ``maybe_rebalance_after_rank_fault``
then runs an EPLB rebalance). Ours reads the same mask and, when a rank is dead and SGLang's
current expert locations are known, re-plans with :func:`plan_elastic`: only the experts that
lost every replica move (onto live ranks), every other slot of a live rank keeps its expert,
and the dead rank's slots leave the logical-to-physical table (written as logical 0 in
``physical_to_logical_map``, as SGLang's own elasticity-aware algorithm does).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from sglang.srt.eplb import eplb_algorithms
from sglang.srt.eplb.expert_location import get_global_expert_location_metadata
from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from ...moe.align import align_to_previous
from ...moe.elastic import plan_elastic
from ...moe.placement import Placement
from ...moe.planner import plan_placement
from ..eplb_switch import EPLB_POLICY_ENV, wants_ours
from ..moe.engine_maps import from_sglang, to_sglang

TARGET = "sglang.srt.eplb.eplb_algorithms.rebalance_experts"

_OURS = {
    eplb_algorithms.EplbAlgorithm.deepseek,
    eplb_algorithms.EplbAlgorithm.deepseek_hierarchical,
    eplb_algorithms.EplbAlgorithm.deepseek_vec,
    eplb_algorithms.EplbAlgorithm.deepseek_vec_hierarchical,
}
_ELASTIC = {
    eplb_algorithms.EplbAlgorithm.elasticity_aware,
    eplb_algorithms.EplbAlgorithm.elasticity_aware_hierarchical,
}
_HIERARCHICAL = {
    eplb_algorithms.EplbAlgorithm.deepseek_hierarchical,
    eplb_algorithms.EplbAlgorithm.deepseek_vec_hierarchical,
    eplb_algorithms.EplbAlgorithm.elasticity_aware_hierarchical,
}


def rebalance(
    tokens_per_expert: torch.Tensor,
    num_physical_experts: int,
    num_local_physical_experts: int,
    num_groups: int | None,
    num_nodes: int,
    hierarchical: bool,
    previous: Placement | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SGLang's return triple from our plan: ``physical_to_logical_map [L, P]``,
    ``logical_to_all_physical_map [L, N, X]`` (``-1`` padded; SGLang pads it to ``P``) and the
    replica counts ``[L, N]``, all int64 on the CPU.

    tokens_per_expert: ``[W, L, N]`` recorded windows (summed, as SGLang's DeepSeek does) or
        ``[L, N]``.
    previous: the placement SGLang serves now; when of the same shape, the plan's ranks are
        renamed and its slots kept to match it (:func:`align_to_previous`), so fewer expert
        weights cross ranks in SGLang's ``ExpertLocationUpdater``.
    """
    load = tokens_per_expert.sum(dim=0) if tokens_per_expert.dim() == 3 else tokens_per_expert
    groups = num_groups or 1
    use_nodes = hierarchical and num_nodes > 1 and groups % num_nodes == 0
    placement = plan_placement(
        load.float(),
        num_physical_experts,
        num_physical_experts // num_local_physical_experts,
        num_nodes=num_nodes if use_nodes else 1,
        num_groups=groups if use_nodes else 1,
    )
    if previous is not None:
        placement = align_to_previous(
            placement, previous.physical_to_logical, num_nodes=num_nodes if use_nodes else 1
        )
    return _triple(placement)


def _triple(placement: Placement) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    maps = to_sglang(placement, empty_fill=0)
    return (
        maps.physical_to_logical_map.clone(),
        maps.logical_to_all_physical_map,
        maps.logical_to_all_physical_map_num_valid,
    )


def sglang_active_ranks() -> torch.Tensor:
    """SGLang's live-rank mask, read as its elasticity-aware dispatch reads it."""
    from sglang.srt.elastic_ep.elastic_ep import ElasticEPStateManager

    state = ElasticEPStateManager.instance()
    mask = state.active_ranks if state is not None else ElasticEPStateManager.healthy_rank_state()
    out: torch.Tensor = mask.detach().cpu()
    return out


def running_placement(num_ranks: int, num_physical: int) -> Placement | None:
    """The expert locations SGLang serves now (its global ``ExpertLocationMetadata``), or None
    before SGLang has set them or when they have another slot count (an elastic scale)."""
    meta = get_global_expert_location_metadata()
    if meta is None or int(meta.physical_to_logical_map.shape[-1]) != num_physical:
        return None
    return from_sglang(
        meta.physical_to_logical_map.cpu(),
        meta.logical_to_all_physical_map.cpu(),
        meta.logical_to_all_physical_map_num_valid.cpu(),
        num_ranks=num_ranks,
    )


def rebalance_elastic(
    tokens_per_expert: torch.Tensor,
    num_physical_experts: int,
    num_local_physical_experts: int,
    num_groups: int | None,
    num_nodes: int,
    hierarchical: bool,
    active_ranks: torch.Tensor,
    previous: Placement | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SGLang's triple for its elasticity-aware call: ``active_ranks`` ``[R]`` (1 = live).

    All ranks live: as :func:`rebalance`. A rank dead and ``previous`` (the map SGLang serves)
    of the same size: :func:`plan_elastic` from it (the fewest moves; the dead ranks' slots
    empty). A rank dead and no usable previous map: a fresh plan over the live ranks, laid into
    their slots. Raises ConfigError when the live slots cannot hold every expert once.
    """
    num_ranks = num_physical_experts // num_local_physical_experts
    alive = active_ranks.detach().cpu().to(torch.bool)
    if bool(alive.all()):
        return rebalance(
            tokens_per_expert,
            num_physical_experts,
            num_local_physical_experts,
            num_groups,
            num_nodes,
            hierarchical,
            previous,
        )
    load = tokens_per_expert.sum(dim=0) if tokens_per_expert.dim() == 3 else tokens_per_expert
    load = load.detach().cpu().double()
    if previous is not None and previous.num_physical == num_physical_experts:
        return _triple(plan_elastic(previous, load, alive).placement)
    live = int(alive.sum())
    fresh = plan_placement(load, num_local_physical_experts * live, live)
    p2l = torch.full((load.shape[0], num_physical_experts), -1, dtype=torch.int64)
    slots = p2l.view(load.shape[0], num_ranks, num_local_physical_experts)
    slots[:, alive] = fresh.physical_to_logical.view(load.shape[0], live, -1)
    return _triple(Placement(p2l, int(load.shape[1]), num_ranks))


def _around(original: Any, *args: Any, **kwargs: Any) -> Any:
    names = (
        "tokens_per_expert",
        "num_physical_experts",
        "num_local_physical_experts",
        "num_groups",
        "num_nodes",
        "algorithm",
    )
    call = dict(zip(names, args, strict=False)) | kwargs
    algorithm = call.get("algorithm")
    if algorithm not in _ELASTIC and algorithm not in _OURS:
        return original(*args, **kwargs)
    physical, local = call["num_physical_experts"], call["num_local_physical_experts"]
    common = (
        call["tokens_per_expert"],
        physical,
        local,
        call["num_groups"],
        call["num_nodes"],
        algorithm in _HIERARCHICAL,
    )
    served = running_placement(physical // local, physical)
    if algorithm in _ELASTIC:
        return rebalance_elastic(*common, sglang_active_ranks(), served)
    return rebalance(*common, served)


def register(environ: Mapping[str, str] | None = None) -> bool:
    """Register the hook when the environment asks for our policy; True if registered.

    SGLang applies registered hooks once, after all plugins ran (``load_plugins``).
    """
    if not wants_ours(EPLB_POLICY_ENV, environ):
        return False
    held = [hook for _kind, hook, _src in HookRegistry._hooks.get(TARGET, [])]
    if _around not in held:
        HookRegistry.register(TARGET, _around, HookType.AROUND)
    return True
