"""``mooncake-connectors bench moe``: routing cost, placement time, balance against DeepSeek's EPLB.

Inputs are synthetic Zipf traffic (:mod:`.workload`). The DeepSeek baseline is our own
re-implementation of its published algorithm in ``benchmarks/eplb_reference.py``, loaded from the
source tree (reported as unavailable when the package is installed without it).
"""

from __future__ import annotations

import importlib.util
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from ..errors import ConfigError
from ..moe.elastic import plan_elastic
from ..moe.placement import Placement
from ..moe.planner import plan_placement
from ..moe.router import ExpertRouter, RoutingMode
from .moe_sglang import DEFAULT_CASES, sglang_policy_rows
from .moe_vllm import vllm_policy_rows
from .moe_workload import expert_load, no_replication, zipf_gate_scores

_REFERENCE = Path(__file__).resolve().parents[2] / "benchmarks" / "eplb_reference.py"


def load_reference() -> ModuleType | None:
    """The DeepSeek EPLB reference module from the source tree, or None."""
    if not _REFERENCE.is_file():
        return None
    spec = importlib.util.spec_from_file_location("eplb_reference", _REFERENCE)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _median_us(fn: Callable[[], object], rounds: int) -> float:
    for _ in range(min(5, rounds)):
        fn()
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return round(statistics.median(samples) * 1e6, 1)


def _routing(rounds: int, seed: int) -> dict[str, Any]:
    tokens, top_k, n, num_physical, num_ranks = 4096, 8, 256, 288, 32
    gen = torch.Generator().manual_seed(seed)
    scores = zipf_gate_scores(tokens, n, 1.0, gen)
    topk_ids = scores.topk(top_k, dim=1).indices
    placement = plan_placement(expert_load(scores, top_k), num_physical, num_ranks)
    # Plain indexing: a fixed logical -> physical table (first replica), no health, no spread.
    first = placement.logical_to_physical()[0, :, 0].clone()
    det = ExpertRouter(placement, mode=RoutingMode.DETERMINISTIC)
    rnd = ExpertRouter(placement, mode=RoutingMode.RANDOM, seed=seed)
    alive = torch.ones(num_ranks, dtype=torch.bool)
    alive[0] = False
    degraded = ExpertRouter(placement, alive=alive)
    slots = num_physical // num_ranks
    realized = {}
    for name, router in (("deterministic", det), ("random", rnd)):
        per_rank = torch.bincount(
            router.route(topk_ids).physical_ids.reshape(-1) // slots, minlength=num_ranks
        ).double()
        realized[name] = round(float(per_rank.max() / per_rank.mean()), 4)
    result = degraded.route(topk_ids, gate_scores=scores)
    return {
        "tokens": tokens,
        "top_k": top_k,
        "logical_experts": n,
        "physical_experts": num_physical,
        "ranks": num_ranks,
        "rounds": rounds,
        "plain_indexing_us": _median_us(lambda: first[topk_ids], rounds),
        "deterministic_us": _median_us(lambda: det.route(topk_ids), rounds),
        "random_us": _median_us(lambda: rnd.route(topk_ids), rounds),
        "deterministic_rank0_dead_with_fallback_us": _median_us(
            lambda: degraded.route(topk_ids, gate_scores=scores), rounds
        ),
        "rank0_dead_lost_experts": int(degraded.lost_experts().numel()),
        "rank0_dead_fallback_entries": result.num_fallback,
        "planned_max_over_mean": round(float(placement.balance(expert_load(scores, top_k))[0]), 4),
        "realized_max_over_mean": realized,
    }


