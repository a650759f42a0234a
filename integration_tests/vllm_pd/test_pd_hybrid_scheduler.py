"""MooncakeConnectorsPD with several KV cache groups, inside vLLM's real Scheduler.

vLLM's hybrid KV cache manager left on (``disable_hybrid_kv_cache_manager=False``, which vLLM
refuses for a connector without ``SupportsHMA``), a sliding-window group and a full-attention
group: the block ids per group the prefill hands over (null blocks where the window already
freed them), and the blocks vLLM allocates on the decode side, block by block against them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")

from test_pd_scheduler import (
    ASYNC,
    BS,
    NUM_BLOCKS,
    PROMPT,
    free_blocks,
    make_scheduler,
    meta,
    step,
)
from test_pd_scheduler import request as make_request
from test_vllm_store_hybrid_scheduler import ATTN, FULL, HYBRID, SWA, WINDOW, allocated
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from mooncake_connectors.adapters.vllm import plugin
from mooncake_connectors.adapters.vllm.connector import MooncakeConnectorsPD
from mooncake_connectors.adapters.vllm.metadata import PDHandshake
from mooncake_connectors.errors import ConfigError
from mooncake_connectors.pd.params import prompt_hash

pytestmark = pytest.mark.vllm

CHUNK = 32  # tokens per step on the prefill: the window moves on while the prompt is computed


@pytest.fixture(scope="module", autouse=True)
def registered() -> None:
    plugin.register()


def hybrid_scheduler(
    model: Path, role: str, kcc: KVCacheConfig = HYBRID, batch: int = 2048, inline: bool = False
) -> Scheduler:
    """``inline``: the decode reads small hand-overs in the scheduling step (the default);
    these tests otherwise follow an asynchronous load step by step."""
    vc = VllmConfig(
        model_config=ModelConfig(model=str(model), dtype="bfloat16", max_model_len=2048, seed=0),
        cache_config=CacheConfig(block_size=BS),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=batch,
            enable_chunked_prefill=True,
            max_num_seqs=8,
            max_model_len=2048,
            is_encoder_decoder=False,
            disable_hybrid_kv_cache_manager=False,  # vLLM refuses this without SupportsHMA
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="MooncakeConnectorsPD",
            kv_role=role,
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"kv_lease": 60} | ({} if inline else ASYNC),
        ),
    )
    vc.cache_config.num_gpu_blocks = NUM_BLOCKS
    s = Scheduler(vc, kcc, StructuredOutputManager(vc), block_size=BS, log_stats=False)
    assert isinstance(s.connector, MooncakeConnectorsPD)
    s.connector.set_xfer_handshake_metadata({0: PDHandshake(0, "tcp://127.0.0.1:7")})
    return s


def prefill_params(model: Path) -> tuple[dict[str, Any], list[list[int]]]:
    """Run PROMPT (100 tokens, 7 blocks) through a hybrid prefill in chunks of CHUNK tokens:
    its answer, and each group's blocks before its last chunk."""
    s = hybrid_scheduler(model, "kv_producer", batch=CHUNK)
    idle = free_blocks(s)
    s.add_request(make_request("p-1", PROMPT, 1, {"do_remote_decode": True}))
    for _ in range(3):
        step(s, partial=True)  # 96 tokens computed, nothing sampled yet
    before = allocated(s, "p-1")
    _, finished = step(s, {"p-1": 5})
    params = finished["p-1"]
    held = idle - free_blocks(s)
    out, _ = step(s)
    assert meta(out).send == {"p-1": 60.0}
    step(s, kv=KVConnectorOutput(finished_sending={"p-1"}))
    assert free_blocks(s) == idle  # every group's held blocks freed on the decode's Done
    assert held == sum(1 for g in params["remote_group_block_ids"] for b in g if b)
    return params, before


def test_prefill_hands_over_each_groups_blocks_with_nulls_where_the_window_freed_them(
    tiny_model: Path,
) -> None:
    params, before = prefill_params(tiny_model)
    assert "remote_block_ids" not in params  # an old decode refuses instead of misreading
    swa, full = params["remote_group_block_ids"]
    assert len(full) == len(swa) == 7
    assert full[:6] == before[FULL] and 0 not in full  # the 7th came with the last chunk
    # Before the last chunk 96 tokens were computed: the window (32) needs tokens 65.. only,
    # so blocks 0-3 of the sliding-window group are vLLM's null block.
    skipped = (96 - WINDOW + 1) // BS
    assert skipped == 4
    assert swa[:skipped] == [0] * skipped
    assert swa[skipped:6] == before[SWA][skipped:6] and 0 not in swa[skipped:]
    assert params["remote_num_tokens"] == 100
    assert params["remote_prompt_hash"] == prompt_hash(PROMPT)


