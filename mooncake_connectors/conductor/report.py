"""Replay results: policy presets, runs over SLO sets, summaries and the TTFT CDF plot."""

from __future__ import annotations

import functools
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError
from .estimators import InstanceModels
from .simulator import SimConfig, SimResult, Simulator
from .trace import TraceRequest
from .types import Admission, PlacementPolicy

# Named policies of the replay. Any other "PLACEMENT+ADMISSION" pair is accepted too.
PRESETS: Mapping[str, tuple[PlacementPolicy, Admission]] = {
    "random": (PlacementPolicy.RANDOM, Admission.NONE),
    "load-balance": (PlacementPolicy.LOAD_BALANCE, Admission.NONE),
    "local-cache": (PlacementPolicy.LOCAL_CACHE, Admission.NONE),
    "global-cache": (PlacementPolicy.GLOBAL_CACHE, Admission.NONE),
    "adaptive-placement": (PlacementPolicy.ADAPTIVE, Admission.NONE),
    "algorithm1": (PlacementPolicy.GLOBAL_CACHE, Admission.EARLY),
    "predictive": (PlacementPolicy.GLOBAL_CACHE, Admission.PREDICTIVE),
    "adaptive": (PlacementPolicy.ADAPTIVE, Admission.ADAPTIVE),
}
DEFAULT_POLICIES = tuple(PRESETS)

# Mooncake FAST'25 §4.1 (Figure 5): average TTFT on the conversation trace, 16 prefill nodes.
PAPER_AVG_TTFT_S: Mapping[str, float] = {
    "random": 19.65,
    "load-balance": 5.27,
    "local-cache": 3.58,
    "global-cache": 3.07,
}


def parse_policy(name: str) -> tuple[PlacementPolicy, Admission]:
    """A preset name or ``PLACEMENT+ADMISSION`` (e.g. ``local-cache+early``)."""
    if name in PRESETS:
        return PRESETS[name]
    placement, _, admission = name.partition("+")
    try:
        return PlacementPolicy(placement), Admission(admission or "none")
    except ValueError:
        raise ConfigError(
            f"unknown policy {name!r}: use one of {', '.join(PRESETS)} or PLACEMENT+ADMISSION "
            f"with placement in {[p.value for p in PlacementPolicy]} and admission in "
            f"{[a.value for a in Admission]}"
        ) from None


def _pct(values: np.ndarray[Any, np.dtype[np.float64]], q: float) -> float | None:
    return float(np.percentile(values, q)) if values.size else None


def _dist(values: Sequence[float]) -> dict[str, float | None]:
    arr = np.asarray(values, dtype=np.float64)
    return {
        "mean": float(arr.mean()) if arr.size else None,
        "p50": _pct(arr, 50),
        "p90": _pct(arr, 90),
        "p99": _pct(arr, 99),
    }


def goodput(result: SimResult, ttft_slo_s: float, tbt_slo_s: float) -> int:
    """Requests that finished within both SLOs (rejected and late ones count for nothing)."""
    return sum(
        1
        for o in result.outcomes
        if o.rejected is None and o.ttft_s <= ttft_slo_s and o.tbt_s <= tbt_slo_s
    )


def summarize(result: SimResult, tbt_slos: Sequence[float]) -> dict[str, Any]:
    """JSON-ready summary of one run."""
    outs = result.outcomes
    placed = [o for o in outs if o.rejected is None]
    span = max(o.arrival_s for o in outs) - min(o.arrival_s for o in outs)
    prompt = sum(o.prompt_tokens for o in placed)
    cfg = result.config
    return {
        "requests": len(outs),
        "placed": len(placed),
        "rejected": dict(Counter(o.rejected.value for o in outs if o.rejected is not None)),
        "ttft_s": _dist([o.ttft_s for o in placed]),
        "tbt_s": _dist([o.tbt_s for o in placed]),
        "ttft_over_slo": sum(1 for o in placed if o.ttft_s > cfg.ttft_slo_s),
        "goodput": {
            f"{t * 1e3:g}ms": {
                "requests": (g := goodput(result, cfg.ttft_slo_s, t)),
                "fraction": g / len(outs),
                "per_s": g / span if span > 0 else None,
            }
            for t in tbt_slos
        },
        "cache_hit_rate": sum(o.cached_tokens for o in placed) / prompt if prompt else 0.0,
        "fetched_blocks": sum(o.fetched_blocks for o in placed),
        "decode_peak_kv_fraction": max(result.decode_peak_tokens.values())
        / cfg.models.decode.capacity_tokens,
        "prefill_peak_running": max(result.prefill_peak_running.values()),
    }


