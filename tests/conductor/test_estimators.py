from __future__ import annotations

import math

import pytest

from mooncake_connectors.conductor.estimators import (
    LLAMA2_70B_KV_BYTES_PER_TOKEN,
    DecodeModel,
    LinkBook,
    PrefillModel,
    TransferModel,
    fit_prefill_model,
    llama2_70b_a800,
)
from mooncake_connectors.errors import ConfigError


def test_prefill_time_counts_uncached_work() -> None:
    m = PrefillModel(a=0.5, b=0.001, c=1e-6)
    # 0.5 + 0.001*1000 + 1e-6*(1000^2 - 0)
    assert m.time(1000) == pytest.approx(2.5)
    # cached 600: 0.5 + 0.001*400 + 1e-6*(1e6 - 3.6e5)
    assert m.time(1000, 600) == pytest.approx(0.5 + 0.4 + 0.64)
    assert m.time(1000, 5000) == pytest.approx(0.5)  # cache longer than prompt: constant only


def test_fit_recovers_exact_coefficients() -> None:
    truth = PrefillModel(a=0.05, b=2e-4, c=2e-9)
    samples = [(n, p, truth.time(n, p)) for n in (512, 4096, 16384, 65536) for p in (0, n // 2)]
    fitted = fit_prefill_model(samples)
    assert fitted.a == pytest.approx(0.05, rel=1e-6)
    assert fitted.b == pytest.approx(2e-4, rel=1e-6)
    assert fitted.c == pytest.approx(2e-9, rel=1e-6)


def test_fit_keeps_coefficients_non_negative() -> None:
    # Purely linear data with a downward wiggle at the top would give c < 0 unconstrained.
    samples = [(1000, 0, 1.0), (2000, 0, 2.0), (4000, 0, 4.0), (8000, 0, 7.5)]
    fitted = fit_prefill_model(samples)
    assert fitted.a >= 0 and fitted.b >= 0 and fitted.c >= 0
    assert fitted.c == 0.0


def test_fit_rejects_degenerate_input() -> None:
    with pytest.raises(ConfigError):
        fit_prefill_model([(1000, 0, 1.0), (1000, 0, 1.1)])
    with pytest.raises(ConfigError):
        fit_prefill_model([(1000, 0, 1.0), (1000, 0, 1.0), (1000, 0, 1.0)])
    with pytest.raises(ConfigError):
        fit_prefill_model([(1000, 0, -1.0), (2000, 0, 1.0), (3000, 0, 1.0)])


def test_transfer_time_and_congestion() -> None:
    t = TransferModel(bandwidth_bytes_per_s=100.0, kv_bytes_per_token=2, latency_s=0.5)
    assert t.time(0) == 0.0
    assert t.time(100) == pytest.approx(0.5 + 2.0)
    book = LinkBook(t)
    assert book.book("a", "b", 0.0, 100) == pytest.approx(2.5)
    # a's NIC is busy until 2.5: a second fetch from a queues behind the first.
    assert book.estimate("a", "c", 1.0, 100) == pytest.approx(5.0)
    # an unrelated pair is not delayed
    assert book.estimate("c", "d", 1.0, 100) == pytest.approx(3.5)


def test_decode_step() -> None:
    m = DecodeModel(base_s=0.01, per_seq_s=0.001, per_kv_token_s=1e-6, capacity_tokens=100)
    assert m.step_time(0, 0) == 0.0
    assert m.step_time(4, 1000) == pytest.approx(0.01 + 0.004 + 0.001)


def test_llama2_70b_constants() -> None:
    assert LLAMA2_70B_KV_BYTES_PER_TOKEN == 327_680  # 80 layers x 8 kv heads x 128 x K,V x bf16
    m = llama2_70b_a800(prefill_mfu=0.2)
    # 8k tokens: 2*69e9*8192 / (0.2*8*312e12) + attention + 50 ms, a couple of seconds
    assert 2.0 < m.prefill.time(8192) < 3.0
    assert math.isclose(m.prefill.b / m.prefill.c, 69e9 / (8192 * 80))
    assert 1_000_000 < m.decode.capacity_tokens < 1_500_000
    with pytest.raises(ConfigError):
        llama2_70b_a800(prefill_mfu=1.5)


@pytest.mark.parametrize(
    "build",
    [
        lambda: PrefillModel(-1.0, 0.0, 0.0),
        lambda: PrefillModel(0.0, math.nan, 0.0),
        lambda: TransferModel(0.0, 1),
        lambda: TransferModel(1.0, 0),
        lambda: DecodeModel(0.0, 0.0, 0.0, 0),
    ],
)
def test_bad_models_raise(build: object) -> None:
    with pytest.raises(ConfigError):
        build()  # type: ignore[operator]
