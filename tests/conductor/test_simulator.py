"""Replay of the first 600 requests of the conversation trace: invariants, not tuned numbers."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mooncake_connectors.cli import app
from mooncake_connectors.conductor.estimators import llama2_70b_a800
from mooncake_connectors.conductor.report import goodput, parse_policy, summarize
from mooncake_connectors.conductor.simulator import SimConfig, SimResult, Simulator, _Seq, _tbt
from mooncake_connectors.conductor.trace import TraceRequest, load_trace
from mooncake_connectors.conductor.types import Admission, PlacementPolicy
from mooncake_connectors.errors import ConfigError

from .conftest import TRACE_HEAD

# The head of the trace is busier than its average: on the paper's 16 prefill nodes queues form.
REQS = load_trace(TRACE_HEAD)
MODELS = llama2_70b_a800(prefill_mfu=0.2)


def replay(
    policy: str, reqs: list[TraceRequest] = REQS, seed: int = 0, decode: int = 2, **kw: object
) -> SimResult:
    placement, admission = parse_policy(policy)
    cfg = SimConfig(
        prefill=16, decode=decode, placement=placement, admission=admission, models=MODELS,
        seed=seed, **kw,  # type: ignore[arg-type]
    )  # fmt: skip
    return Simulator(cfg).run(reqs)


ALL = [
    "random",
    "load-balance",
    "local-cache",
    "global-cache",
    "algorithm1",
    "predictive",
    "adaptive",
]


@pytest.mark.parametrize("policy", ALL)
def test_every_request_placed_or_rejected_once_and_capacity_held(policy: str) -> None:
    res = replay(policy)
    ids = [o.request_id for o in res.outcomes]
    assert sorted(ids) == list(range(len(REQS)))
    for o in res.outcomes:
        if o.rejected is None:
            assert o.prefill is not None and o.decode is not None
            assert o.ttft_s > 0 and o.tbt_s >= 0 and o.finished_s >= o.arrival_s + o.ttft_s
            assert 0 <= o.cached_tokens <= o.prompt_tokens
        else:
            assert o.prefill is None and o.ttft_s != o.ttft_s  # NaN: never ran
    cap = MODELS.decode.capacity_tokens
    assert all(0 < peak <= cap for peak in res.decode_peak_tokens.values() if peak)
    assert max(res.prefill_peak_running.values()) == 1  # one prefill at a time per node
    if parse_policy(policy)[1] is Admission.NONE:
        assert all(o.rejected is None for o in res.outcomes)


def test_same_seed_same_replay_other_seed_differs() -> None:
    a, b = replay("random", seed=3), replay("random", seed=3)
    assert a.outcomes == b.outcomes
    c = replay("random", seed=4)
    assert [o.prefill for o in a.outcomes] != [o.prefill for o in c.outcomes]


def _hit(res: SimResult) -> float:
    placed = [o for o in res.outcomes if o.rejected is None]
    return sum(o.cached_tokens for o in placed) / sum(o.prompt_tokens for o in placed)


def _mean_ttft(res: SimResult) -> float:
    placed = [o.ttft_s for o in res.outcomes if o.rejected is None]
    return sum(placed) / len(placed)


def test_cache_aware_policies_hit_more_and_wait_less() -> None:
    results = {p: replay(p) for p in ("random", "load-balance", "local-cache", "global-cache")}
    hits = {p: _hit(r) for p, r in results.items()}
    assert hits["global-cache"] >= hits["local-cache"] > hits["load-balance"]
    assert _hit(replay("adaptive-placement")) >= hits["global-cache"]
    ttft = {p: _mean_ttft(r) for p, r in results.items()}
    assert ttft["random"] > ttft["load-balance"] > ttft["local-cache"] >= ttft["global-cache"]


def test_admission_keeps_placed_requests_within_the_ttft_slo() -> None:
    # Overload (x3 load) with a 10 s SLO: without admission many exceed it.
    heavy = load_trace(TRACE_HEAD, speedup=3.0)
    free = replay("global-cache", heavy, ttft_slo_s=10.0)
    gated = replay("adaptive", heavy, ttft_slo_s=10.0)
    assert sum(o.ttft_s > 10.0 for o in free.outcomes) > 50
    placed = [o for o in gated.outcomes if o.rejected is None]
    assert sum(o.rejected is not None for o in gated.outcomes) > 0
    assert sum(o.ttft_s > 10.0 for o in placed) <= 0.05 * len(placed)
    assert goodput(gated, 10.0, 0.3) > goodput(free, 10.0, 0.3)


def test_tbt_is_mean_of_slowest_tenth() -> None:
    # 20 gaps: 18 of 20 ms and 2 of 50 ms; the first also waited 1 s for a decode slot.
    seq = _Seq(job=None, remaining=0.0, reserve=0, kv=0.0, first_wait=1.0)  # type: ignore[arg-type]
    seq.gaps = [(0.02, 18.0), (0.05, 2.0)]
    # slowest 10% = 2 gaps: the first (1.02 s) and one 50 ms gap
    assert _tbt(seq, 20) == pytest.approx((1.02 + 0.05) / 2)
    assert _tbt(seq, 0) == 0.0


def test_summary_fields() -> None:
    res = replay("algorithm1")
    s = summarize(res, [0.1, 0.3])
    assert s["requests"] == len(REQS)
    assert s["placed"] + sum(s["rejected"].values()) == len(REQS)
    assert s["goodput"]["100ms"]["requests"] <= s["goodput"]["300ms"]["requests"] <= s["placed"]
    assert 0 <= s["cache_hit_rate"] <= 1
    assert s["decode_peak_kv_fraction"] <= 1


def test_bad_policy_and_config() -> None:
    with pytest.raises(ConfigError):
        parse_policy("nonsense")
    assert parse_policy("local-cache+early") == (PlacementPolicy.LOCAL_CACHE, Admission.EARLY)
    with pytest.raises(ConfigError):
        SimConfig(0, 1, PlacementPolicy.RANDOM, Admission.NONE, MODELS)
    with pytest.raises(ConfigError):
        Simulator(SimConfig(1, 1, PlacementPolicy.RANDOM, Admission.NONE, MODELS)).run([])


def test_cli_simulate_writes_json_and_png(tmp_path: Path) -> None:
    out, png = tmp_path / "r.json", tmp_path / "cdf.png"
    result = CliRunner().invoke(
        app,
        [
            "simulate", "--trace", str(TRACE_HEAD), "--limit", "120", "--prefill", "8",
            "--decode", "2", "--policy", "random", "--policy", "global-cache", "--policy",
            "adaptive", "--tbt-slo", "0.2", "--seed", "1", "--plot", str(png), "--output",
            str(out), "--no-progress",
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["requests"] == 120
    assert set(data["policies"]) == {"random", "global-cache", "adaptive"}
    assert data["paper_comparison"]["random"]["ratio_to_random"] == pytest.approx(1.0)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(result.stdout)["requests"] == 120


def test_cli_bad_policy_exits_2() -> None:
    result = CliRunner().invoke(
        app, ["simulate", "--trace", str(TRACE_HEAD), "--policy", "bogus", "--no-progress"]
    )
    assert result.exit_code == 2


def test_decode_memory_is_never_overcommitted_even_when_it_binds() -> None:
    small = dataclasses.replace(
        MODELS, decode=dataclasses.replace(MODELS.decode, capacity_tokens=200_000)
    )
    placement, admission = parse_policy("global-cache")
    res = Simulator(SimConfig(16, 1, placement, admission, small)).run(REQS)
    peak = res.decode_peak_tokens["decode-0"]
    assert 0.8 * 200_000 < peak <= 200_000  # it filled up, and never past capacity
    # Requests that waited for room show it in their TBT (the first gap carries the wait).
    assert max(o.tbt_s for o in res.outcomes) > 1.0
