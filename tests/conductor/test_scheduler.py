"""Conductor: the per-request API, admission (HTTP 429) and the report protocol."""

from __future__ import annotations

import dataclasses

import pytest

from mooncake_connectors.conductor import (
    Admission,
    BlockStored,
    Conductor,
    DecodeModel,
    Placement,
    PlacementPolicy,
    Rejection,
    RejectReason,
    ScheduleRequest,
)
from mooncake_connectors.errors import ConfigError

from .conftest import make_config


def req(rid: int, tokens: int, blocks: tuple[int, ...] = ()) -> ScheduleRequest:
    return ScheduleRequest(rid, tokens, blocks)


def test_placement_lands_where_the_prefix_is() -> None:
    c = Conductor(make_config(PlacementPolicy.GLOBAL_CACHE))
    c.apply_cache_event(BlockStored("p2", tuple(range(1, 9))))
    d = c.schedule(req(1, 1000, tuple(range(1, 11))), now=0.0)
    assert isinstance(d, Placement)
    assert (d.prefill, d.local_blocks, d.fetch_from) == ("p2", 8, None)
    assert d.est_ttft_s == pytest.approx(0.2)
    assert d.decode in ("d0", "d1")


def test_queue_time_follows_placements_and_reports() -> None:
    c = Conductor(make_config(PlacementPolicy.LOAD_BALANCE, prefill=1))
    assert isinstance(c.schedule(req(1, 1000), now=0.0), Placement)
    assert isinstance(c.schedule(req(2, 500), now=0.0), Placement)
    assert c.queue_time("p0", 0.0) == pytest.approx(1.5)
    assert c.queue_time("p0", 1.0) == pytest.approx(0.5)
    # The first one actually took 1.2 s: the second still needs its 0.5 s from then.
    c.prefill_finished(1, 1.2)
    assert c.queue_time("p0", 1.2) == pytest.approx(0.5)
    c.prefill_finished(2, 1.6)
    assert c.queue_time("p0", 1.6) == 0.0


def test_early_rejection_on_ttft_is_a_429_with_a_reason() -> None:
    c = Conductor(make_config(PlacementPolicy.GLOBAL_CACHE, Admission.EARLY, ttft_slo_s=1.0))
    r = c.schedule(req(1, 2000), now=0.0)  # 2 s of prefill anywhere
    assert isinstance(r, Rejection)
    assert r.reason is RejectReason.TTFT_SLO
    assert r.http_status == 429
    assert "SLO" in r.detail and r.est_ttft_s == pytest.approx(2.0)
    assert isinstance(c.schedule(req(2, 500), now=0.0), Placement)


def test_no_admission_places_everything() -> None:
    c = Conductor(make_config(PlacementPolicy.GLOBAL_CACHE, Admission.NONE, ttft_slo_s=1.0))
    assert isinstance(c.schedule(req(1, 20_000), now=0.0), Placement)


def test_early_rejection_on_tbt() -> None:
    slow = DecodeModel(base_s=0.2, per_seq_s=0.0, per_kv_token_s=0.0, capacity_tokens=10_000)
    cfg = dataclasses.replace(
        make_config(PlacementPolicy.GLOBAL_CACHE, Admission.EARLY), decode_model=slow
    )
    r = Conductor(cfg).schedule(req(1, 100), now=0.0)
    assert isinstance(r, Rejection) and r.reason is RejectReason.TBT_SLO


def _three_running(admission: Admission) -> Conductor:
    # Decode step = 10 ms + 1 ms per sequence; SLO 13.5 ms allows at most 3 sequences.
    c = Conductor(make_config(PlacementPolicy.LOAD_BALANCE, admission, decode=1, tbt_slo_s=0.0135))
    for rid in (1, 2, 3):
        assert isinstance(c.schedule(req(rid, 100), now=0.0), Placement)
    for rid in (1, 2, 3):
        c.prefill_finished(rid, 0.1)
        c.decode_started(rid, 0.1)
    return c


def test_early_rejection_uses_the_current_decode_batch() -> None:
    # 3 running + this one = 14 ms > 13.5 ms: rejected, although its prefill takes 5 s and the
    # three (typically 256 tokens x ~14 ms = 3.6 s) will be gone by then.
    r = _three_running(Admission.EARLY).schedule(req(4, 5000), now=0.2)
    assert isinstance(r, Rejection) and r.reason is RejectReason.TBT_SLO