def _offset_progress(progress: Callable[[str, int], None], name: str, base: int, n: int) -> None:
    progress(name, base + n)


def run_policies(
    requests: Sequence[TraceRequest],
    policies: Sequence[str],
    *,
    prefill: int,
    decode: int,
    models: InstanceModels,
    ttft_slo_s: float,
    tbt_slos: Sequence[float],
    seed: int,
    balancing_threshold: float = 1.5,
    noise: float = 0.1,
    progress: Callable[[str, int], None] | None = None,
) -> tuple[dict[str, Any], dict[str, SimResult]]:
    """Replay every policy; returns (summary per policy, the result kept for plotting).

    ``progress(policy, n)`` gets the number of requests replayed so far over all replays.

    A policy that rejects depends on the TBT SLO it admits against, so it is replayed once per
    TBT SLO and each goodput comes from the run admitted against that SLO; its distributions
    are those of the strictest SLO's run. Policies that never reject are replayed once.
    """
    if not tbt_slos:
        raise ConfigError("at least one TBT SLO is needed")
    if not policies:
        raise ConfigError("at least one policy is needed")
    slos = sorted(tbt_slos)
    summaries: dict[str, Any] = {}
    kept: dict[str, SimResult] = {}
    done = 0  # requests replayed by finished replays, for a progress count over all of them
    for name in policies:
        placement, admission = parse_policy(name)
        runs = slos if admission is not Admission.NONE else slos[:1]
        summary: dict[str, Any] | None = None
        started = time.perf_counter()
        for tbt in runs:
            cfg = SimConfig(
                prefill=prefill, decode=decode, placement=placement, admission=admission,
                models=models, ttft_slo_s=ttft_slo_s, tbt_slo_s=tbt,
                balancing_threshold=balancing_threshold, noise=noise, seed=seed,
            )  # fmt: skip
            cb = None
            if progress is not None:
                cb = functools.partial(_offset_progress, progress, name, done)
            result = Simulator(cfg).run(requests, cb)
            done += len(requests)
            s = summarize(result, slos)
            if summary is None:
                summary, kept[name] = s, result
                summary["placement"] = placement.value
                summary["admission"] = admission.value
            else:
                key = f"{tbt * 1e3:g}ms"
                summary["goodput"][key] = s["goodput"][key]
        assert summary is not None  # runs is never empty
        summary["replays"] = len(runs)
        summary["wall_s"] = round(time.perf_counter() - started, 2)
        summaries[name] = summary
    return summaries, kept


def paper_comparison(summaries: Mapping[str, Any]) -> dict[str, Any]:
    """Average TTFT and ratio to random, ours next to the paper's Figure 5."""
    rows: dict[str, Any] = {}
    ours_random = summaries.get("random", {}).get("ttft_s", {}).get("mean")
    for name, paper in PAPER_AVG_TTFT_S.items():
        mean = summaries.get(name, {}).get("ttft_s", {}).get("mean")
        rows[name] = {
            "paper_avg_ttft_s": paper,
            "paper_ratio_to_random": paper / PAPER_AVG_TTFT_S["random"],
            "avg_ttft_s": mean,
            "ratio_to_random": mean / ours_random if mean is not None and ours_random else None,
        }
    return rows


def plot_ttft_cdf(
    results: Mapping[str, SimResult], path: str | Path, title: str = "", slo_s: float = 30.0
) -> None:
    """Write a PNG of the TTFT CDF of each policy (log time axis)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ConfigError(
            "plotting needs matplotlib: pip install 'mooncake-connectors[sim]'"
        ) from exc
    fig, ax = plt.subplots(figsize=(8.0, 4.2), dpi=100)
    for name, result in results.items():
        ttft = np.sort([o.ttft_s for o in result.outcomes if o.rejected is None])
        if ttft.size == 0:
            continue
        y = np.arange(1, ttft.size + 1) / ttft.size
        mean = float(ttft.mean())
        ax.plot(ttft, y, label=f"{name} (mean {mean:.2f}s)", linewidth=1.4)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("fraction of placed requests")
    ax.axvline(slo_s, color="grey", linestyle=":", linewidth=1, label=f"TTFT SLO {slo_s:g}s")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
