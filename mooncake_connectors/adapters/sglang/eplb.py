"""Our expert placement as SGLang's EPLB algorithm, through SGLang's own plugin mechanism.

SGLang 0.5.23 plans expert locations in ``sglang.srt.eplb.eplb_algorithms.rebalance_experts``
(called by ``ExpertLocationMetadata.init_by_eplb`` for the initial layout and for every EPLB
rebalance) and selects among its built-in algorithms by ``--eplb-algorithm`` (an enum with no
registry). Its general plugin framework, though, loads every ``sglang.srt.plugins`` entry point
in each process and applies the hooks the plugins register on any dotted target. Our entry point
(:func:`register`) puts an AROUND hook on ``rebalance_experts`` when
``MOONCAKE_CONNECTORS_EPLB_POLICY=mooncake`` is set (the same switch as for vLLM): the DeepSeek
algorithms (``deepseek``, ``deepseek_vec``, hierarchical or not, or ``auto``) are answered by
:func:`plan_placement`; the elasticity-aware ones, which plan around SGLang's
``ElasticEPStateManager.active_ranks``, are left to SGLang.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from sglang.srt.eplb import eplb_algorithms
from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from ...moe.planner import plan_placement
from ..eplb_switch import EPLB_POLICY_ENV, wants_ours

TARGET = "sglang.srt.eplb.eplb_algorithms.rebalance_experts"

_OURS = {
    eplb_algorithms.EplbAlgorithm.deepseek,
    eplb_algorithms.EplbAlgorithm.deepseek_hierarchical,
    eplb_algorithms.EplbAlgorithm.deepseek_vec,
    eplb_algorithms.EplbAlgorithm.deepseek_vec_hierarchical,
}
_HIERARCHICAL = {
    eplb_algorithms.EplbAlgorithm.deepseek_hierarchical,
    eplb_algorithms.EplbAlgorithm.deepseek_vec_hierarchical,
}


def rebalance(
    tokens_per_expert: torch.Tensor,
    num_physical_experts: int,
    num_local_physical_experts: int,
    num_groups: int | None,
    num_nodes: int,
    hierarchical: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SGLang's return triple from our plan: ``physical_to_logical_map [L, P]``,
    ``logical_to_all_physical_map [L, N, X]`` (``-1`` padded; SGLang pads it to ``P``) and the
    replica counts ``[L, N]``, all int64 on the CPU.

    tokens_per_expert: ``[W, L, N]`` recorded windows (summed, as SGLang's DeepSeek does) or
        ``[L, N]``.
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
    return (
        placement.physical_to_logical.clone(),
        placement.logical_to_physical(),
        placement.replica_count(),
    )


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
    if algorithm not in _OURS:
        return original(*args, **kwargs)
    return rebalance(
        call["tokens_per_expert"],
        call["num_physical_experts"],
        call["num_local_physical_experts"],
        call["num_groups"],
        call["num_nodes"],
        algorithm in _HIERARCHICAL,
    )


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
