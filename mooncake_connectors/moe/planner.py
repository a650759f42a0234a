"""EPLB placement: how many replicas each logical expert gets and which rank holds each one.

The three steps follow DeepSeek's published EPLB (replicate the expert with the heaviest load per
replica, then pack replicas onto GPUs with the same number of slots each; hierarchically — groups
of experts onto nodes first — when the expert groups divide over the nodes). Two things differ:

- packing is longest-processing-time greedy *followed by* a local search that swaps items between
  the heaviest pack and any other pack while that lowers the heaviest pack; greedy alone leaves
  several percent on the table for skewed loads;
- replicas of one logical expert go to distinct ranks (anti-affinity), so that losing a rank
  never takes out more than one replica of an expert; the router depends on that for fault
  tolerance.

All functions are pure: tensors in, tensors out, CPU, batched over a leading dimension.
"""

from __future__ import annotations

import heapq
import math

import torch

from ..errors import ConfigError
from .placement import Placement, as_load, check_positive

# Relative tolerance for "this swap improves the heaviest pack": float sums of the same
# numbers in a different order differ in the last bits, and chasing those would loop.
_REL_EPS = 1e-9


def replicate_experts(
    load: torch.Tensor, num_physical: int, *, max_replicas: int | None = None
) -> torch.Tensor:
    """Greedy replication: give each redundant slot to the expert with the heaviest load per
    replica, so that the largest per-replica load is as small as possible.

    load: ``[B, n]`` non-negative load per logical expert (``B`` independent rows).
    num_physical: ``p >= n`` slots per row.
    max_replicas: cap per expert (the number of ranks the replicas may spread over).
    Returns ``[B, n]`` int64 replica counts, each row summing to ``p``; every count >= 1.
    """
    w = as_load(load)
    rows, n = w.shape
    check_positive(num_physical, "num_physical")
    if num_physical < n:
        raise ConfigError(f"num_physical ({num_physical}) must be >= the number of experts ({n})")
    cap = num_physical if max_replicas is None else max_replicas
    check_positive(cap, "max_replicas")
    if n * cap < num_physical:
        raise ConfigError(
            f"{num_physical} slots cannot hold {n} experts with at most {cap} replicas each"
        )
    counts = torch.ones(rows, n, dtype=torch.int64)
    row = torch.arange(rows)
    for _ in range(num_physical - n):
        per_replica = w / counts
        # Capped experts must never win; -1 is below every real (non-negative) per-replica load.
        per_replica = per_replica.masked_fill(counts >= cap, -1.0)
        counts[row, per_replica.argmax(1)] += 1
    return counts


