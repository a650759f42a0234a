"""The ``simulate`` command's work: load a trace, replay policies, summarise, plot."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

from ..errors import ConfigError
from .estimators import llama2_70b_a800
from .report import DEFAULT_POLICIES, paper_comparison, parse_policy, plot_ttft_cdf, run_policies
from .trace import load_trace
from .types import Admission


@dataclasses.dataclass(frozen=True)
class ReplayOptions:
    """Options of one replay; empty ``policies`` / ``tbt_slos_s`` mean the defaults."""

    trace: str
    prefill: int = 16
    decode: int = 8
    policies: tuple[str, ...] = ()
    seed: int = 0
    limit: int | None = None
    speedup: float = 1.0
    ttft_slo_s: float = 30.0
    tbt_slos_s: tuple[float, ...] = ()
    threshold: float = 1.5
    prefill_mfu: float = 0.2
    nic_gbps: float = 400.0
    cache_blocks: int = 8000
    noise: float = 0.1
    plot: str | None = None

    def __post_init__(self) -> None:
        if self.prefill <= 0 or self.decode <= 0:
            raise ConfigError("prefill and decode must be > 0")
        for name in ("speedup", "ttft_slo_s", "nic_gbps", "prefill_mfu"):
            v = getattr(self, name)
            if not math.isfinite(v) or v <= 0:
                raise ConfigError(f"{name} must be a finite number > 0", **{name: v})
        if any(not math.isfinite(t) or t <= 0 for t in self.tbt_slos_s):
            raise ConfigError("TBT SLOs must be finite numbers > 0", tbt_slos=self.tbt_slos_s)
        for p in self.policies:
            parse_policy(p)  # raises ConfigError naming the valid choices


def replay(
    opts: ReplayOptions, progress: Callable[[str, int, int], None] | None = None
) -> dict[str, Any]:
    """Run the replay; ``progress(policy, done, total)`` counts requests over all replays."""
    started = time.perf_counter()
    policies = list(opts.policies or DEFAULT_POLICIES)
    slos = sorted(opts.tbt_slos_s or (0.1, 0.2, 0.3))
    requests = load_trace(opts.trace, limit=opts.limit, speedup=opts.speedup)
    models = llama2_70b_a800(
        prefill_mfu=opts.prefill_mfu,
        nic_bytes_per_s=opts.nic_gbps * 1e9 / 8,
        cache_capacity_blocks=opts.cache_blocks,
    )
    replays = sum(len(slos) if parse_policy(p)[1] is not Admission.NONE else 1 for p in policies)
    total = replays * len(requests)

    def tick(name: str, n: int) -> None:
        if progress is not None:
            progress(name, n, total)

    summaries, kept = run_policies(
        requests,
        policies,
        prefill=opts.prefill,
        decode=opts.decode,
        models=models,
        ttft_slo_s=opts.ttft_slo_s,
        tbt_slos=slos,
        seed=opts.seed,
        balancing_threshold=opts.threshold,
        noise=opts.noise,
        progress=tick,
    )
    if opts.plot:
        plot_ttft_cdf(
            kept,
            opts.plot,
            title=f"{len(requests)} requests, {opts.prefill}P+{opts.decode}D, "
            f"load x{opts.speedup:g}, seed {opts.seed}",
            slo_s=opts.ttft_slo_s,
        )
    return {
        "trace": opts.trace,
        "requests": len(requests),
        "prefill": opts.prefill,
        "decode": opts.decode,
        "speedup": opts.speedup,
        "seed": opts.seed,
        "ttft_slo_s": opts.ttft_slo_s,
        "tbt_slos_s": slos,
        "balancing_threshold": opts.threshold,
        "models": {
            "prefill": dataclasses.asdict(models.prefill) | {"mfu": opts.prefill_mfu},
            "decode": dataclasses.asdict(models.decode),
            "transfer": dataclasses.asdict(models.transfer),
            "cache_capacity_blocks": models.cache_capacity_blocks,
            "noise_sigma": opts.noise,
        },
        "policies": summaries,
        "paper_comparison": paper_comparison(summaries),
        "wall_s": round(time.perf_counter() - started, 2),
    }