def test_decode_allocates_nulls_exactly_where_the_prefill_freed_and_reads_the_rest(
    tiny_model: Path,
) -> None:
    params, _ = prefill_params(tiny_model)
    s = hybrid_scheduler(tiny_model, "kv_consumer")
    r = make_request("d-1", PROMPT, 3, params)
    s.add_request(r)
    out, _ = step(s)
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (spec,) = meta(out).recv
    assert spec.error is None and spec.groups is not None
    mine = allocated(s, "d-1")
    theirs = params["remote_group_block_ids"]
    # block by block: the decode's null blocks are the prefill's null blocks
    assert [b == 0 for b in mine[SWA][:7]] == [b == 0 for b in theirs[SWA]]
    assert spec.groups[SWA] == ([b for b in mine[SWA][:7] if b], [b for b in theirs[SWA] if b])
    assert spec.groups[FULL] == (mine[FULL][:7], theirs[FULL])
    assert sorted(spec.local_block_ids) == sorted(b for g in spec.groups for b in g[0])
    # the load arrives: the last prompt token is computed, then decoding goes on
    out, _ = step(s, kv=KVConnectorOutput(finished_recving={"d-1"}))
    out, _ = step(s, {"d-1": 7})
    assert out.num_scheduled_tokens == {"d-1": 1}


def test_an_inline_load_reads_every_groups_blocks_in_the_scheduling_step(tiny_model: Path) -> None:
    params, _ = prefill_params(tiny_model)
    s = hybrid_scheduler(tiny_model, "kv_consumer", inline=True)
    r = make_request("d-5", PROMPT, 3, params)
    s.add_request(r)
    out, _ = step(s, {"d-5": 7})
    assert out.num_scheduled_tokens == {"d-5": 1} and r.num_computed_tokens == 100
    (spec,) = meta(out).recv
    assert spec.sync and spec.error is None and spec.groups is not None
    mine, theirs = allocated(s, "d-5"), params["remote_group_block_ids"]
    assert [b == 0 for b in mine[SWA][:7]] == [b == 0 for b in theirs[SWA]]
    assert spec.groups[SWA] == ([b for b in mine[SWA][:7] if b], [b for b in theirs[SWA] if b])
    assert spec.groups[FULL] == (mine[FULL][:7], theirs[FULL])


def test_a_block_the_prefill_freed_but_the_decode_needs_is_recomputed(tiny_model: Path) -> None:
    params, _ = prefill_params(tiny_model)
    swa, full = params["remote_group_block_ids"]
    params["remote_group_block_ids"] = [[0, *swa[1:4], 0, *swa[5:]], full]  # block 4 freed
    s = hybrid_scheduler(tiny_model, "kv_consumer")
    s.add_request(make_request("d-2", PROMPT, 3, params))
    out, _ = step(s)
    (spec,) = meta(out).recv
    assert spec.groups is None and spec.error is not None and "group 0: block 4" in spec.error


def test_single_group_params_and_instances_do_not_mix_with_hybrid_ones(tiny_model: Path) -> None:
    params, _ = prefill_params(tiny_model)
    plain = make_scheduler(tiny_model, "kv_consumer")  # one group: hybrid manager off
    plain.add_request(make_request("d-3", PROMPT, 3, params))
    out, _ = step(plain, partial=True)
    assert out.num_scheduled_tokens == {"d-3": 100}  # computes the prompt itself
    old = dict(params)
    old["remote_block_ids"] = old.pop("remote_group_block_ids")[FULL]
    s = hybrid_scheduler(tiny_model, "kv_consumer")
    s.add_request(make_request("d-4", PROMPT, 3, old))
    out, _ = step(s, partial=True)
    assert out.num_scheduled_tokens == {"d-4": 100} and meta(out).recv == []


def test_a_push_with_several_groups_falls_back(tiny_model: Path) -> None:
    s = hybrid_scheduler(tiny_model, "kv_producer")
    s.add_request(make_request("p-2", PROMPT, 1, {"do_remote_decode": True, "push_id": "x"}))
    out, finished = step(s, {"p-2": 5})
    assert meta(out).push_send == []  # no push; the KV is handed over for a pull instead
    assert len(finished["p-2"]["remote_group_block_ids"]) == 2


def test_other_kinds_of_group_are_refused_at_start(tiny_model: Path) -> None:
    chunked = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["model.layers.0.self_attn.attn"],
                ChunkedLocalAttentionSpec(attention_chunk_size=64, **ATTN),
            ),
            KVCacheGroupSpec(["model.layers.1.self_attn.attn"], FullAttentionSpec(**ATTN)),
        ],
    )
    with pytest.raises(ConfigError, match=r"group 0.*ChunkedLocalAttentionSpec"):
        hybrid_scheduler(tiny_model, "kv_consumer", chunked)
