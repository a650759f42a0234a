"""``bench moe``'s SGLang row: our placement against SGLang's default EPLB algorithm, both called
the way SGLang calls them.

SGLang plans in ``sglang.srt.eplb.eplb_algorithms.rebalance_experts(tokens_per_expert,
num_physical_experts, num_local_physical_experts, num_groups, num_nodes, algorithm)``, the
algorithm being ``compute_algorithm("auto", ...)`` by default (``--eplb-algorithm auto``). The
baseline is that function itself; ours is the hook our SGLang plugin registers around it
(``adapters.sglang.eplb._around``), handed SGLang's function as the original. Both start from
SGLang's trivial layout (``init_trivial``: slot ``p`` holds expert ``p % N``) and chain their own
maps over the same drifting Zipf loads as the vLLM row (``moe_vllm._loads``). SGLang's algorithm
takes no previous map (its signature has none) and plans each window afresh; our hook reads the
map being served from SGLang's global ``ExpertLocationMetadata`` (set here before each call, as
SGLang holds it while serving) and keeps the new plan close to it.

Rearranged bytes: slots whose new expert was on no slot of that rank before (the weights
SGLang's ``ExpertLocationUpdater`` sends between ranks; moves within a rank are local copies),
times the bytes of one routed expert. SGLang is imported lazily; without it the row says so.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import torch

from ..moe.align import cross_rank_moves
from ..moe.placement import Placement
from .moe_vllm import _loads

_ADAPTER = "mooncake_connectors.adapters.sglang.eplb"

# One DeepSeek-V3 routed expert: gate, up and down projections, 7168 x 2048 each, FP8 (1 byte),
# block scales left out.
DEEPSEEK_V3_EXPERT_BYTES = 3 * 7168 * 2048

# (ranks, physical slots, nodes, groups): the vLLM row's cases.
DEFAULT_CASES: tuple[tuple[int, int, int, int], ...] = (
    (32, 288, 1, 8),
    (32, 288, 4, 8),
    (64, 320, 8, 8),
)


def _adapter() -> ModuleType | str:
    try:
        return importlib.import_module(_ADAPTER)
    except ImportError as exc:  # SGLang absent: the row reports why
        return f"SGLang not importable: {exc}"


def sglang_policy_rows(
    seed: int,
    *,
    experts: int = 256,
    layers: int = 4,
    windows: int = 4,
    cases: tuple[tuple[int, int, int, int], ...] = DEFAULT_CASES,
    expert_bytes: int = DEEPSEEK_V3_EXPERT_BYTES,
) -> dict[str, Any]:
    """Balance and rearranged bytes of SGLang's default algorithm and ours, per case."""
    adapter = _adapter()
    if isinstance(adapter, str):
        return {"available": False, "reason": adapter}
    algorithms = importlib.import_module("sglang.srt.eplb.eplb_algorithms")
    location = importlib.import_module("sglang.srt.eplb.expert_location")
    to_sglang = importlib.import_module("mooncake_connectors.adapters.moe").to_sglang
    sglang_rebalance = algorithms.rebalance_experts
    loads = _loads(seed, windows, layers, experts)
    rows = []
    for num_ranks, num_physical, nodes, groups in cases:
        algorithm = algorithms.compute_algorithm("auto", groups, nodes)
        initial = (torch.arange(num_physical) % experts).expand(layers, -1)
        row: dict[str, Any] = {
            "ranks": num_ranks,
            "physical_experts": num_physical,
            "nodes": nodes,
            "groups": groups,
            "sglang_algorithm": algorithm.name,
            "layers": layers,
            "windows": windows,
        }

        def theirs(current: torch.Tensor, **kw: Any) -> Any:
            return sglang_rebalance(**kw)

        def ours(current: torch.Tensor, **kw: Any) -> Any:
            ranks = kw["num_physical_experts"] // kw["num_local_physical_experts"]
            served = to_sglang(Placement(current, experts, ranks))
            location.set_global_expert_location_metadata(
                location.ExpertLocationMetadata(**served.metadata_kwargs()), allow_overwrite=True
            )
            try:
                return adapter._around(sglang_rebalance, **kw)
            finally:
                location.set_global_expert_location_metadata(None, allow_overwrite=True)

        for name, policy in (("sglang_default", theirs), ("ours", ours)):
            current = initial.clone()
            ratios, moves = [], 0
            for load in loads:
                new = policy(
                    current,
                    tokens_per_expert=load.unsqueeze(0),  # one recorded window [1, L, N]
                    num_physical_experts=num_physical,
                    num_local_physical_experts=num_physical // num_ranks,
                    num_groups=groups,
                    num_nodes=nodes,
                    algorithm=algorithm,
                )[0].to(torch.int64)
                ratios.append(Placement(new, experts, num_ranks).balance(load))
                moves += cross_rank_moves(current, new, num_ranks)
                current = new
            ratio = torch.cat(ratios)
            row[name] = {
                "max_over_mean_mean": round(float(ratio.mean()), 4),
                "max_over_mean_worst": round(float(ratio.max()), 4),
                "cross_rank_moves": moves,
                "rearranged_bytes": moves * expert_bytes,
            }
        base, mine = row["sglang_default"], row["ours"]
        row["ours_over_sglang"] = {
            "max_over_mean_mean": round(mine["max_over_mean_mean"] / base["max_over_mean_mean"], 4),
            "rearranged_bytes": round(
                mine["rearranged_bytes"] / max(base["rearranged_bytes"], 1), 4
            ),
        }
        rows.append(row)
    return {
        "available": True,
        "zipf_exponent": 1.0,
        "drift": 0.25,
        "logical_experts": experts,
        "expert_bytes": expert_bytes,
        "cases": rows,
    }
