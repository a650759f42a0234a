"""Synthetic, engine-shaped MoE traffic for the benchmark and the tests.

Tokens pick their top-k experts without replacement from a Zipf distribution over a random
permutation of the experts (Gumbel top-k), so per-expert load is skewed the way real MoE
traffic is, and every token's top-k holds distinct experts like a real router's.
"""

from __future__ import annotations

import torch

from ..moe.placement import Placement


def zipf_gate_scores(
    num_tokens: int, num_experts: int, exponent: float, generator: torch.Generator
) -> torch.Tensor:
    """``[T, N]`` float32 scores whose top-k is a without-replacement draw from Zipf."""
    rank = torch.randperm(num_experts, generator=generator) + 1
    log_p = -exponent * torch.log(rank.to(torch.float64))
    uniform = torch.rand(num_tokens, num_experts, generator=generator, dtype=torch.float64)
    gumbel = -torch.log(-torch.log(uniform.clamp(1e-12, 1 - 1e-12)))
    return (log_p + gumbel).float()


def expert_load(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """``[N]`` float64 tokens per logical expert when each token takes its top-k."""
    ids = scores.topk(top_k, dim=1).indices
    return torch.bincount(ids.reshape(-1), minlength=scores.shape[1]).to(torch.float64)


def no_replication(num_logical: int, num_ranks: int) -> Placement:
    """The default layout without EPLB: expert ``e`` on rank ``e // (N / R)``."""
    return Placement(torch.arange(num_logical).unsqueeze(0), num_logical, num_ranks)
