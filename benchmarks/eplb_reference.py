"""Reference re-implementation of DeepSeek's published EPLB algorithm, used only as a baseline.

Written from the algorithm's description (github.com/deepseek-ai/EPLB, also vendored by vLLM as
``vllm/distributed/eplb/rebalance_algo.py``), not from its code:

1. replication: start with one replica per logical expert; give each redundant slot to the
   expert whose load per replica is currently the largest;
2. balanced packing: sort items by weight, heaviest first, and put each into the lightest pack
   that still has room (every pack ends with the same number of items); no local search, no
   anti-affinity;
3. hierarchical variant: pack expert groups onto nodes with (2) using the groups' total load,
   replicate inside each node with (1), pack each node's replicas onto its GPUs with (2); the
   global variant is the same with one group and one node. The entry point picks hierarchical
   when the number of groups is a multiple of the number of nodes, global otherwise.

Slots are numbered GPU-major (GPU g owns slots ``[g * S, (g + 1) * S)``), as in the original.
The output is ``physical_to_logical`` ``[L, P]`` only; the benchmarks and tests derive the rest.
"""

from __future__ import annotations

import torch


def reference_replicate(load: list[float], num_slots: int) -> list[int]:
    """Replica count per expert (list of length n, summing to ``num_slots``)."""
    counts = [1] * len(load)
    for _ in range(num_slots - len(load)):
        best = max(range(len(load)), key=lambda e: (load[e] / counts[e], -e))
        counts[best] += 1
    return counts


def reference_pack(weights: list[float], num_packs: int) -> list[tuple[int, int]]:
    """(pack, position in pack) per item; equal item counts per pack, greedy only."""
    per_pack = len(weights) // num_packs
    if per_pack == 1:
        return [(i, 0) for i in range(len(weights))]
    order = sorted(range(len(weights)), key=lambda i: (-weights[i], i))
    totals = [0.0] * num_packs
    sizes = [0] * num_packs
    result = [(0, 0)] * len(weights)
    for item in order:
        open_packs = [p for p in range(num_packs) if sizes[p] < per_pack]
        pack = min(open_packs, key=lambda p: (totals[p], p))
        result[item] = (pack, sizes[pack])
        totals[pack] += weights[item]
        sizes[pack] += 1
    return result


def _layer_hierarchical(
    load: list[float], num_slots: int, num_groups: int, num_nodes: int, num_gpus: int
) -> list[int]:
    n = len(load)
    group_size = n // num_groups
    groups_per_node = num_groups // num_nodes
    gpus_per_node = num_gpus // num_nodes
    slots_per_node = num_slots // num_nodes
    slots_per_gpu = num_slots // num_gpus

    group_totals = [sum(load[g * group_size : (g + 1) * group_size]) for g in range(num_groups)]
    node_of_group = reference_pack(group_totals, num_nodes)
    per_node = groups_per_node * group_size
    experts_of_node: list[list[int]] = [[0] * per_node for _ in range(num_nodes)]
    for g, (node, pos) in enumerate(node_of_group):
        for j in range(group_size):
            experts_of_node[node][pos * group_size + j] = g * group_size + j

    p2l = [-1] * num_slots
    for node, experts in enumerate(experts_of_node):
        node_load = [load[e] for e in experts]
        counts = reference_replicate(node_load, slots_per_node)
        items: list[int] = []  # local expert index of each replica
        for local, c in enumerate(counts):
            items.extend([local] * c)
        weights = [node_load[i] / counts[i] for i in items]
        for item, (gpu, pos) in enumerate(reference_pack(weights, gpus_per_node)):
            slot = (node * gpus_per_node + gpu) * slots_per_gpu + pos
            p2l[slot] = experts[items[item]]
    return p2l


def reference_rebalance(
    load: torch.Tensor, num_slots: int, num_groups: int, num_nodes: int, num_gpus: int
) -> torch.Tensor:
    """``[L, P]`` physical-to-logical map from load ``[L, N]`` (or ``[N]``)."""
    rows = load.double().reshape(-1, load.shape[-1]).tolist()
    if num_groups % num_nodes == 0:
        layers = [_layer_hierarchical(r, num_slots, num_groups, num_nodes, num_gpus) for r in rows]
    else:
        layers = [_layer_hierarchical(r, num_slots, 1, 1, num_gpus) for r in rows]
    return torch.tensor(layers, dtype=torch.int64)
