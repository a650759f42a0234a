"""``bench moe``'s vLLM row: our EPLB policy against vLLM's default policy, both run as vLLM runs
them (``rebalance_experts`` with the map in force), over a sequence of drifting skewed loads.

Each policy starts from vLLM's initial map (``build_initial_global_physical_to_logical_map``:
experts in order, redundant slots round-robin) and keeps its own chain of maps. Moves count the
slots whose new expert was on no slot of that rank before (the weights that cross the wire).
vLLM is imported lazily; without it the row says so.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import torch

from ..moe.align import cross_rank_moves
from ..moe.placement import Placement
from .moe_workload import expert_load, zipf_gate_scores

_ADAPTER = "mooncake_connectors.adapters.vllm.eplb"


def _adapter() -> ModuleType | str:
    try:
        return importlib.import_module(_ADAPTER)
    except ImportError as exc:  # vLLM absent: the row reports why
        return f"vLLM not importable: {exc}"


def _loads(seed: int, windows: int, layers: int, n: int) -> list[torch.Tensor]:
    """``windows`` ``[layers, n]`` loads: Zipf(1.0) traffic where each window keeps 3/4 of the
    previous window's load and adds 1/4 of a fresh draw (hot experts drift, they do not jump)."""
    gen = torch.Generator().manual_seed(seed + 7)

    def draw() -> torch.Tensor:
        return torch.stack(
            [expert_load(zipf_gate_scores(4096, n, 1.0, gen), 8) for _ in range(layers)]
        )

    out = [draw()]
    for _ in range(windows - 1):
        out.append(0.75 * out[-1] + 0.25 * draw())
    return out


def vllm_policy_rows(seed: int) -> dict[str, Any]:
    adapter = _adapter()
    if isinstance(adapter, str):
        return {"available": False, "reason": adapter}
    from_vllm = importlib.import_module("vllm.distributed.eplb.eplb_state").EplbState
    n, layers, windows = 256, 4, 4
    cases = [(32, 288, 1, 8), (32, 288, 4, 8), (64, 320, 8, 8)]  # (ranks, physical, nodes, groups)
    loads = _loads(seed, windows, layers, n)
    rows = []
    for num_ranks, num_physical, nodes, groups in cases:
        initial = torch.tensor(
            from_vllm.build_initial_global_physical_to_logical_map(n, num_physical - n),
            dtype=torch.int64,
        ).expand(layers, -1)
        row: dict[str, Any] = {
            "ranks": num_ranks,
            "physical_experts": num_physical,
            "nodes": nodes,
            "groups": groups,
            "layers": layers,
            "windows": windows,
        }
        for name, policy in (
            ("vllm_default", adapter.vllm_default_rebalance),
            ("ours", adapter.rebalance),
        ):
            current = initial.clone()
            ratios, moves, changed = [], 0, 0
            for load in loads:
                new = policy(load, num_physical, groups, nodes, num_ranks, current)
                ratios.append(Placement(new, n, num_ranks).balance(load))
                moves += cross_rank_moves(current, new, num_ranks)
                changed += int((new != current).sum())
                current = new
            ratio = torch.cat(ratios)
            row[name] = {
                "max_over_mean_mean": round(float(ratio.mean()), 4),
                "max_over_mean_worst": round(float(ratio.max()), 4),
                "cross_rank_moves": moves,
                "slots_changed": changed,
            }
        rows.append(row)
    return {"available": True, "zipf_exponent": 1.0, "drift": 0.25, "cases": rows}
