"""Time estimators the conductor plans with, and the instance models the replay runs on.

Prefill: ``t = a + b·new + c·(n^2 - p^2)`` seconds for a prompt of ``n`` tokens whose first ``p``
are cached (``new = n - p``). The linear term is the weight FLOPs of the new tokens; the quadratic
one is causal attention of the new tokens over the whole prefix (``Σ_{i=p}^{n} i ≈ (n^2 - p^2)/2``).
The coefficients are fitted by least squares to measured (n, p, seconds) profiles
(:func:`fit_prefill_model`), as the paper's conductor does with offline data (§6.1).

Transfer: ``t = latency + bytes / bandwidth`` with ``bytes = tokens · kv_bytes_per_token``;
:class:`LinkBook` adds congestion by serialising transfers on each node's NIC.

Decode: one step of continuous batching reads the weights once plus every running sequence's KV,
so ``step = base + per_seq·batch + per_kv_token·kv_tokens`` (memory bound), and TBT of a steady
batch is one step.

The reference constants (:func:`llama2_70b_a800`) and why they are what they are: docs/conductor.md.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

import numpy as np

from ..errors import ConfigError


def _check_nonneg(**values: float) -> None:
    for name, v in values.items():
        if not math.isfinite(v) or v < 0:
            raise ConfigError(f"{name} must be a finite number >= 0", **_option(name, v))


def _check_pos(**values: float) -> None:
    for name, v in values.items():
        if not math.isfinite(v) or v <= 0:
            raise ConfigError(f"{name} must be a finite number > 0", **_option(name, v))


def _option(name: str, value: float) -> dict[str, Any]:
    # The option's own name carries the bad value (ConfigError's context); typed Any because the
    # name is only known at run time, and none of these is one of ConfigError's declared fields.
    return {name: value}


@dataclasses.dataclass(frozen=True)
class PrefillModel:
    """Prefill seconds of ``n`` prompt tokens with ``p`` cached: ``a + b·(n-p) + c·(n^2-p^2)``."""

    a: float
    b: float
    c: float

    def __post_init__(self) -> None:
        _check_nonneg(a=self.a, b=self.b, c=self.c)

    def time(self, prompt_tokens: int, cached_tokens: int = 0) -> float:
        if prompt_tokens < 0 or cached_tokens < 0:
            raise ConfigError("token counts must be >= 0")
        p = min(cached_tokens, prompt_tokens)
        n = prompt_tokens
        return self.a + self.b * (n - p) + self.c * (n * n - p * p)

    def scaled(self, factor: float) -> PrefillModel:
        """The same shape on hardware ``factor`` times slower (> 1) or faster (< 1)."""
        _check_pos(factor=factor)
        return PrefillModel(self.a * factor, self.b * factor, self.c * factor)


def fit_prefill_model(samples: Iterable[tuple[int, int, float]]) -> PrefillModel:
    """Least-squares fit (relative error) of :class:`PrefillModel` to ``(prompt, cached, s)``.

    Coefficients are kept non-negative (a negative quadratic term would predict that long
    prompts get cheaper): a term the unconstrained fit drives below zero is dropped and the rest
    refitted. Needs at least three samples with distinct prompt lengths.
    """
    rows = [(float(n), float(min(p, n)), float(t)) for n, p, t in samples]
    if len(rows) < 3:
        raise ConfigError("fit_prefill_model needs at least 3 samples", samples=len(rows))
    if any(n < 0 or p < 0 or not math.isfinite(t) or t < 0 for n, p, t in rows):
        raise ConfigError("samples must be (tokens >= 0, cached >= 0, seconds >= 0)")
    arr = np.asarray(rows)
    n, p, t = arr[:, 0], arr[:, 1], arr[:, 2]
    feats = np.stack([np.ones_like(n), n - p, n * n - p * p], axis=1)
    # Profiling noise is relative (a 100 s prefill wobbles by seconds, a 0.1 s one by ms), so
    # minimise relative error: unweighted, the long samples would set the constant term.
    w = 1.0 / np.maximum(t, 1e-6)
    feats, t = feats * w[:, None], t * w
    if np.linalg.matrix_rank(feats) < 3:
        raise ConfigError("samples do not determine a, b and c (need distinct prompt lengths)")
    active = [0, 1, 2]
    coef = np.zeros(3)
    while active:
        sol, *_ = np.linalg.lstsq(feats[:, active], t, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0.0
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return PrefillModel(float(coef[0]), float(coef[1]), float(coef[2]))


@dataclasses.dataclass(frozen=True)
class TransferModel:
    """Seconds to move KV of ``tokens`` tokens between two nodes over an idle link."""

    bandwidth_bytes_per_s: float
    kv_bytes_per_token: int
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        _check_pos(bandwidth_bytes_per_s=self.bandwidth_bytes_per_s)
        if self.kv_bytes_per_token <= 0:
            raise ConfigError("kv_bytes_per_token must be > 0")
        _check_nonneg(latency_s=self.latency_s)

    def time(self, tokens: int) -> float:
        if tokens < 0:
            raise ConfigError("tokens must be >= 0", tokens=tokens)
        if tokens == 0:
            return 0.0
        return self.latency_s + tokens * self.kv_bytes_per_token / self.bandwidth_bytes_per_s


class LinkBook:
    """Per-node NIC reservations: a transfer occupies the sender's and receiver's NIC.

    Hot prefixes make one node the source of many fetches at once; a size/bandwidth estimate
    ignores that queue, a booking sees it.
    """

    def __init__(self, model: TransferModel) -> None:
        self.model = model
        self._free_at: dict[str, float] = {}

    def estimate(self, src: str, dst: str, now: float, tokens: int) -> float:
        """Completion time of a transfer asked for at ``now`` (nothing is booked)."""
        if tokens <= 0:
            return now
        start = max(now, self._free_at.get(src, 0.0), self._free_at.get(dst, 0.0))
        return start + self.model.time(tokens)

    def book(self, src: str, dst: str, now: float, tokens: int) -> float:
        """Reserve both NICs for the transfer; returns its completion time."""
        end = self.estimate(src, dst, now, tokens)
        if tokens > 0:
            self._free_at[src] = end
            self._free_at[dst] = end
        return end


@dataclasses.dataclass(frozen=True)
class DecodeModel:
    """Step time of a decode instance and its KV capacity in tokens."""

    base_s: float
    per_seq_s: float
    per_kv_token_s: float
    capacity_tokens: int

    def __post_init__(self) -> None:
        _check_nonneg(
            base_s=self.base_s, per_seq_s=self.per_seq_s, per_kv_token_s=self.per_kv_token_s
        )
        if self.capacity_tokens <= 0:
            raise ConfigError("capacity_tokens must be > 0", capacity_tokens=self.capacity_tokens)

    def step_time(self, batch: int, kv_tokens: float) -> float:
        if batch < 0 or kv_tokens < 0:
            raise ConfigError("batch and kv_tokens must be >= 0")
        if batch == 0:
            return 0.0
        return self.base_s + self.per_seq_s * batch + self.per_kv_token_s * kv_tokens


# LLaMA2-70B: 80 layers, 8 KV heads (GQA) of 128 dims, K and V, bf16.
LLAMA2_70B_KV_BYTES_PER_TOKEN = 80 * 8 * 128 * 2 * 2
_LLAMA2_70B_PARAMS = 69e9
_LLAMA2_70B_LAYERS = 80
_LLAMA2_70B_HIDDEN = 8192
# One node of the paper's testbed: 8x A800-SXM4-80GB (312 dense bf16 TFLOP/s, ~2.0 TB/s HBM each).
_NODE_FLOPS = 8 * 312e12
_NODE_HBM_BYTES_PER_S = 8 * 2.0e12
_NODE_HBM_BYTES = 8 * 80e9


@dataclasses.dataclass(frozen=True)
class InstanceModels:
    """The models of one simulated deployment (ground truth of the replay)."""

    prefill: PrefillModel
    transfer: TransferModel
    decode: DecodeModel
    cache_capacity_blocks: int


def llama2_70b_a800(
    prefill_mfu: float = 0.25,
    nic_bytes_per_s: float = 50e9,
    cache_capacity_blocks: int = 8000,
    decode_hbm_efficiency: float = 0.6,
) -> InstanceModels:
    """Roofline models of a LLaMA2-70B node on 8x A800 (the paper's testbed, §8).

    ``prefill_mfu`` is the fraction of peak FLOP/s a prefill achieves; 0.25 is what reproduces
    the TTFT regime of the paper's Figure 5 on the conversation trace (docs/conductor.md shows the
    calibration). ``nic_bytes_per_s`` is half of the testbed's 800 Gbps RDMA. The DRAM pool of
    ``cache_capacity_blocks`` 512-token blocks (160 MiB each) is 1.25 TiB.
    """
    _check_pos(prefill_mfu=prefill_mfu, nic_bytes_per_s=nic_bytes_per_s)
    _check_pos(decode_hbm_efficiency=decode_hbm_efficiency)
    if prefill_mfu > 1 or decode_hbm_efficiency > 1:
        raise ConfigError("efficiencies are fractions of peak, at most 1")
    flops = _NODE_FLOPS * prefill_mfu
    prefill = PrefillModel(
        a=0.05,
        b=2 * _LLAMA2_70B_PARAMS / flops,
        # QK^T and AV: 2·2·hidden FLOPs per (query, key) pair and layer, causal sum ≈ (n^2-p^2)/2.
        c=2 * _LLAMA2_70B_HIDDEN * _LLAMA2_70B_LAYERS / flops,
    )
    bw = _NODE_HBM_BYTES_PER_S * decode_hbm_efficiency
    weights = 2 * _LLAMA2_70B_PARAMS
    decode = DecodeModel(
        base_s=weights / bw,
        per_seq_s=1e-4,
        per_kv_token_s=LLAMA2_70B_KV_BYTES_PER_TOKEN / bw,
        # 90% of HBM for weights plus KV, as vLLM's gpu_memory_utilization default.
        capacity_tokens=int((0.9 * _NODE_HBM_BYTES - weights) // LLAMA2_70B_KV_BYTES_PER_TOKEN),
    )
    transfer = TransferModel(nic_bytes_per_s, LLAMA2_70B_KV_BYTES_PER_TOKEN, latency_s=1e-3)
    return InstanceModels(prefill, transfer, decode, cache_capacity_blocks)