def pack_balanced(
    weights: torch.Tensor,
    num_packs: int,
    *,
    labels: torch.Tensor | None = None,
    refine: bool = True,
    spread_tolerance: float = 0.01,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack ``m`` weighted items into ``num_packs`` packs of exactly ``m / num_packs`` items,
    minimising the heaviest pack.

    weights: ``[B, m]`` non-negative item weights (``B`` independent rows).
    labels: optional ``[B, m]`` int64; items with the same label (replicas of one expert) go to
        distinct packs, unless that makes the heaviest pack more than ``spread_tolerance``
        (relative) heavier than packing without the constraint. Both packings are computed and
        the spread one wins within the tolerance: ``0.0`` spreads only when it is free,
        ``math.inf`` always spreads (best effort).
    refine: run the swap local search after the greedy pass.
    Returns ``(pack_index, rank_in_pack)``, both ``[B, m]`` int64; within a pack, items are
    ranked heaviest first.
    """
    w = as_load(weights)
    rows, m = w.shape
    check_positive(num_packs, "num_packs")
    if m % num_packs:
        raise ConfigError(f"{m} items do not divide evenly into {num_packs} packs")
    if labels is None:
        lab = torch.arange(m, dtype=torch.int64).expand(rows, m)
    else:
        if not isinstance(labels, torch.Tensor) or labels.shape != w.shape:
            raise ConfigError(f"labels must be a tensor of shape {list(w.shape)}")
        if labels.is_floating_point() or labels.dtype == torch.bool or bool((labels < 0).any()):
            raise ConfigError("labels must be non-negative integers")
        lab = labels.to(device="cpu", dtype=torch.int64)
    if not spread_tolerance >= 0:
        raise ConfigError(f"spread_tolerance must be >= 0, got {spread_tolerance!r}")
    free = torch.arange(m, dtype=torch.int64)
    pack_index = torch.empty(rows, m, dtype=torch.int64)
    rank_in_pack = torch.empty(rows, m, dtype=torch.int64)
    for b in range(rows):
        packs = _pack_row(w[b], lab[b], num_packs, refine)
        if labels is not None and math.isfinite(spread_tolerance):
            # Co-locating two replicas of one expert is what an unconstrained packer may do; it
            # buys balance (finer granularity) and costs fault tolerance. Take it only when the
            # gain is larger than the tolerance.
            unconstrained = _pack_row(w[b], free, num_packs, refine)
            spread_max = _max_pack(w[b], packs, num_packs)
            if spread_max > _max_pack(w[b], unconstrained, num_packs) * (1.0 + spread_tolerance):
                packs = unconstrained
        pack_index[b] = packs
        # Heaviest first within each pack; ties by item index keep the result deterministic.
        pk, wl = packs.tolist(), w[b].tolist()
        order = sorted(range(m), key=lambda i: (pk[i], -wl[i], i))
        per = m // num_packs
        ranks = [0] * m
        for pos, item in enumerate(order):
            ranks[item] = pos % per
        rank_in_pack[b] = torch.tensor(ranks, dtype=torch.int64)
    return pack_index, rank_in_pack


def plan_placement(
    load: torch.Tensor,
    num_physical: int,
    num_ranks: int,
    *,
    num_nodes: int = 1,
    num_groups: int = 1,
    refine: bool = True,
    spread_tolerance: float = 0.01,
) -> Placement:
    """Balanced expert placement from load statistics.

    load: ``[N]`` or ``[L, N]`` load per logical expert (e.g. tokens routed per expert over a
        window; vLLM's and SGLang's EPLB recorders produce exactly this).
    num_physical: ``P``, slots per layer; a multiple of ``num_ranks``, ``N <= P <= N * R``.
    num_ranks: ``R`` (GPUs / EP ranks).
    num_nodes: nodes the ranks are spread over (ranks ``[k * R / nodes, (k + 1) * R / nodes)``
        live on node ``k``); must divide ``R``.
    num_groups: expert groups of the model (DeepSeek-V3: 8 groups of 32); must divide ``N``.
        When the groups divide over the nodes the plan is hierarchical (each group stays inside
        one node, replicas too, which keeps group-limited routing on the node's fast links);
        otherwise it is global.
    refine: improve the greedy packing by local search (off: DeepSeek-like greedy only).
    spread_tolerance: replicas of one expert go to distinct ranks unless that raises the
        heaviest rank by more than this fraction (see :func:`pack_balanced`).
    Returns a :class:`Placement` with every expert placed.
    """
    w = as_load(load)
    n = int(w.shape[1])
    for value, what in (
        (num_physical, "num_physical"),
        (num_ranks, "num_ranks"),
        (num_nodes, "num_nodes"),
        (num_groups, "num_groups"),
    ):
        check_positive(value, what)
    if num_physical % num_ranks:
        raise ConfigError(
            f"num_physical ({num_physical}) must be a multiple of num_ranks ({num_ranks})"
        )
    if num_ranks % num_nodes:
        raise ConfigError(f"num_ranks ({num_ranks}) must be a multiple of num_nodes ({num_nodes})")
    if n % num_groups:
        raise ConfigError(f"{n} experts do not divide into {num_groups} groups")
    if not n <= num_physical <= n * num_ranks:
        raise ConfigError(
            f"num_physical must lie in [{n}, {n * num_ranks}] for {n} experts on {num_ranks} ranks"
        )
    if num_nodes > 1 and num_groups % num_nodes == 0:
        p2l = _plan_hierarchical(
            w, num_physical, num_ranks, num_nodes, num_groups, refine, spread_tolerance
        )
    else:
        p2l = _plan_hierarchical(w, num_physical, num_ranks, 1, 1, refine, spread_tolerance)
    return Placement(p2l, num_logical=n, num_ranks=num_ranks)


def _plan_hierarchical(
    w: torch.Tensor,
    num_physical: int,
    num_ranks: int,
    num_nodes: int,
    num_groups: int,
    refine: bool,
    spread_tolerance: float,
) -> torch.Tensor:
    num_layers, n = w.shape
    group_size = n // num_groups
    per_node_logical = n // num_nodes
    per_node_physical = num_physical // num_nodes
    ranks_per_node = num_ranks // num_nodes
    slots = num_physical // num_ranks
    if not per_node_logical <= per_node_physical <= per_node_logical * ranks_per_node:
        raise ConfigError(
            f"{per_node_physical} slots per node cannot hold its {per_node_logical} experts "
            f"with replicas on distinct ranks"
        )

    # Step 1: whole groups onto nodes, balancing the groups' total load.
    group_load = w.view(num_layers, num_groups, group_size).sum(-1)
    node_of_group, pos_of_group = pack_balanced(group_load, num_nodes, refine=refine)
    # node_experts[l, k, j]: the j-th logical expert assigned to node k in layer l.
    groups_per_node = num_groups // num_nodes
    group_slot = node_of_group * groups_per_node + pos_of_group  # [L, G], a permutation
    node_groups = torch.empty_like(group_slot)
    node_groups.scatter_(1, group_slot, torch.arange(num_groups).expand(num_layers, -1))
    node_experts = (node_groups.unsqueeze(-1) * group_size + torch.arange(group_size)).reshape(
        num_layers, num_nodes, per_node_logical
    )

    # Step 2: replicate inside each node; a node's replicas can only spread over its ranks.
    node_load = w.gather(1, node_experts.reshape(num_layers, -1)).reshape(-1, per_node_logical)
    counts = replicate_experts(node_load, per_node_physical, max_replicas=ranks_per_node)

    # Step 3: pack each node's replicas onto its ranks; items are (local expert, load/replica).
    item_local = torch.repeat_interleave(
        torch.arange(per_node_logical).expand(counts.shape[0], -1).reshape(-1), counts.reshape(-1)
    ).reshape(-1, per_node_physical)
    item_load = (node_load / counts).gather(1, item_local)
    rank_in_node, slot_in_rank = pack_balanced(
        item_load,
        ranks_per_node,
        labels=item_local,
        refine=refine,
        spread_tolerance=spread_tolerance,
    )

    # Assemble: slot id = (node * ranks_per_node + rank_in_node) * slots + slot_in_rank.
    node_id = torch.arange(num_nodes).repeat(num_layers).unsqueeze(1)
    physical = (node_id * ranks_per_node + rank_in_node) * slots + slot_in_rank
    logical = node_experts.reshape(-1, per_node_logical).gather(1, item_local)
    p2l = torch.empty(num_layers, num_physical, dtype=torch.int64)
    p2l.scatter_(1, physical.reshape(num_layers, -1), logical.reshape(num_layers, -1))
    return p2l


def _pack_row(w: torch.Tensor, lab: torch.Tensor, num_packs: int, refine: bool) -> torch.Tensor:
    packs = _greedy(w.tolist(), lab.tolist(), num_packs)
    if refine and w.shape[0] // num_packs > 1:
        packs = _refine(w, lab, packs, num_packs)
    return packs


def _max_pack(w: torch.Tensor, packs: torch.Tensor, num_packs: int) -> float:
    return float(torch.zeros(num_packs, dtype=torch.float64).index_add_(0, packs, w).max())


def _greedy(w: list[float], lab: list[int], num_packs: int) -> torch.Tensor:
    """Longest-processing-time greedy with a per-pack item limit and label anti-affinity."""
    m = len(w)
    per = m // num_packs
    order = sorted(range(m), key=lambda i: (-w[i], lab[i], i))
    pack = [0] * m
    fill = [0] * num_packs
    load = [0.0] * num_packs
    members: list[set[int]] = [set() for _ in range(num_packs)]
    heap = [(0.0, q) for q in range(num_packs)]
    conflicts: list[int] = []
    for i in order:
        skipped = []
        chosen = -1
        # Lightest pack that does not already hold this label; full packs leave the heap.
        while heap:
            entry = heapq.heappop(heap)
            if lab[i] in members[entry[1]]:
                skipped.append(entry)
                continue
            chosen = entry[1]
            break
        if chosen < 0:
            # Every open pack holds this label already; take the lightest and repair below.
            skipped.sort()
            chosen = skipped.pop(0)[1]
            conflicts.append(i)
        for entry in skipped:
            heapq.heappush(heap, entry)
        pack[i] = chosen
        fill[chosen] += 1
        load[chosen] += w[i]
        members[chosen].add(lab[i])
        if fill[chosen] < per:
            heapq.heappush(heap, (load[chosen], chosen))
    if conflicts:
        _repair(w, lab, pack, load, conflicts, num_packs)
    return torch.tensor(pack, dtype=torch.int64)


def _repair(
    w: list[float],
    lab: list[int],
    pack: list[int],
    load: list[float],
    conflicts: list[int],
    num_packs: int,
) -> None:
    """Swap conflicting items (two of one label in a pack) with an item elsewhere so that
    neither pack ends with a duplicate, choosing the swap that keeps the heavier pack lightest.
    Best effort: if no such swap exists the duplicate stays (still a valid placement)."""
    held: list[dict[int, int]] = [{} for _ in range(num_packs)]
    for i, q in enumerate(pack):
        held[q][lab[i]] = held[q].get(lab[i], 0) + 1
    for a in conflicts:
        p = pack[a]
        if held[p].get(lab[a], 0) < 2:
            continue
        best: tuple[float, int] | None = None
        for b in range(len(w)):
            q = pack[b]
            if q == p or lab[b] == lab[a] or lab[a] in held[q] or lab[b] in held[p]:
                continue
            cost = max(load[p] - w[a] + w[b], load[q] - w[b] + w[a])
            if best is None or cost < best[0]:
                best = (cost, b)
        if best is None:
            continue
        b = best[1]
        q = pack[b]
        for item, src, dst in ((a, p, q), (b, q, p)):
            held[src][lab[item]] -= 1
            if not held[src][lab[item]]:
                del held[src][lab[item]]
            held[dst][lab[item]] = held[dst].get(lab[item], 0) + 1
            load[src] -= w[item]
            load[dst] += w[item]
            pack[item] = dst


def _refine(w: torch.Tensor, lab: torch.Tensor, pack: torch.Tensor, num_packs: int) -> torch.Tensor:
    """Local search: swap one item of the heaviest pack with one item of another pack when that
    lowers the heavier of the two below the current maximum and keeps labels apart.

    Each accepted swap lowers the sorted vector of pack loads lexicographically, so the loop
    ends; the round cap bounds the time on adversarial inputs.
    """
    pack = pack.clone()
    m = w.shape[0]
    num_labels = int(lab.max()) + 1
    loads = torch.zeros(num_packs, dtype=torch.float64).index_add_(0, pack, w)
    present = torch.zeros(num_packs, num_labels, dtype=torch.int64)
    present.index_put_((pack, lab), torch.ones(m, dtype=torch.int64), accumulate=True)
    eps = _REL_EPS * max(float(loads.sum()), 1e-300)
    inf = torch.tensor(float("inf"), dtype=torch.float64)
    for _ in range(8 * num_packs + m):
        h = int(loads.argmax())
        heavy = (pack == h).nonzero().squeeze(1)
        delta = w[heavy].unsqueeze(1) - w.unsqueeze(0)  # [S, m]: what the heavy pack sheds
        new_heavy = loads[h] - delta
        new_other = loads[pack].unsqueeze(0) + delta
        cost = torch.maximum(new_heavy, new_other)
        la = lab[heavy].unsqueeze(1)
        lb = lab.unsqueeze(0)
        ok = (
            (pack.unsqueeze(0) != h)
            & (delta > eps)
            & (la != lb)
            & (present[pack.unsqueeze(0), la] == 0)
            & (present[h, lb] == 0)
        )
        cost = torch.where(ok, cost, inf)
        flat = int(cost.argmin())
        if not float(cost.view(-1)[flat]) < float(loads[h]) - eps:
            break
        a = int(heavy[flat // m])
        b = flat % m
        q = int(pack[b])
        d = float(w[a] - w[b])
        loads[h] -= d
        loads[q] += d
        present[h, lab[a]] -= 1
        present[q, lab[b]] -= 1
        present[q, lab[a]] += 1
        present[h, lab[b]] += 1
        pack[a], pack[b] = q, h
    return pack