def test_predictive_rejection_looks_at_the_batch_when_the_request_arrives() -> None:
    c = _three_running(Admission.PREDICTIVE)
    d = c.schedule(req(4, 5000), now=0.2)
    assert isinstance(d, Placement)
    assert d.est_tbt_s == pytest.approx(0.011)  # alone in the batch by t = 5.2 s
    # A short prefill arrives while the three still run: 4 x 1 ms + 10 ms > 13.5 ms.
    r = c.schedule(req(5, 100), now=0.2)
    assert isinstance(r, Rejection) and r.reason is RejectReason.TBT_SLO


def test_adaptive_rejects_what_would_not_fit_decode_memory() -> None:
    # Decode KV capacity is 10,000 tokens; 9,900 prompt + ~256 expected output cannot fit.
    big = req(1, 9900)
    r = Conductor(
        make_config(PlacementPolicy.ADAPTIVE, Admission.ADAPTIVE, ttft_slo_s=100.0)
    ).schedule(big, now=0.0)
    assert isinstance(r, Rejection) and r.reason is RejectReason.DECODE_CAPACITY
    ok = Conductor(
        make_config(PlacementPolicy.ADAPTIVE, Admission.PREDICTIVE, ttft_slo_s=100.0)
    ).schedule(big, now=0.0)
    assert isinstance(ok, Placement)


def test_adaptive_learns_its_estimate_error() -> None:
    def run(admission: Admission) -> Placement | Rejection:
        cfg = make_config(
            PlacementPolicy.ADAPTIVE, admission, ttft_slo_s=10.0, best_effort_idle_fraction=None
        )
        c = Conductor(cfg)
        t = 0.0
        for rid in range(20):
            assert isinstance(c.schedule(req(rid, 1500), now=t), Placement)  # est 1.5 s
            c.prefill_finished(rid, t + 3.0)  # ... but it took twice that
            c.decode_started(rid, t + 3.0)
            c.decode_finished(rid, t + 4.0, 100)
            t += 10.0
        return c.schedule(req(99, 6000), now=t)  # est 6 s, expected 12 s

    early = run(Admission.EARLY)
    assert isinstance(early, Placement)
    adaptive = run(Admission.ADAPTIVE)
    assert isinstance(adaptive, Rejection) and adaptive.reason is RejectReason.TTFT_SLO


def test_live_instance_speed_follows_the_prefill_legs() -> None:
    # p0 really runs 4x slower than the prefill model says; p1 and p2 as modelled.
    def run(learn: bool) -> Conductor:
        c = Conductor(
            make_config(
                PlacementPolicy.LOCAL_CACHE, Admission.EARLY, ttft_slo_s=0.5,
                learn_instance_speed=learn,
            )
        )  # fmt: skip
        placed = [c.schedule(req(rid, 300), now=0.0) for rid in range(3)]  # 0.3 s modelled
        assert {d.prefill for d in placed if isinstance(d, Placement)} == {"p0", "p1", "p2"}
        for d in placed:
            assert isinstance(d, Placement)
            c.prefill_finished(d.request_id, 1.2 if d.prefill == "p0" else 0.3)
            c.decode_started(d.request_id, 1.3)
            c.decode_finished(d.request_id, 1.4, 4)
        return c

    learned = run(True)
    assert learned.slowdown("p0") == pytest.approx(2.0)  # sqrt(1.2 / 0.3): moving halfway
    assert learned.slowdown("p1") == 1.0 == learned.slowdown("p2")
    first = learned.schedule(req(10, 300), now=10.0)
    assert isinstance(first, Placement) and first.prefill != "p0"
    assert first.est_ttft_s == pytest.approx(0.3)
    second = learned.schedule(req(11, 300), now=10.0)
    assert isinstance(second, Placement) and second.prefill not in ("p0", first.prefill)
    # p0 (0.6 s) or behind p1/p2 (0.6 s): both miss the 0.5 s SLO.
    third = learned.schedule(req(12, 300), now=10.0)
    assert isinstance(third, Rejection) and third.est_ttft_s == pytest.approx(0.6)
    # Without learning (the replay's setting) p0 still looks as fast as the others.
    plain = run(False)
    assert plain.slowdown("p0") == 1.0
    assert all(isinstance(plain.schedule(req(10 + i, 300), now=10.0), Placement) for i in range(3))


