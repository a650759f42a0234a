"""Scheduler- and worker-side bookkeeping of MooncakeConnectorsStore inside vLLM's real Scheduler.

No model runs: vLLM's own VllmConfig, KVCacheConfig, Scheduler and Request objects, a real store
(our master and a store server, in this process), and KV-shaped torch tensors for the worker.
The tests play the worker's part with ModelRunnerOutput / KVConnectorOutput and check what the
scheduler does with our answers: which prompt tokens are external hits, which blocks are loaded
or saved, recompute after load errors, prefix caching on and off, and no store at all.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import free_port, wait_until
from store_cluster import in_process_store

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")

import torch
from test_pd_scheduler import BS, NUM_BLOCKS, free_blocks, request, step
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from mooncake_connectors.adapters.vllm import plugin
from mooncake_connectors.adapters.vllm.store_config import StoreConnectorConfig
from mooncake_connectors.adapters.vllm.store_connector import MooncakeConnectorsStore
from mooncake_connectors.adapters.vllm.store_keys import prompt_block_hashes
from mooncake_connectors.adapters.vllm.store_scheduler import (
    BlockSpec,
    StoreConnectorMetadata,
    block_keys,
)
from mooncake_connectors.adapters.vllm.store_worker import StoreWorker
from mooncake_connectors.errors import ConfigError
from mooncake_connectors.store import ClientConfig, StoreClient
from mooncake_connectors.store.server import StoreServer

pytestmark = pytest.mark.vllm

LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
HEADS, HEAD = 2, 64
PROMPT = list(range(100, 200))  # 100 tokens: 6 loadable blocks of 16 (never the last token)


@pytest.fixture(scope="module", autouse=True)
def registered() -> None:
    plugin.register()


@pytest.fixture
def store() -> Iterator[tuple[str, StoreServer]]:
    with in_process_store(64 << 20) as store:
        yield store


def vllm_config(model: Path, role: str, extra: dict[str, Any], caching: bool) -> VllmConfig:
    vc = VllmConfig(
        model_config=ModelConfig(model=str(model), dtype="bfloat16", max_model_len=2048, seed=0),
        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=caching),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=2048,
            max_num_seqs=8,
            max_model_len=2048,
            is_encoder_decoder=False,
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="MooncakeConnectorsStore",
            kv_role=role,
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=extra,
        ),
    )
    vc.cache_config.num_gpu_blocks = NUM_BLOCKS
    return vc


KCC = KVCacheConfig(
    num_blocks=NUM_BLOCKS,
    kv_cache_tensors=[],
    kv_cache_groups=[
        KVCacheGroupSpec(
            LAYERS,
            FullAttentionSpec(
                block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16
            ),
        )
    ],
)


def make_scheduler(
    model: Path, master: str, role: str = "kv_both", caching: bool = True, **extra: Any
) -> Scheduler:
    # save_during_prefill off: these tests follow the finish-time save (test_vllm_store_prefill
    # has the saves during the prefill)
    base = {
        "master": master,
        "timeout": 3.0,
        "load_async": True,
        "lookup_async": False,
        "save_during_prefill": False,
    }
    vc = vllm_config(model, role, base | extra, caching)
    s = Scheduler(vc, KCC, StructuredOutputManager(vc), block_size=BS, log_stats=False)
    assert isinstance(s.connector, MooncakeConnectorsStore)
    return s


def connected(s: Scheduler) -> Scheduler:
    store = s.connector.scheduler.store
    assert store.wait_connected(10)
    # one client config, built before the client started: every call held to the lookup deadline
    assert store.client().cfg.timeout == s.connector.scheduler.config.lookup_timeout
    return s


def meta(out: SchedulerOutput) -> StoreConnectorMetadata:
    assert isinstance(out.kv_connector_metadata, StoreConnectorMetadata)
    return out.kv_connector_metadata


def store_blocks(model: Path, master: str, prompt: list[int], blocks: list[int], skip=()) -> None:
    """Put (dummy) objects for these blocks of ``prompt``, every layer unless in ``skip``."""
    keys, layers = block_keys(
        StoreConnectorConfig(master=master), vllm_config(model, "kv_both", {}, True), KCC
    )
    hashes = prompt_block_hashes(prompt, BS)
    size = BS * HEADS * 2 * HEAD * 2
    with StoreClient(ClientConfig(master=master)) as c:
        for b in blocks:
            for key in keys.keys([hashes[b]], layers):
                if key not in skip:
                    c.put(key, bytes(size))


def test_names_and_unknown_extra_config_key(tiny_model: Path) -> None:
    assert KVConnectorFactory.get_connector_class_by_name("MooncakeConnectorsStore") is (
        MooncakeConnectorsStore
    )
    with pytest.raises(ConfigError, match=r"timout.*allowed: .*'timeout'"):
        make_scheduler(tiny_model, "127.0.0.1:1", timout=5)


def test_miss_computes_locally_then_saves_full_prompt_blocks(tiny_model: Path, store) -> None:
    s = connected(make_scheduler(tiny_model, store[0]))
    idle = free_blocks(s)
    s.add_request(request("r1", PROMPT, 1))
    out, finished = step(s, {"r1": 5})
    assert out.num_scheduled_tokens == {"r1": 100}  # nothing in the store
    assert "r1" in finished
    assert free_blocks(s) < idle  # kept for the save
    out, _ = step(s)
    (save,) = meta(out).saves
    assert save.request_id == "r1" and len(save.block_ids) == 6
    assert save.hashes == prompt_block_hashes(PROMPT, BS)
    step(s, kv=KVConnectorOutput(finished_sending={"r1"}))
    assert free_blocks(s) == idle


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-caching", "no-prefix-caching"])
def test_store_hit_is_loaded_asynchronously(tiny_model: Path, store, caching: bool) -> None:
    store_blocks(tiny_model, store[0], PROMPT, list(range(6)))
    s = connected(make_scheduler(tiny_model, store[0], caching=caching))
    r = request("r2", PROMPT, 3)
    s.add_request(r)
    out, _ = step(s)
    assert out.num_scheduled_tokens == {}
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (load,) = meta(out).loads
    (allocated,) = s.kv_cache_manager.get_block_ids("r2")
    assert load.block_ids == allocated[:6]
    assert load.hashes == prompt_block_hashes(PROMPT, BS) and load.error is None
    step(s, kv=KVConnectorOutput(finished_recving={"r2"}))
    out, _ = step(s, {"r2": 9})
    assert out.num_scheduled_tokens == {"r2": 100 - 96}


def test_synchronous_load_computes_the_rest_in_the_same_step(tiny_model: Path, store) -> None:
    store_blocks(tiny_model, store[0], PROMPT, list(range(6)))
    s = connected(make_scheduler(tiny_model, store[0], caching=False, load_async=False))
    r = request("r2s", PROMPT, 3)
    s.add_request(r)
    out, _ = step(s, {"r2s": 9})
    assert out.num_scheduled_tokens == {"r2s": 4}  # loaded in this step's start_load_kv
    (load,) = meta(out).loads
    (allocated,) = s.kv_cache_manager.get_block_ids("r2s")
    assert load.block_ids == allocated[:6]
    # a failed synchronous load: vLLM recomputes from the first bad block
    s.add_request(request("r2t", PROMPT, 3))
    out, _ = step(s, {"r2s": 9, "r2t": 9})
    (load,) = meta(out).loads
    step(s, {"r2s": 9}, kv=KVConnectorOutput(invalid_block_ids={load.block_ids[1]}))
    out, _ = step(s, {"r2s": 9, "r2t": 9})
    # prompt + the token sampled in the load step, from block 1 on
    assert out.num_scheduled_tokens["r2t"] == 101 - BS


def test_only_leading_blocks_held_for_every_layer_count(tiny_model: Path, store) -> None:
    keys, layers = block_keys(
        StoreConnectorConfig(master=store[0]), vllm_config(tiny_model, "kv_both", {}, True), KCC
    )
    hole = keys.keys([prompt_block_hashes(PROMPT, BS)[3]], layers)[1]  # block 3, layer 1
    store_blocks(tiny_model, store[0], PROMPT, [0, 1, 2, 3, 5], skip={hole})
    s = connected(make_scheduler(tiny_model, store[0]))
    s.add_request(request("r3", PROMPT, 2))
    out, _ = step(s)
    (load,) = meta(out).loads
    assert len(load.block_ids) == 3  # blocks 0-2; block 3 lacks a layer, block 5 follows a gap


def test_local_prefix_hit_loads_only_the_rest(tiny_model: Path, store) -> None:
    s = connected(make_scheduler(tiny_model, store[0], role="kv_consumer"))
    s.add_request(request("warm", PROMPT[:64], 1))
    step(s, {"warm": 3})  # 4 full blocks now in vLLM's prefix cache
    store_blocks(tiny_model, store[0], PROMPT, list(range(6)))
    s.add_request(request("r4", PROMPT, 2))
    out, _ = step(s)
    (load,) = meta(out).loads
    (allocated,) = s.kv_cache_manager.get_block_ids("r4")
    assert load.block_ids == allocated[4:6]
    assert load.hashes == prompt_block_hashes(PROMPT, BS)[4:6]
    step(s, kv=KVConnectorOutput(finished_recving={"r4"}))
    out, _ = step(s, {"r4": 9})
    assert out.num_scheduled_tokens == {"r4": 4}
    assert meta(out).saves == []  # kv_consumer: never saves


def test_load_errors_recompute_from_the_first_bad_block(tiny_model: Path, store) -> None:
    store_blocks(tiny_model, store[0], PROMPT, list(range(6)))
    s = connected(make_scheduler(tiny_model, store[0], caching=False))
    s.add_request(request("r5", PROMPT, 3))
    out, _ = step(s)
    (load,) = meta(out).loads
    bad = load.block_ids[2]
    step(s, kv=KVConnectorOutput(finished_recving={"r5"}, invalid_block_ids={bad}))
    out, _ = step(s, {"r5": 9})
    assert out.num_scheduled_tokens == {"r5": 100 - 2 * BS}


def test_producer_never_looks_up(tiny_model: Path, store) -> None:
    store_blocks(tiny_model, store[0], PROMPT, list(range(6)))
    s = connected(make_scheduler(tiny_model, store[0], role="kv_producer"))
    s.add_request(request("r6", PROMPT, 1))
    out, _ = step(s, {"r6": 1})
    assert out.num_scheduled_tokens == {"r6": 100}


def test_no_store_no_hits_no_saves_no_waiting(tiny_model: Path) -> None:
    s = make_scheduler(tiny_model, f"127.0.0.1:{free_port()}", cooldown=0.5)
    idle = free_blocks(s)
    t0 = time.monotonic()
    s.add_request(request("r7", PROMPT, 1))
    out, finished = step(s, {"r7": 1})
    assert out.num_scheduled_tokens == {"r7": 100} and "r7" in finished
    assert free_blocks(s) == idle  # not held: nothing to save to
    assert time.monotonic() - t0 < 2
    s.connector.shutdown()


# -- worker side: real KV-shaped tensors, real store ---------------------------------------


def kv_tensors(fill: int | None = None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(fill or 0)
    out = {}
    for name in LAYERS:
        t = torch.randn(NUM_BLOCKS, HEADS, BS, 2 * HEAD, generator=g).to(torch.bfloat16)
        out[name] = t if fill is not None else torch.zeros_like(t)
    return out


def make_worker(model: Path, master: str, **extra: Any) -> StoreWorker:
    config = StoreConnectorConfig(master=master, **({"timeout": 3.0, "load_async": True} | extra))
    keys, layers = block_keys(config, vllm_config(model, "kv_both", {}, True), KCC)
    return StoreWorker(config, keys, layers, NUM_BLOCKS, HEADS)


_FINISHED: dict[int, tuple[set[str], set[str]]] = {}


def done(w: StoreWorker, which: int, rid: str) -> bool:
    """Has ``w`` reported ``rid`` saved (which=0) or loaded (which=1)? Keeps what it saw."""
    seen = _FINISHED.setdefault(id(w), (set(), set()))
    for got, into in zip(w.get_finished(), seen, strict=True):
        into.update(got or ())
    return rid in seen[which]


def test_worker_saves_then_another_worker_loads_the_same_bytes(tiny_model: Path, store) -> None:
    hashes = prompt_block_hashes(PROMPT, BS)
    src, dst = kv_tensors(fill=1), kv_tensors()
    a, b = make_worker(tiny_model, store[0]), make_worker(tiny_model, store[0])
    try:
        a.register_kv_caches(src, 0)
        b.register_kv_caches(dst, 0)
        assert a.store is not None and b.store is not None
        assert a.store.wait_connected(10) and b.store.wait_connected(10)
        a.start_load_kv(StoreConnectorMetadata(saves=[BlockSpec("s", [10, 3, 7], hashes[:3])]))
        wait_until(lambda: done(a, 0, "s"), 10, "the save")
        b.start_load_kv(StoreConnectorMetadata(loads=[BlockSpec("l", [1, 2, 40], hashes[:3])]))
        wait_until(lambda: done(b, 1, "l"), 10, "the load")
        assert b.take_load_errors() == set()
        for name in LAYERS:
            for s_blk, d_blk in ((10, 1), (3, 2), (7, 40)):
                assert torch.equal(src[name][s_blk], dst[name][d_blk])
        # saving the same blocks again writes nothing
        a.start_load_kv(StoreConnectorMetadata(saves=[BlockSpec("s2", [10, 3], hashes[:2])]))
        wait_until(lambda: done(a, 0, "s2"), 10, "the second save")
        stats = a.stats.take()
        assert stats is not None and stats.reduce()["Blocks already stored"] == 2
        # a load of blocks the store lacks fails from the first missing block on
        b.start_load_kv(StoreConnectorMetadata(loads=[BlockSpec("m", [5, 6, 8, 9], hashes[1:5])]))
        wait_until(lambda: done(b, 1, "m"), 10, "the partial load")
        assert b.take_load_errors() == {8, 9}
        # a synchronous load is done when start_load_kv returns, and not reported as finished
        sync = make_worker(tiny_model, store[0], load_async=False)
        try:
            dst2 = kv_tensors()
            sync.register_kv_caches(dst2, 0)
            assert sync.store is not None and sync.store.wait_connected(10)
            sync.start_load_kv(StoreConnectorMetadata(loads=[BlockSpec("y", [9], hashes[:1])]))
            assert sync.take_load_errors() == set() and sync.get_finished() == (None, None)
            assert all(torch.equal(src[n][10], dst2[n][9]) for n in LAYERS)
        finally:
            sync.shutdown()
        # the store server dies: the load fails by its deadline, every block reported
        store[1].close()
        t0 = time.monotonic()
        b.start_load_kv(StoreConnectorMetadata(loads=[BlockSpec("k", [11, 12], hashes[:2])]))
        wait_until(lambda: done(b, 1, "k"), 15, "the load from a dead server")
        assert time.monotonic() - t0 < 3.0 + 2
        assert b.take_load_errors() == {11, 12}
    finally:
        a.shutdown()
        b.shutdown()


def test_worker_without_store_fails_loads_at_once(tiny_model: Path) -> None:
    w = make_worker(tiny_model, f"127.0.0.1:{free_port()}")
    try:
        w.register_kv_caches(kv_tensors(), 0)
        t0 = time.monotonic()
        w.start_load_kv(
            StoreConnectorMetadata(
                loads=[BlockSpec("x", [1, 2], ["00" * 16, "11" * 16])],
                saves=[BlockSpec("y", [1], ["00" * 16])],
            )
        )
        wait_until(lambda: done(w, 1, "x"), 5, "the load to fail")
        wait_until(lambda: done(w, 0, "y"), 5, "the save to be released")
        assert w.take_load_errors() == {1, 2}
        assert time.monotonic() - t0 < 1.0
    finally:
        w.shutdown()


def test_failed_load_is_not_retried_for_the_same_request(tiny_model: Path, store) -> None:
    # The store still lists the blocks (as it does for a while after a server died): after a
    # failed load the request is computed, not sent back to the store again and again.
    store_blocks(tiny_model, store[0], PROMPT, list(range(6)))
    s = connected(make_scheduler(tiny_model, store[0], caching=False))
    s.add_request(request("r8", PROMPT, 3))
    out, _ = step(s)
    (load,) = meta(out).loads
    step(s, kv=KVConnectorOutput(finished_recving={"r8"}, invalid_block_ids=set(load.block_ids)))
    out, _ = step(s, {"r8": 9})
    assert out.num_scheduled_tokens == {"r8": 100}
    assert meta(out).loads == []


def test_the_store_is_a_cache_not_a_kv_hand_off(tiny_model: Path) -> None:
    """vLLM's requires_kv_delivery: false for the store (a dropped save is a later miss), so a
    preempted request's in-flight output is delivered, not recomputed."""
    s = make_scheduler(tiny_model, "127.0.0.1:1")
    try:
        assert s.connector.requires_kv_delivery is False and s.requires_kv_delivery is False
    finally:
        s.connector.shutdown()
