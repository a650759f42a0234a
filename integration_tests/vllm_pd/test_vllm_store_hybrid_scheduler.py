"""MooncakeConnectorsStore with several KV cache groups, inside vLLM's real Scheduler.

vLLM's hybrid KV cache manager left on (``disable_hybrid_kv_cache_manager=False``, which vLLM
refuses for a connector without ``SupportsHMA``), a sliding-window group and a full-attention
group, a real store in this process, and KV-shaped tensors for the workers (one tensor shared by
both groups' layers, as vLLM lays them out): what is saved and loaded per group, and how many
tokens are a hit when the groups hold different blocks. ``save_during_prefill`` is off unless a
test says otherwise (the finish-time save); the step-save tests prefill in chunks of 40 tokens.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import wait_until
from store_cluster import in_process_store

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")

import torch
from test_pd_scheduler import BS, NUM_BLOCKS, free_blocks, request, step
from test_vllm_store_scheduler import LAYERS, PROMPT, connected, done, meta
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.structured_output import StructuredOutputManager

from mooncake_connectors.adapters.vllm import plugin
from mooncake_connectors.adapters.vllm.store_config import StoreConnectorConfig
from mooncake_connectors.adapters.vllm.store_connector import MooncakeConnectorsStore
from mooncake_connectors.adapters.vllm.store_keys import prompt_block_hashes
from mooncake_connectors.adapters.vllm.store_scheduler import (
    BlockSpec,
    StoreConnectorMetadata,
    block_keys,
    group_windows,
)
from mooncake_connectors.adapters.vllm.store_worker import _SAVE, StoreWorker
from mooncake_connectors.errors import ConfigError
from mooncake_connectors.store import ClientConfig, StoreClient

pytestmark = pytest.mark.vllm

HEADS, HEAD = 2, 64
WINDOW = 32  # tokens: a hit ending at block e needs blocks (16 e - 31) // 16 .. e - 1
SWA, FULL = 0, 1  # group indices
ATTN = {"block_size": BS, "num_kv_heads": HEADS, "head_size": HEAD, "dtype": torch.bfloat16}
HYBRID = KVCacheConfig(
    num_blocks=NUM_BLOCKS,
    kv_cache_tensors=[],
    kv_cache_groups=[
        KVCacheGroupSpec([LAYERS[0]], SlidingWindowSpec(sliding_window=WINDOW, **ATTN)),
        KVCacheGroupSpec([LAYERS[1]], FullAttentionSpec(**ATTN)),
    ],
)


@pytest.fixture(scope="module", autouse=True)
def registered() -> None:
    plugin.register()


@pytest.fixture
def store() -> Iterator[tuple[str, Any]]:
    with in_process_store(64 << 20) as store:
        yield store


def hybrid_config(model: Path, master: str, save_during_prefill: bool = False) -> VllmConfig:
    extra = {
        "master": master,
        "timeout": 3.0,
        "load_async": True,
        "lookup_async": False,
        "save_during_prefill": save_during_prefill,
    }
    vc = VllmConfig(
        model_config=ModelConfig(model=str(model), dtype="bfloat16", max_model_len=2048, seed=0),
        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=2048,
            max_num_seqs=8,
            max_model_len=2048,
            is_encoder_decoder=False,
            disable_hybrid_kv_cache_manager=False,  # vLLM refuses this without SupportsHMA
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="MooncakeConnectorsStore",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=extra,
        ),
    )
    vc.cache_config.num_gpu_blocks = NUM_BLOCKS
    return vc


def scheduler(model: Path, master: str, save_during_prefill: bool = False) -> Scheduler:
    vc = hybrid_config(model, master, save_during_prefill)
    s = Scheduler(vc, HYBRID, StructuredOutputManager(vc), block_size=BS, log_stats=False)
    assert isinstance(s.connector, MooncakeConnectorsStore)
    return connected(s)


def worker(model: Path, master: str, kv: torch.Tensor) -> StoreWorker:
    c = MooncakeConnectorsStore(hybrid_config(model, master), KVConnectorRole.WORKER, HYBRID)
    w = c.worker
    w.register_kv_caches({name: kv for name in LAYERS}, 0)  # both groups' layers share it
    assert w.store is not None and w.store.wait_connected(10)
    return w


def allocated(s: Scheduler, rid: str) -> list[list[int]]:
    """Each group's blocks of the request, 0 where vLLM holds its null block."""
    blocks = s.kv_cache_manager.get_blocks(rid).blocks
    return [[0 if b.is_null else b.block_id for b in g] for g in blocks]


