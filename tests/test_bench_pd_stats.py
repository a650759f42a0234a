"""The tail figures ``bench vllm-pd`` records for the decode leg (issue goal: p99 <= 2x median)."""

from __future__ import annotations

import pytest

from mooncake_connectors.bench.pd_stats import cold_summary, tail


def test_tail_of_fifty_puts_p99_between_the_two_slowest() -> None:
    values = [30.0] * 48 + [60.0, 300.0]
    got = tail(values)
    assert got is not None
    assert got["median"] == 30.0 and got["p90"] == 30.0 and got["max"] == 300.0
    # inclusive quantiles: p99 sits at 0.99 * 49 = 48.51 in the sorted list
    assert got["p99"] == pytest.approx(60.0 + 0.51 * 240.0, abs=0.1)
    assert got["p99_over_median"] == pytest.approx(got["p99"] / 30.0, abs=0.01)


def test_one_slow_request_in_fifty_does_not_pass_for_a_tight_tail() -> None:
    even = tail([20.0 + i % 5 for i in range(50)])
    assert even is not None and even["p99_over_median"] <= 2.0
    spiked = tail([20.0 + i % 5 for i in range(49)] + [600.0])
    assert spiked is not None and spiked["p99_over_median"] > 2.0


def test_too_few_values_have_no_tail() -> None:
    assert tail([]) is None and tail([5.0]) is None


def test_cold_summary_reports_each_sizes_first_request_apart() -> None:
    runs = {"512": [40.0, 20.0, 22.0, 21.0, 20.0, 21.0], "4123": [600.0] + [25.0] * 5}
    runs |= {"1024": [21.0] * 6, "2048": [23.0] * 6}
    got = cold_summary(runs)
    assert got is not None
    assert got["requests"] == 24
    assert got["first_of_size_ms"] == {"512": 40.0, "4123": 600.0, "1024": 21.0, "2048": 23.0}
    assert got["warmed_median_ms"] == {"512": 21.0, "4123": 25.0, "1024": 21.0, "2048": 23.0}
    assert got["first_over_warmed_median"]["4123"] == 24.0
    # the firsts count in the tail: one 600 ms stall among 24 breaks both targets
    assert got["all_requests"]["max"] == 600.0
    assert got["p99_within_2x_median"] is False and got["max_within_3x_median"] is False


def test_cold_summary_passes_an_even_run() -> None:
    got = cold_summary({str(n): [20.0 + i % 3 for i in range(6)] for n in (512, 1024, 2048, 4123)})
    assert got is not None
    assert got["p99_within_2x_median"] is True and got["max_within_3x_median"] is True
    assert cold_summary({"512": []}) is None


@pytest.mark.parametrize(
    ("lengths", "rounds", "why"),
    [([512, 1024], 6, "under 24"), ([64, 512, 1024, 2048], 6, "exceed 64"), ([512] * 4, 6, "once")],
)
def test_cold_sizes_refuses_runs_that_cannot_show_a_cold_tail(
    lengths: list[int], rounds: int, why: str
) -> None:
    from mooncake_connectors.bench.vllm_pd import run_pd_benchmark

    with pytest.raises(ValueError, match=why):  # before any engine or model is made
        run_pd_benchmark(lengths=lengths, rounds=rounds, cold_sizes=True, work_dir=None)
