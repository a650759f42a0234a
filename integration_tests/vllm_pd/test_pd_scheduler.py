"""Scheduler-side bookkeeping of MooncakeConnectorsPD inside vLLM's real Scheduler.

No model runs: the tests build vLLM's own VllmConfig, KVCacheConfig, Scheduler and Request
objects, play the worker's part with ModelRunnerOutput / KVConnectorOutput, and check what the
scheduler does with our answers: held and freed blocks, the transfer parameters, the blocks the
worker is told to fill, recompute after load errors. The worker side's transfer session is
engine-free and tested in tests/pd; here only its vLLM glue.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")

import torch
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from mooncake_connectors.adapters.vllm import plugin
from mooncake_connectors.adapters.vllm.config import PDConfig
from mooncake_connectors.adapters.vllm.connector import MooncakeConnectorsPD
from mooncake_connectors.adapters.vllm.metadata import PDConnectorMetadata, PDHandshake
from mooncake_connectors.adapters.vllm.worker import PDWorker
from mooncake_connectors.errors import ConfigError, PluginError
from mooncake_connectors.pd.params import prompt_hash
from mooncake_connectors.pd.plan import PushSendStep

pytestmark = pytest.mark.vllm

BS = 16
NUM_BLOCKS = 64
init_none_hash(sha256_cbor)
HASHER = get_request_block_hasher(BS, sha256_cbor)
BLOCK_BYTES = 2 * 2 * BS * 2 * 64 * 2  # 2 layers, K and V, 2 heads of 64, bf16: 16 KiB
ASYNC = {"sync_load_max_bytes": 0}  # every load asynchronous, whatever its size


@pytest.fixture(scope="module", autouse=True)
def registered() -> None:
    plugin.register()
    plugin.register()  # vLLM loads plugins in several places: a second call is harmless


def make_scheduler(
    model: Path, role: str, extra: dict[str, Any] | None = None, batch: int = 2048, **cfg: Any
) -> Scheduler:
    vc = VllmConfig(
        model_config=ModelConfig(model=str(model), dtype="bfloat16", max_model_len=2048, seed=0),
        cache_config=CacheConfig(block_size=BS),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=batch,
            enable_chunked_prefill=True,
            max_num_seqs=8,
            max_model_len=2048,
            is_encoder_decoder=False,
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="MooncakeConnectorsPD",
            kv_role=role,
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=extra or {},
            **cfg,
        ),
    )
    vc.cache_config.num_gpu_blocks = NUM_BLOCKS
    kcc = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"],
                FullAttentionSpec(
                    block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16
                ),
            )
        ],
    )
    s = Scheduler(vc, kcc, StructuredOutputManager(vc), block_size=BS, log_stats=False)
    assert isinstance(s.connector, MooncakeConnectorsPD)
    s.connector.set_xfer_handshake_metadata({0: PDHandshake(0, "tcp://127.0.0.1:7")})
    return s


def request(rid: str, prompt: list[int], max_tokens: int, params: Any = None) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, extra_args={"kv_transfer_params": params})
    return Request(rid, prompt, sp, None, block_hasher=HASHER)


def step(
    s: Scheduler,
    sampled: dict[str, int] | None = None,
    kv: KVConnectorOutput | None = None,
    partial: bool = False,
) -> tuple[SchedulerOutput, dict[str, Any]]:
    """One scheduler step; ``sampled`` gives the token each running request produces.
    ``partial``: every scheduled request is in the runner's output, those without a token too
    (a chunk of a prompt that is not complete samples nothing)."""
    out = s.schedule()
    sampled = sampled or {}
    ids = [r for r in out.num_scheduled_tokens if partial or sampled.get(r) is not None]
    mro = ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[sampled[r]] if r in sampled else [] for r in ids],
        kv_connector_output=kv,
    )
    finished = {}
    for eco in s.update_from_output(out, mro).values():
        for o in eco.outputs:
            if o.finish_reason is not None:
                finished[o.request_id] = o.kv_transfer_params
    return out, finished


def meta(out: SchedulerOutput) -> PDConnectorMetadata:
    assert isinstance(out.kv_connector_metadata, PDConnectorMetadata)
    return out.kv_connector_metadata


def free_blocks(s: Scheduler) -> int:
    return s.kv_cache_manager.block_pool.get_num_free_blocks()


PROMPT = list(range(100, 200))  # 100 tokens: 7 blocks of 16


def remote_params(prompt: list[int], blocks: list[int] | None = None, **over: Any) -> dict:
    p = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "prefill-engine",
        "remote_request_id": "p-1",
        "remote_block_ids": blocks or list(range(20, 27)),
        "remote_num_tokens": len(prompt),
        "remote_prompt_hash": prompt_hash(prompt),
        "remote_side_channels": ["tcp://127.0.0.1:7"],
        "remote_tp_size": 1,
        "remote_expires_at": 1e12,
    }
    p.update(over)
    return p


def test_plugin_guards_the_name(monkeypatch: pytest.MonkeyPatch) -> None:
    assert KVConnectorFactory.get_connector_class_by_name("MooncakeConnectorsPD") is (
        MooncakeConnectorsPD
    )
    monkeypatch.setattr(
        KVConnectorFactory, "_registry", {"MooncakeConnectorsPD": lambda: Scheduler}
    )
    with pytest.raises(PluginError, match="already taken"):
        plugin.register()


def test_unknown_extra_config_key_is_a_clear_error(tiny_model: Path) -> None:
    with pytest.raises(ConfigError, match=r"transfer_timout.*allowed: .*transfer_timeout"):
        make_scheduler(tiny_model, "kv_producer", {"transfer_timout": 5})


def test_prefill_holds_blocks_until_decode_is_done(tiny_model: Path) -> None:
    s = make_scheduler(tiny_model, "kv_producer", {"kv_lease": 60})
    idle = free_blocks(s)
    s.add_request(request("p-1", PROMPT, 1, {"do_remote_decode": True}))
    _, finished = step(s, {"p-1": 5})
    params = finished["p-1"]
    assert params["do_remote_prefill"] is True
    assert params["remote_request_id"] == "p-1"
    assert params["remote_num_tokens"] == 100
    assert len(params["remote_block_ids"]) == 7
    assert params["remote_prompt_hash"] == prompt_hash(PROMPT)
    assert params["remote_side_channels"] == ["tcp://127.0.0.1:7"]
    assert free_blocks(s) == idle - 7  # held for the decode side
    out, _ = step(s)
    assert meta(out).send == {"p-1": 60.0}  # the worker starts the lease
    step(s, kv=KVConnectorOutput(finished_sending={"p-1"}))
    assert free_blocks(s) == idle


def test_prefill_without_decode_flag_or_aborted_hands_nothing_over(tiny_model: Path) -> None:
    s = make_scheduler(tiny_model, "kv_producer")
    idle = free_blocks(s)
    s.add_request(request("plain", PROMPT, 1))
    _, finished = step(s, {"plain": 5})
    assert finished == {"plain": None}
    s.add_request(request("gone", PROMPT, 4, {"do_remote_decode": True}))
    step(s, {"gone": 5})
    s.finish_requests("gone", RequestStatus.FINISHED_ABORTED)
    out, _ = step(s)
    assert meta(out).send == {}
    assert free_blocks(s) == idle


def test_decode_loads_prompt_then_computes_only_the_last_token(tiny_model: Path) -> None:
    s = make_scheduler(tiny_model, "kv_consumer", ASYNC)
    r = request("d-1", PROMPT, 3, remote_params(PROMPT))
    s.add_request(r)
    out, _ = step(s)
    assert out.num_scheduled_tokens == {}  # nothing computed while the KV is on its way
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (spec,) = meta(out).recv
    (allocated,) = s.kv_cache_manager.get_block_ids("d-1")
    assert spec.local_block_ids == allocated[:7]
    assert spec.remote_block_ids == list(range(20, 27))
    assert spec.remote.request_id == "p-1" and spec.error is None
    step(s, kv=KVConnectorOutput(finished_recving={"d-1"}))
    out, _ = step(s, {"d-1": 9})
    assert out.num_scheduled_tokens == {"d-1": 1}  # the prompt's KV came from the prefill
    assert r.num_computed_tokens == 100 and r.num_output_tokens == 1


def test_decode_load_errors_recompute_from_the_first_bad_block(tiny_model: Path) -> None:
    s = make_scheduler(tiny_model, "kv_consumer", ASYNC)
    r = request("d-2", PROMPT, 3, remote_params(PROMPT))
    s.add_request(r)
    out, _ = step(s)
    (spec,) = meta(out).recv
    bad = spec.local_block_ids[2]
    step(s, kv=KVConnectorOutput(finished_recving={"d-2"}, invalid_block_ids={bad}))
    out, _ = step(s, {"d-2": 9})
    assert out.num_scheduled_tokens == {"d-2": 100 - 2 * BS}  # blocks 0-1 kept, rest recomputed


def test_decode_refuses_kv_of_other_tokens_and_releases_it(tiny_model: Path) -> None:
    s = make_scheduler(tiny_model, "kv_consumer")
    params = remote_params(PROMPT, remote_prompt_hash=prompt_hash(list(range(100))))
    s.add_request(request("d-3", PROMPT, 2, params))
    out, _ = step(s, {"d-3": 1})
    assert out.num_scheduled_tokens == {"d-3": 100}  # computed locally
    (spec,) = meta(out).recv
    assert spec.local_block_ids == [] and spec.remote.request_id == "p-1"  # release only


def test_decode_aborted_before_scheduling_releases_the_prefill(tiny_model: Path) -> None:
    s = make_scheduler(tiny_model, "kv_consumer")
    s.add_request(request("d-4", PROMPT, 2, remote_params(PROMPT)))
    s.finish_requests("d-4", RequestStatus.FINISHED_ABORTED)
    out, _ = step(s)
    (spec,) = meta(out).recv
    assert spec.local_block_ids == [] and spec.remote.request_id == "p-1"


def test_decode_with_a_local_prefix_hit_loads_only_the_rest(tiny_model: Path) -> None:
    s = make_scheduler(tiny_model, "kv_consumer", ASYNC)
    s.add_request(request("warm", PROMPT[:64], 1))
    step(s, {"warm": 3})  # 4 full blocks now in the local prefix cache
    r = request("d-5", PROMPT, 2, remote_params(PROMPT))
    s.add_request(r)
    out, _ = step(s)
    (spec,) = meta(out).recv
    (allocated,) = s.kv_cache_manager.get_block_ids("d-5")
    assert spec.local_block_ids == allocated[4:7]
    assert spec.remote_block_ids == [24, 25, 26]
    step(s, kv=KVConnectorOutput(finished_recving={"d-5"}))
    out, _ = step(s, {"d-5": 9})
    assert out.num_scheduled_tokens == {"d-5": 1}


def test_decode_small_handover_is_loaded_in_the_step_that_schedules_it(tiny_model: Path) -> None:
    s = make_scheduler(tiny_model, "kv_consumer")  # default: up to 16 MiB inline
    r = request("d-6", PROMPT, 3, remote_params(PROMPT))
    s.add_request(r)
    out, _ = step(s, {"d-6": 9})
    assert out.num_scheduled_tokens == {"d-6": 1}  # no step waiting for the KV: the last token
    (spec,) = meta(out).recv
    (allocated,) = s.kv_cache_manager.get_block_ids("d-6")
    assert spec.sync and spec.local_block_ids == allocated[:7]
    assert spec.remote_block_ids == list(range(20, 27))
    assert r.num_computed_tokens == 100 and r.num_output_tokens == 1
    out, _ = step(s, {"d-6": 10})
    assert out.num_scheduled_tokens == {"d-6": 1} and r.num_output_tokens == 2


def test_decode_inline_load_errors_recompute_from_the_first_bad_block(tiny_model: Path) -> None:
    s = make_scheduler(tiny_model, "kv_consumer")
    r = request("d-7", PROMPT, 3, remote_params(PROMPT))
    s.add_request(r)
    out = s.schedule()
    (spec,) = meta(out).recv
    assert spec.sync
    bad = spec.local_block_ids[2]
    # the worker's step: the load failed for one block, so the step's token is not kept
    mro = ModelRunnerOutput(
        req_ids=["d-7"],
        req_id_to_index={"d-7": 0},
        sampled_token_ids=[[9]],
        kv_connector_output=KVConnectorOutput(invalid_block_ids={bad}),
    )
    s.update_from_output(out, mro)
    assert r.num_output_tokens == 0
    out, _ = step(s, {"d-7": 9})
    assert out.num_scheduled_tokens == {"d-7": 100 - 2 * BS}  # blocks 0-1 kept, rest recomputed


def test_decode_handover_over_the_inline_limit_loads_asynchronously(tiny_model: Path) -> None:
    s = make_scheduler(tiny_model, "kv_consumer", {"sync_load_max_bytes": 7 * BLOCK_BYTES - 1})
    r = request("d-8", PROMPT, 3, remote_params(PROMPT))  # 7 blocks to read
    s.add_request(r)
    out, _ = step(s)
    assert out.num_scheduled_tokens == {} and r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (spec,) = meta(out).recv
    assert not spec.sync
    s2 = make_scheduler(tiny_model, "kv_consumer", {"sync_load_max_bytes": 7 * BLOCK_BYTES})
    s2.add_request(request("d-9", PROMPT, 3, remote_params(PROMPT)))
    out, _ = step(s2, {"d-9": 9})
    assert out.num_scheduled_tokens == {"d-9": 1} and meta(out).recv[0].sync


# -- the worker glue (the session itself is tested engine-free in tests/pd) --------------------


def test_worker_takes_block_size_tp_and_rank_from_vllm(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # vLLM's tensor-parallel group is not set up without a model runner: rank 0.
    import vllm.distributed.parallel_state as ps

    monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda: 0)
    s = make_scheduler(tiny_model, "kv_both")
    w = PDWorker(PDConfig.from_extra_config({}), s.vllm_config, "eng", NUM_BLOCKS, 2)
    try:
        assert (w.block_size, w.tp_size) == (BS, 1) and w.handshake() is None
        shape = (NUM_BLOCKS, 2, BS, 2 * 64)  # vLLM's CPU layout, 2 KV heads of 64
        w.register_kv_caches({"model.layers.0.self_attn.attn": torch.zeros(shape)})
        assert w.layout is not None and w.layout.block_size == BS
        assert w.handshake() == PDHandshake(0, w.layout.side_channel)
        assert w.stats.take() is None  # vLLM's stats type, nothing recorded yet
    finally:
        w.shutdown()


# -- layer-wise push: the scheduler side -----------------------------------------------------


def push_params(push_id: str = "push-1", **over: Any) -> dict[str, Any]:
    p = {
        "do_remote_prefill": True,
        "push_id": push_id,
        "remote_engine_id": "prefill-engine",
        "remote_side_channels": ["tcp://127.0.0.1:7"],
        "remote_tp_size": 1,
    }
    p.update(over)
    return p


def test_prefill_tells_its_worker_which_blocks_each_chunk_completes(tiny_model: Path) -> None:
    s = make_scheduler(tiny_model, "kv_producer", {"kv_lease": 60}, batch=48)
    idle = free_blocks(s)
    s.add_request(request("p-1", PROMPT, 1, {"do_remote_decode": True, "push_id": "x"}))
    steps: list[PushSendStep] = []
    finished: dict[str, Any] = {}
    for i in range(3):  # 48 + 48 + 4 tokens; a token is sampled once the prompt is done
        out, finished = step(s, {"p-1": 5} if i == 2 else None, partial=True)
        steps += meta(out).push_send
    assert [(st.ready, st.final) for st in steps] == [(3, False), (6, False), (7, True)]
    (allocated,) = s.kv_cache_manager.get_block_ids("p-1")
    assert steps[-1].block_ids == list(allocated[:7]) and steps[-1].push_id == "x"
    assert steps[-1].num_tokens == 100 and steps[-1].prompt_hash == prompt_hash(PROMPT)
    assert finished["p-1"]["do_remote_prefill"] is True  # the pull parameters too, as always
    assert free_blocks(s) == idle - 7  # held until the worker says the push ended
    step(s)
    step(s, kv=KVConnectorOutput(finished_sending={"p-1"}))
    assert free_blocks(s) == idle


def test_prefill_aborted_mid_prompt_ends_its_push(tiny_model: Path) -> None:
    s = make_scheduler(tiny_model, "kv_producer", batch=48)
    s.add_request(request("p-2", PROMPT, 1, {"do_remote_decode": True, "push_id": "y"}))
    out, _ = step(s, partial=True)
    assert [st.ready for st in meta(out).push_send] == [3]
    s.finish_requests("p-2", RequestStatus.FINISHED_ABORTED)
    out, _ = step(s)
    (st,) = meta(out).push_send
    assert st.push_id == "y" and st.aborted and st.final


def test_decode_waits_for_a_push_into_the_blocks_it_allocated(tiny_model: Path) -> None:
    s = make_scheduler(tiny_model, "kv_consumer", {"accept_push": True})
    r = request("d-1", PROMPT, 3, push_params())
    s.add_request(r)
    out, _ = step(s)
    assert out.num_scheduled_tokens == {} and r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (spec,) = meta(out).push_recv
    (allocated,) = s.kv_cache_manager.get_block_ids("d-1")
    assert spec.local_block_ids == allocated[:7] and spec.first_block == 0
    assert spec.num_tokens == 100 and spec.prompt_hash == prompt_hash(PROMPT)
    assert spec.remote.push_id == "push-1" and spec.error is None
    step(s, kv=KVConnectorOutput(finished_recving={"d-1"}))
    out, _ = step(s, {"d-1": 9})
    assert out.num_scheduled_tokens == {"d-1": 1}


def test_decode_computes_the_prompt_when_it_cannot_take_a_push(tiny_model: Path) -> None:
    closed = make_scheduler(tiny_model, "kv_consumer")  # accept_push not set
    closed.add_request(request("d-2", PROMPT, 2, push_params()))
    out, _ = step(closed, {"d-2": 1})
    assert out.num_scheduled_tokens == {"d-2": 100}
    (spec,) = meta(out).push_recv
    assert spec.local_block_ids == []  # the prefill is told it may free its blocks
    other_tp = make_scheduler(tiny_model, "kv_consumer", {"accept_push": True})
    params = push_params(remote_tp_size=2, remote_side_channels=["tcp://a:1", "tcp://a:2"])
    other_tp.add_request(request("d-3", PROMPT, 2, params))
    out, _ = step(other_tp, {"d-3": 1})
    assert out.num_scheduled_tokens == {"d-3": 100}


def test_malformed_transfer_params_are_ignored_and_the_prompt_computed(tiny_model: Path) -> None:
    s = make_scheduler(tiny_model, "kv_consumer", {"accept_push": True})
    bad_pull = remote_params(PROMPT, remote_tp_size="one")
    bad_push = push_params(remote_side_channels=[])
    s.add_request(request("d-1", PROMPT, 2, bad_pull))
    s.add_request(request("d-2", PROMPT[::-1], 2, bad_push))  # no prefix shared with d-1
    out, _ = step(s, {"d-1": 1, "d-2": 1})
    assert out.num_scheduled_tokens == {"d-1": 100, "d-2": 100}
    assert meta(out).recv == [] and meta(out).push_recv == []