def put_blocks(model: Path, master: str, group: int, blocks: list[int]) -> None:
    keys, layers = block_keys(
        StoreConnectorConfig(master=master), hybrid_config(model, master), HYBRID, group
    )
    hashes = prompt_block_hashes(PROMPT, BS)
    with StoreClient(ClientConfig(master=master)) as c:
        for b in blocks:
            for key in keys.keys([hashes[b]], layers):
                c.put(key, bytes(BS * HEADS * 2 * HEAD * 2))


def test_each_group_saves_what_it_holds_and_loads_what_vllm_allocates(
    tiny_model: Path, store
) -> None:
    hashes = prompt_block_hashes(PROMPT, BS)  # 6 blocks
    src = torch.randn(NUM_BLOCKS, HEADS, BS, 2 * HEAD).to(torch.bfloat16)
    dst = torch.zeros_like(src)
    wa, wb = worker(tiny_model, store[0], src), worker(tiny_model, store[0], dst)
    try:
        a = scheduler(tiny_model, store[0])
        a.add_request(request("r1", PROMPT, 3))
        step(a, {"r1": 5})
        held = allocated(a, "r1")
        step(a, {"r1": 6})  # the window moved on: the sliding-window group freed its first blocks
        step(a, {"r1": 7})
        (save,) = meta(step(a)[0]).saves
        assert save.hashes == hashes
        assert save.groups[FULL] == held[FULL][:6]
        sw = save.groups[SWA]
        assert sw[0] == 0 and sw[-1] == held[SWA][5]  # null blocks are not saved
        assert all(b in (0, h) for b, h in zip(sw, held[SWA], strict=False))
        wa.start_load_kv(StoreConnectorMetadata(saves=[save]))
        wait_until(lambda: done(wa, 0, "r1"), 10, "the save")
        step(a, kv=KVConnectorOutput(finished_sending={"r1"}))

        b = scheduler(tiny_model, store[0])  # fresh: nothing cached locally
        b.add_request(request("r2", PROMPT, 3))
        out, _ = step(b)
        (load,) = meta(out).loads
        got = allocated(b, "r2")
        assert load.error is None and load.hashes == hashes
        assert load.groups[FULL] == got[FULL][:6]
        # only the window's blocks are allocated for the sliding-window group, and loaded
        first = (6 * BS - WINDOW + 1) // BS
        assert load.groups[SWA] == [0] * first + got[SWA][first:6]
        assert all(load.groups[SWA][first:])
        wb.start_load_kv(StoreConnectorMetadata(loads=[load]))
        wait_until(lambda: done(wb, 1, "r2"), 10, "the load")
        assert wb.take_load_errors() == set()
        for g in (SWA, FULL):
            for s_blk, d_blk in zip(save.groups[g], load.groups[g], strict=True):
                if d_blk:
                    assert torch.equal(src[s_blk], dst[d_blk]), (g, s_blk, d_blk)
        step(b, kv=KVConnectorOutput(finished_recving={"r2"}))
        out, _ = step(b, {"r2": 9})
        assert out.num_scheduled_tokens == {"r2": 100 - 96}
    finally:
        wa.shutdown()
        wb.shutdown()


def test_a_hit_ends_where_every_group_can_serve_it(tiny_model: Path, store) -> None:
    # full attention holds all 6 blocks, the sliding-window layer only blocks 0..3: a hit of
    # 6 blocks needs its blocks 4-5, of 5 blocks 3-4, of 4 blocks 2-3 (held)
    put_blocks(tiny_model, store[0], FULL, list(range(6)))
    s = scheduler(tiny_model, store[0])
    r = request("h", PROMPT, 1)
    assert s.connector.get_num_new_matched_tokens(r, 0) == (0, False)  # no window blocks
    put_blocks(tiny_model, store[0], SWA, [0, 1, 2, 3])
    s3 = scheduler(tiny_model, store[0])
    s3.add_request(request("h", PROMPT, 1))
    (load,) = meta(step(s3)[0]).loads
    got = allocated(s3, "h")
    assert load.error is None and len(load.hashes) == 4  # 64 tokens, not 96
    assert load.groups[FULL] == got[FULL][:4]
    assert load.groups[SWA] == [0, 0, *got[SWA][2:4]] and all(got[SWA][2:4])