def _placement(seed: int, reference: ModuleType | None) -> dict[str, Any]:
    n, num_ranks, num_physical, nodes, groups, rounds = 256, 64, 320, 8, 8, 5
    gen = torch.Generator().manual_seed(seed + 1)
    load = expert_load(zipf_gate_scores(8192, n, 1.0, gen), 8)
    flat = plan_placement(load, num_physical, num_ranks)
    alive = torch.ones(num_ranks, dtype=torch.bool)
    alive[num_ranks // 2] = False
    minimal = plan_elastic(flat, load, alive)
    budget = plan_elastic(flat, load, alive, max_extra_moves=16)
    full = plan_placement(load, num_physical - num_physical // num_ranks, num_ranks - 1)

    def ratio(placement: Placement, mask: torch.Tensor | None = None) -> float:
        return round(float(placement.balance(load, mask)[0]), 4)

    out: dict[str, Any] = {
        "logical_experts": n,
        "ranks": num_ranks,
        "physical_experts": num_physical,
        "nodes": nodes,
        "groups": groups,
        "rounds": rounds,
        "flat_ms": _median_us(lambda: plan_placement(load, num_physical, num_ranks), rounds) / 1e3,
        "hierarchical_ms": _median_us(
            lambda: plan_placement(
                load, num_physical, num_ranks, num_nodes=nodes, num_groups=groups
            ),
            rounds,
        )
        / 1e3,
        "elastic_one_rank_loss_ms": _median_us(lambda: plan_elastic(flat, load, alive), rounds)
        / 1e3,
        "elastic_one_rank_loss_moves": minimal.num_moves,
        "elastic_lost_experts": int(minimal.lost.sum()),
        "max_over_mean_before_loss": ratio(flat),
        "max_over_mean_after_minimal_replan": ratio(minimal.placement, alive),
        "elastic_budget16_moves": budget.num_moves,
        "max_over_mean_after_budget16_replan": ratio(budget.placement, alive),
        "max_over_mean_full_replan_on_survivors": ratio(full),
    }
    if reference is not None:
        ref = reference.reference_rebalance
        out["deepseek_reference_flat_ms"] = (
            _median_us(lambda: ref(load.unsqueeze(0), num_physical, 1, 1, num_ranks), rounds) / 1e3
        )
        out["deepseek_reference_hierarchical_ms"] = (
            _median_us(
                lambda: ref(load.unsqueeze(0), num_physical, groups, nodes, num_ranks), rounds
            )
            / 1e3
        )
    return out


def _balance(seed: int, reference: ModuleType | None) -> list[dict[str, Any]]:
    n = 256
    cases = [  # (ranks, physical, nodes, groups)
        (32, 288, 1, 1),
        (64, 320, 1, 1),
        (32, 288, 4, 8),
        (64, 320, 8, 8),
    ]
    rows = []
    for exponent in (0.8, 1.0, 1.2):
        gen = torch.Generator().manual_seed(seed + int(exponent * 100))
        load = expert_load(zipf_gate_scores(16384, n, exponent, gen), 8)
        for num_ranks, num_physical, nodes, groups in cases:
            ours = plan_placement(load, num_physical, num_ranks, num_nodes=nodes, num_groups=groups)
            row: dict[str, Any] = {
                "zipf_exponent": exponent,
                "ranks": num_ranks,
                "physical_experts": num_physical,
                "nodes": nodes,
                "groups": groups,
                "mode": "hierarchical" if nodes > 1 and groups % nodes == 0 else "global",
                "ours": round(float(ours.balance(load)[0]), 4),
                "no_replication": round(float(no_replication(n, num_ranks).balance(load)[0]), 4),
            }
            if reference is not None:
                p2l = reference.reference_rebalance(
                    load.unsqueeze(0), num_physical, groups, nodes, num_ranks
                )
                row["deepseek_reference"] = round(
                    float(Placement(p2l, n, num_ranks).balance(load)[0]), 4
                )
            rows.append(row)
    return rows


def parse_cases(text: str) -> tuple[tuple[int, int, int, int], ...]:
    """``"32x288x1x8,..."`` -> ``((32, 288, 1, 8), ...)`` (ranks, slots, nodes, groups)."""
    cases = []
    for item in (x.strip() for x in text.split(",")):
        parts = item.split("x")
        if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ConfigError(f"case {item!r} is not RANKSxSLOTSxNODESxGROUPS (positive integers)")
        ranks, slots, nodes, groups = (int(p) for p in parts)
        if slots % ranks or ranks % nodes:
            raise ConfigError(f"case {item!r}: slots must divide over ranks, ranks over nodes")
        cases.append((ranks, slots, nodes, groups))
    return tuple(cases)


SECTIONS = ("routing", "placement", "balance", "vllm", "sglang")


def run_moe_benchmark(
    *,
    rounds: int = 100,
    seed: int = 0,
    threads: int = 0,
    only: tuple[str, ...] = SECTIONS,
    engine_experts: int = 256,
    engine_cases: tuple[tuple[int, int, int, int], ...] = DEFAULT_CASES,
) -> dict[str, Any]:
    """All MoE measurements as one JSON-able dict (times are medians).

    threads: torch intra-op threads for the run (0 keeps torch's default). On a small shared
    machine one thread gives steadier numbers: a parallel op waits for its slowest thread.
    only: the sections to run (of ``SECTIONS``).
    engine_experts, engine_cases: logical experts and (ranks, slots, nodes, groups) of the SGLang
    row (smaller ones for a quick check).
    """
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"unknown bench moe sections {unknown}; choose from {list(SECTIONS)}")
    if threads:
        torch.set_num_threads(threads)
    reference = load_reference()
    out: dict[str, Any] = {
        "machine": {
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "load_average_1min_at_start": round(os.getloadavg()[0], 2),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "deepseek_reference": "benchmarks/eplb_reference.py" if reference is not None else None,
    }
    if "routing" in only:
        out["routing"] = _routing(rounds, seed)
    if "placement" in only:
        out["placement"] = _placement(seed, reference)
    if "balance" in only:
        out["balance_max_over_mean"] = _balance(seed, reference)
    if "vllm" in only:
        out["vllm_eplb_policy"] = vllm_policy_rows(seed)
    if "sglang" in only:
        out["sglang_eplb_policy"] = sglang_policy_rows(
            seed, experts=engine_experts, cases=engine_cases
        )
    return out
