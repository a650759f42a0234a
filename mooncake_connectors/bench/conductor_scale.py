"""How long one conductor decision takes in a large deployment, and what the index costs.

A pool of ``instances`` prefill instances (and ``decode`` decode instances) whose cache index
holds ``blocks`` cached blocks in all: each instance holds whole prefix chains of
``chain_blocks`` blocks, drawn from a shared pool of chains with Zipf-like popularity, so popular
prefixes have many holders and most have one or two. Requests then arrive one per simulated
``gap_s``: each prompt continues a chain (a popular one more often) with a few new blocks, is
placed, and is reported finished ``inflight`` requests later, so queues are never empty. The
store deployment is modelled by store events for every chain (``--store``), so global-cache and
adaptive cost a store load for every instance that lacks the prefix.

Measured: wall time of :meth:`Conductor.schedule` per decision (``perf_counter_ns`` around the
call only), and the process's resident memory before and after filling the index. The index's
objects are frozen out of the cyclic garbage collector once filled (``gc.freeze``).
"""

from __future__ import annotations

import dataclasses
import gc
import platform
import random
import statistics
import time
from typing import Any

from ..conductor import (
    Admission,
    BlockStored,
    Conductor,
    ConductorConfig,
    PlacementPolicy,
    ScheduleRequest,
    llama2_70b_a800,
)
from ..conductor.types import STORE


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _chains(count: int, length: int, rng: random.Random) -> list[tuple[int, ...]]:
    return [tuple(rng.getrandbits(63) for _ in range(length)) for _ in range(count)]


def run_scale(
    *,
    instances: int = 10_000,
    decode: int = 64,
    blocks: int = 1_000_000,
    chain_blocks: int = 10,
    decisions: int = 5_000,
    inflight: int = 2_000,
    gap_s: float = 0.001,
    policies: tuple[PlacementPolicy, ...] = (
        PlacementPolicy.LOAD_BALANCE,
        PlacementPolicy.LOCAL_CACHE,
        PlacementPolicy.GLOBAL_CACHE,
        PlacementPolicy.ADAPTIVE,
    ),
    seed: int = 0,
) -> dict[str, Any]:
    models = llama2_70b_a800()
    rng = random.Random(seed)
    per_instance = max(1, blocks // (instances * chain_blocks))
    pool = _chains(max(1, instances * per_instance // 4), chain_blocks, rng)
    weights = [1.0 / (i + 1) for i in range(len(pool))]  # Zipf, s = 1
    names = tuple(f"p{i}" for i in range(instances))
    base = ConductorConfig(
        prefill_instances=names,
        decode_instances=tuple(f"d{i}" for i in range(decode)),
        prefill_model=models.prefill, transfer_model=models.transfer,
        decode_model=models.decode, admission=Admission.NONE, store=True,
    )  # fmt: skip
    gc.collect()
    rss0 = _rss_bytes()
    filled = Conductor(base)
    prng = random.Random(seed + 1)
    t0 = time.perf_counter()
    for name in names:
        for chain in prng.choices(pool, weights, k=per_instance):
            filled.apply_cache_event(BlockStored(name, chain))
    for chain in pool:
        filled.apply_cache_event(BlockStored(STORE, chain))
    fill_s = time.perf_counter() - t0
    gc.collect()
    # A long-lived index is millions of objects that never form cycles; frozen, the collector
    # stops walking them (unfrozen, a full collection pauses a decision for milliseconds). A
    # proxy does the same after it warms up.
    gc.freeze()
    rss1 = _rss_bytes()
    cached = sum(len(filled.index.cache(n)) for n in names)
    results: list[dict[str, Any]] = []
    for policy in policies:
        c = Conductor(dataclasses.replace(base, placement=policy))
        # the same filled index for every policy (the scheduler only reads it while placing)
        c.index, c.store_index = filled.index, filled.store_index
        prng = random.Random(seed + 2)
        times: list[int] = []
        now = 0.0
        open_ids: list[int] = []
        fetches = 0
        for rid in range(1, decisions + 1):
            now += gap_s
            chain = prng.choices(pool, weights)[0]
            keys = chain[: prng.randrange(1, chain_blocks + 1)] + tuple(
                prng.getrandbits(63) for _ in range(prng.randrange(1, 6))
            )
            req = ScheduleRequest(rid, len(keys) * base.block_tokens, keys)
            t = time.perf_counter_ns()
            d = c.schedule(req, now)
            times.append(time.perf_counter_ns() - t)
            fetches += getattr(d, "fetch_blocks", 0) > 0
            open_ids.append(rid)
            if len(open_ids) > inflight:
                done = open_ids.pop(0)
                c.prefill_finished(done, now)
                c.decode_finished(done, now, 100)
        times.sort()
        results.append(
            {
                "policy": policy.value,
                "decisions": decisions,
                "mean_us": round(statistics.fmean(times) / 1e3, 1),
                "p50_us": round(times[len(times) // 2] / 1e3, 1),
                "p99_us": round(times[int(len(times) * 0.99)] / 1e3, 1),
                "max_us": round(times[-1] / 1e3, 1),
                "decisions_with_store_load": fetches,
            }
        )
    gc.unfreeze()
    return {
        "what": "conductor decision time and index memory at scale",
        "instances": instances,
        "decode_instances": decode,
        "target_cached_blocks": blocks,
        "chain_blocks": chain_blocks,
        "chains_in_pool": len(pool),
        "inflight": inflight,
        "cached_blocks": cached,
        "distinct_keys": filled.index.indexed_keys,
        "index_fill_s": round(fill_s, 2),
        "rss_growth_mib": round((rss1 - rss0) / 2**20, 1),
        "python": platform.python_version(),
        "results": results,
    }