def test_groups_other_than_full_or_sliding_window_are_refused(tiny_model: Path) -> None:
    chunked = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                [LAYERS[0]], ChunkedLocalAttentionSpec(attention_chunk_size=32, **ATTN)
            ),
            KVCacheGroupSpec([LAYERS[1]], FullAttentionSpec(**ATTN)),
        ],
    )
    with pytest.raises(ConfigError, match=r"group 0.*ChunkedLocalAttentionSpec"):
        group_windows(hybrid_config(tiny_model, "127.0.0.1:1"), chunked)
    assert group_windows(hybrid_config(tiny_model, "127.0.0.1:1"), HYBRID) == [WINDOW, 0]


def test_worker_skips_null_blocks_and_fails_loads_from_the_first_missing_block(
    tiny_model: Path, store
) -> None:
    hashes = prompt_block_hashes(PROMPT, BS)[:3]
    src = torch.randn(NUM_BLOCKS, HEADS, BS, 2 * HEAD).to(torch.bfloat16)
    wa, wb = worker(tiny_model, store[0], src), worker(tiny_model, store[0], torch.zeros_like(src))
    try:
        # the sliding-window group holds no block 0 (null): nothing is saved for it there
        save = BlockSpec("s", [5, 6, 7, 8, 9], hashes, groups=[[0, 5, 6], [7, 8, 9]])
        wa.start_load_kv(StoreConnectorMetadata(saves=[save]))
        wait_until(lambda: done(wa, 0, "s"), 10, "the save")
        keys, layers = block_keys(
            StoreConnectorConfig(master=store[0]), hybrid_config(tiny_model, store[0]), HYBRID, SWA
        )
        with StoreClient(ClientConfig(master=store[0])) as c:
            assert c.batch_exists(keys.keys(hashes, layers)) == [False, True, True]
        # loading a block the group did not save fails from that block on, every group's
        wb.start_load_kv(
            StoreConnectorMetadata(
                loads=[BlockSpec("l", [], hashes, groups=[[11, 12, 13], [14, 15, 16]])]
            )
        )
        wait_until(lambda: done(wb, 1, "l"), 10, "the load")
        assert wb.take_load_errors() == {11, 12, 13, 14, 15, 16}
        ok = BlockSpec("m", [12, 13, 14, 15, 16], hashes, groups=[[0, 12, 13], [14, 15, 16]])
        wb.start_load_kv(StoreConnectorMetadata(loads=[ok]))
        wait_until(lambda: done(wb, 1, "m"), 10, "the second load")
        assert wb.take_load_errors() == set()
    finally:
        wa.shutdown()
        wb.shutdown()


def chunked(model: Path, master: str) -> Scheduler:
    s = scheduler(model, master, save_during_prefill=True)
    s.max_num_scheduled_tokens = 40  # vLLM's token budget per step: the prompt takes 3 steps
    return s


