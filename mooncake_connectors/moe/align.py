"""Keep a fresh plan close to the placement the engine runs now, so a rebalance moves little.

A planner labels its packs arbitrarily: pack 0 need not be the rank that held most of those
experts before. Renaming packs to ranks is free for balance (a rank's load moves with it) and
for anti-affinity (replicas stay on distinct ranks), so :func:`align_to_previous` matches each
new pack to the old rank it shares the most experts with, then keeps every expert that stays on
its rank in the slot it had. Nodes are matched as blocks first and ranks only within matched
nodes, so a hierarchical plan keeps each group on one node.

:func:`cross_rank_moves` counts what a rearrangement costs on the wire: slots whose new expert
is not anywhere on that rank before (an expert that only changes slot on its rank is a local
copy in both engines).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..errors import ConfigError
from .placement import EMPTY_SLOT, Placement, check_positive


def _rank_counts(rows: torch.Tensor, num_logical: int) -> torch.Tensor:
    """``[R, N]`` experts per rank of one layer's ``[R, S]`` slots (empty slots dropped)."""
    counts = torch.zeros(rows.shape[0], num_logical + 1, dtype=torch.int64)
    counts.scatter_add_(1, rows.clamp(min=EMPTY_SLOT) + 1, torch.ones_like(rows))
    return counts[:, 1:]


def _greedy(overlap: torch.Tensor, allowed: Callable[[int, int], bool]) -> list[int]:
    """Greedy maximum-overlap matching of a square matrix: ``target[new] = old``."""
    size = overlap.shape[0]
    order = overlap.flatten().argsort(descending=True, stable=True).tolist()
    target = [-1] * size
    taken = [False] * size
    for flat in order:
        new, old = divmod(flat, size)
        if target[new] < 0 and not taken[old] and allowed(new, old):
            target[new] = old
            taken[old] = True
    return target


def _match_ranks(overlap: torch.Tensor, num_nodes: int) -> list[int]:
    """``target[new_pack] = old_rank``: nodes matched first (a node's packs move as a block,
    which keeps a hierarchical plan's groups together), then ranks within matched nodes."""
    num_ranks = overlap.shape[0]
    per = num_ranks // num_nodes
    by_node = overlap.view(num_nodes, per, num_nodes, per).sum((1, 3))
    node_target = _greedy(by_node, lambda _new, _old: True)
    # Every pair is allowed within matched nodes, so both passes match everything.
    return _greedy(overlap, lambda new, old: node_target[new // per] == old // per)


def _keep_slots(new_rank: list[int], old_rank: list[int]) -> list[int]:
    """Order one rank's new experts so that those it already held keep their old slots."""
    pending = list(new_rank)
    out = [EMPTY_SLOT] * len(new_rank)
    for slot, expert in enumerate(old_rank):
        if expert >= 0 and expert in pending:
            pending.remove(expert)
            out[slot] = expert
    fill = iter(pending)
    return [e if e != EMPTY_SLOT else next(fill) for e in out]


def align_to_previous(plan: Placement, previous: torch.Tensor, *, num_nodes: int = 1) -> Placement:
    """``plan`` with its ranks renamed and slots reordered to match ``previous``.

    previous: ``[L, P]`` physical-to-logical map the engine runs now (``-1`` = empty slot). When
        its shape differs from the plan's (the rank count changed), ``plan`` is returned as is.
    num_nodes: ranks ``[k * R / nodes, (k + 1) * R / nodes)`` form node ``k``; whole nodes are
        renamed, and ranks within a node.
    """
    check_positive(num_nodes, "num_nodes")
    if plan.num_ranks % num_nodes:
        raise ConfigError(f"{plan.num_ranks} ranks do not divide over {num_nodes} nodes")
    if not isinstance(previous, torch.Tensor) or previous.is_floating_point():
        raise ConfigError("previous must be an integer tensor")
    old = previous.detach().to(device="cpu", dtype=torch.int64)
    if tuple(old.shape) != tuple(plan.physical_to_logical.shape):
        return plan
    num_ranks, slots = plan.num_ranks, plan.slots_per_rank
    out = torch.empty_like(plan.physical_to_logical)
    for layer in range(plan.num_layers):
        new_rows = plan.physical_to_logical[layer].view(num_ranks, slots)
        old_rows = old[layer].view(num_ranks, slots)
        cn = _rank_counts(new_rows, plan.num_logical)
        co = _rank_counts(old_rows, plan.num_logical)
        overlap = torch.minimum(cn.unsqueeze(1), co.unsqueeze(0)).sum(-1)
        target = _match_ranks(overlap, num_nodes)
        aligned = out[layer].view(num_ranks, slots)
        for new, old_r in enumerate(target):
            aligned[old_r] = torch.tensor(
                _keep_slots(new_rows[new].tolist(), old_rows[old_r].tolist()), dtype=torch.int64
            )
    return Placement(out, plan.num_logical, num_ranks)


def cross_rank_moves(previous: torch.Tensor, new: torch.Tensor, num_ranks: int) -> int:
    """Slots of ``new`` ``[L, P]`` whose expert was on no slot of that rank in ``previous``."""
    check_positive(num_ranks, "num_ranks")
    if previous.shape != new.shape or new.dim() != 2 or new.shape[1] % num_ranks:
        raise ConfigError("previous and new must both be [L, P] with P a multiple of num_ranks")
    slots = new.shape[1] // num_ranks
    moves = 0
    for layer in range(new.shape[0]):
        before = previous[layer].view(num_ranks, slots).tolist()
        after = new[layer].view(num_ranks, slots).tolist()
        for held, wanted in zip(before, after, strict=True):
            moves += sum(1 for e in wanted if e >= 0 and e not in held)
    return moves