def test_adaptive_runs_hopeless_requests_best_effort_only_on_an_idle_pool() -> None:
    c = Conductor(make_config(PlacementPolicy.ADAPTIVE, Admission.ADAPTIVE, ttft_slo_s=1.0))
    # 2 s of prefill cannot meet a 1 s SLO; all three prefill nodes are idle: placed anyway.
    d = c.schedule(req(1, 2000), now=0.0)
    assert isinstance(d, Placement) and d.best_effort
    # Now p0 is busy; 2 of 3 idle is still >= 25%: placed, on an idle node.
    d2 = c.schedule(req(2, 2000), now=0.0)
    assert isinstance(d2, Placement) and d2.prefill != d.prefill
    c.schedule(req(3, 2000), now=0.0)
    # No idle node left: rejected.
    r = c.schedule(req(4, 2000), now=0.0)
    assert isinstance(r, Rejection) and r.reason is RejectReason.TTFT_SLO
    # Within the SLO a placement is not best effort.
    ok = Conductor(make_config(PlacementPolicy.ADAPTIVE, Admission.ADAPTIVE)).schedule(
        req(5, 500), now=0.0
    )
    assert isinstance(ok, Placement) and not ok.best_effort
    # Switched off, the idle pool does not matter.
    off = make_config(
        PlacementPolicy.ADAPTIVE, Admission.ADAPTIVE, ttft_slo_s=1.0, best_effort_idle_fraction=None
    )
    assert isinstance(Conductor(off).schedule(req(1, 2000), now=0.0), Rejection)


def test_output_length_is_learned() -> None:
    c = Conductor(make_config(PlacementPolicy.LOAD_BALANCE))
    before = c.expected_output_tokens
    assert isinstance(c.schedule(req(1, 100), now=0.0), Placement)
    c.prefill_finished(1, 0.1)
    c.decode_started(1, 0.1)
    c.decode_finished(1, 1.0, 5000)
    assert c.expected_output_tokens > before


def test_protocol_errors() -> None:
    c = Conductor(make_config(PlacementPolicy.LOAD_BALANCE))
    assert isinstance(c.schedule(req(1, 100), now=0.0), Placement)
    with pytest.raises(ConfigError):
        c.schedule(req(1, 100), now=0.0)
    with pytest.raises(ConfigError):
        c.prefill_finished(42, 1.0)
    with pytest.raises(ConfigError):
        c.decode_finished(42, 1.0, 3)
    with pytest.raises(ConfigError):
        c.queue_time("nope", 0.0)


@pytest.mark.parametrize(
    "change",
    [
        {"prefill_instances": ()},
        {"decode_instances": ("d0", "d0")},
        {"decode_instances": ("p0",)},
        {"ttft_slo_s": 0.0},
        {"tbt_slo_s": float("nan")},
        {"balancing_threshold": 0.5},
        {"error_quantile": 0.0},
        {"best_effort_idle_fraction": 0.0},
    ],
)
def test_bad_config_raises(change: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        dataclasses.replace(make_config(PlacementPolicy.RANDOM), **change)  # type: ignore[arg-type]


def test_bad_request_raises() -> None:
    with pytest.raises(ConfigError):
        ScheduleRequest(1, 0, ())


def test_local_cache_breaks_equal_estimates_toward_the_cached_prefix() -> None:
    from mooncake_connectors.conductor import PrefillModel

    # A flat profile (every prompt costs the same, as a noisy calibration can fit): the
    # estimates tie, and the instance holding the prefix must still win the tie.
    flat = dataclasses.replace(
        make_config(PlacementPolicy.LOCAL_CACHE), prefill_model=PrefillModel(0.05, 0.0, 0.0)
    )
    c = Conductor(flat)
    c.apply_cache_event(BlockStored("p2", tuple(range(1, 9))))
    d = c.schedule(req(1, 1000, tuple(range(1, 11))), now=0.0)
    assert isinstance(d, Placement) and (d.prefill, d.local_blocks) == ("p2", 8)