def test_step_saves_carry_every_group_so_a_shorter_prefix_hits(tiny_model: Path, store) -> None:
    hashes = prompt_block_hashes(PROMPT, BS)  # 6 full blocks
    src = torch.randn(NUM_BLOCKS, HEADS, BS, 2 * HEAD).to(torch.bfloat16)
    dst = torch.zeros_like(src)
    wa, wb = worker(tiny_model, store[0], src), worker(tiny_model, store[0], dst)
    try:
        a = chunked(tiny_model, store[0])
        idle = free_blocks(a)
        a.add_request(request("r1", PROMPT, 2))
        saved: dict[str, list[int]] = {}  # hash -> the block each group saved it from
        for want, blocks in ((40, [0, 1]), (40, [2, 3, 4]), (20, [5])):
            out, _ = step(a, {"r1": 5} if want == 20 else None, partial=True)
            assert out.num_scheduled_tokens == {"r1": want}
            (save,) = meta(out).saves
            held = allocated(a, "r1")
            assert save.step and save.hashes == [hashes[i] for i in blocks]
            assert save.groups[FULL] == [held[FULL][i] for i in blocks]
            # every block this step computed, the sliding-window group's too: vLLM holds them
            # until the next step, which frees those that left the window
            assert save.groups[SWA] == [held[SWA][i] for i in blocks] and all(save.groups[SWA])
            for i, h in enumerate(save.hashes):
                saved[h] = [save.groups[SWA][i], save.groups[FULL][i]]
            wa.start_load_kv(StoreConnectorMetadata(saves=[save]))  # the step's forward pass,
            wa.wait_for_save()  # then its saves are queued
        assert allocated(a, "r1")[SWA][:3] == [0, 0, 0]  # the window moved on at the last step
        out, finished = step(a, {"r1": 6})
        assert "r1" in finished and not meta(out).saves  # nothing left to write
        out, _ = step(a)
        (last,) = meta(out).saves
        assert not last.step and last.block_ids == [] and last.request_id == "r1"
        wa.start_load_kv(StoreConnectorMetadata(saves=[last]))
        wait_until(lambda: done(wa, 0, "r1"), 10, "the saves")
        assert free_blocks(a) < idle  # kept until the workers report the saves done
        step(a, kv=KVConnectorOutput(finished_sending={"r1"}))
        assert free_blocks(a) == idle

        # a prompt sharing 4 full blocks: a hit of 4 needs the window's blocks 2 and 3, which a
        # finish-time save would not have had (freed at the last step)
        other = PROMPT[:64] + list(range(300, 336))
        b = scheduler(tiny_model, store[0])
        b.add_request(request("r2", other, 3))
        (load,) = meta(step(b)[0]).loads
        got = allocated(b, "r2")
        assert load.error is None and load.hashes == hashes[:4]
        assert load.groups[SWA] == [0, 0, *got[SWA][2:4]] and load.groups[FULL] == got[FULL][:4]
        wb.start_load_kv(StoreConnectorMetadata(loads=[load]))
        wait_until(lambda: done(wb, 1, "r2"), 10, "the load")
        assert wb.take_load_errors() == set()
        for g in (SWA, FULL):
            for h, d_blk in zip(load.hashes, load.groups[g], strict=True):
                if d_blk:
                    assert torch.equal(src[saved[h][g]], dst[d_blk]), (g, h, d_blk)
    finally:
        wa.shutdown()
        wb.shutdown()


def test_the_next_step_waits_for_step_saves_of_several_groups(tiny_model: Path, store) -> None:
    hashes = prompt_block_hashes(PROMPT, BS)[:2]
    w = worker(tiny_model, store[0], torch.randn(NUM_BLOCKS, HEADS, BS, 2 * HEAD))
    gate = threading.Event()
    try:
        w._submit(_SAVE, gate.wait)  # the store thread busy: what is queued behind it waits
        save = BlockSpec("s", [3, 4, 5, 6], hashes, groups=[[3, 4], [5, 6]], step=True)
        w.start_load_kv(StoreConnectorMetadata(saves=[save]))
        w.wait_for_save()  # queued behind the gate
        # vLLM's model runner calls handle_preemptions first in every step, before it zeroes
        # fresh blocks or copies any (copy-on-write), then start_load_kv
        nxt = threading.Thread(target=w.handle_preemptions, args=(StoreConnectorMetadata(),))
        nxt.start()
        nxt.join(0.5)
        assert nxt.is_alive(), "the next step went on while a window block's save was queued"
        gate.set()
        nxt.join(10)
        assert not nxt.is_alive()
        keys: list[str] = []
        for g in (SWA, FULL):
            gkeys, layers = block_keys(
                StoreConnectorConfig(master=store[0]),
                hybrid_config(tiny_model, store[0]),
                HYBRID,
                g,
            )
            keys += gkeys.keys(hashes, layers)
        with StoreClient(ClientConfig(master=store[0])) as c:
            assert all(c.batch_exists(keys))  # written before the next step began
        # once waited for, that step's start_load_kv and the step after do not wait again,
        # though the store thread is busy
        again = threading.Event()
        w._submit(_SAVE, again.wait)

        def next_steps() -> None:
            w.start_load_kv(StoreConnectorMetadata())
            w.handle_preemptions(StoreConnectorMetadata())
            w.start_load_kv(StoreConnectorMetadata())

        nxt = threading.Thread(target=next_steps)
        nxt.start()
        nxt.join(10)
        done_at_once = not nxt.is_alive()
        again.set()
        assert done_at_once
    finally:
        gate.set()
        w.shutdown()
