"""Scheduler-side bookkeeping of MooncakeConnectorsPD inside vLLM's real Scheduler.

No model runs: the tests build vLLM's own VllmConfig, KVCacheConfig, Scheduler and Request
objects, play the worker's part with ModelRunnerOutput / KVConnectorOutput, and check what the
scheduler does with our answers: held and freed blocks, the transfer parameters, the blocks the
worker is told to fill, recompute after load errors. The last tests drive the worker side's
bookkeeping (Done, leases, failed loads) with a real side-channel socket.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import zmq
from helpers import wait_until

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
from mooncake_connectors.adapters.vllm.metadata import (
    PDConnectorMetadata,
    PDHandshake,
    RecvSpec,
    RemotePrefill,
    prompt_hash,
)
from mooncake_connectors.adapters.vllm.side_channel import Done, decode
from mooncake_connectors.adapters.vllm.worker import PDWorker
from mooncake_connectors.errors import ConfigError, PluginError

pytestmark = pytest.mark.vllm

BS = 16
NUM_BLOCKS = 64
init_none_hash(sha256_cbor)
HASHER = get_request_block_hasher(BS, sha256_cbor)


@pytest.fixture(scope="module", autouse=True)
def registered() -> None:
    plugin.register()
    plugin.register()  # vLLM loads plugins in several places: a second call is harmless


def make_scheduler(
    model: Path, role: str, extra: dict[str, Any] | None = None, **cfg: Any
) -> Scheduler:
    vc = VllmConfig(
        model_config=ModelConfig(model=str(model), dtype="bfloat16", max_model_len=2048, seed=0),
        cache_config=CacheConfig(block_size=BS),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=2048,
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
    s: Scheduler, sampled: dict[str, int] | None = None, kv: KVConnectorOutput | None = None
) -> tuple[SchedulerOutput, dict[str, Any]]:
    """One scheduler step; ``sampled`` gives the token each running request produces."""
    out = s.schedule()
    ids = [r for r in out.num_scheduled_tokens if (sampled or {}).get(r) is not None]
    mro = ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[(sampled or {})[r]] for r in ids],
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
    s = make_scheduler(tiny_model, "kv_consumer")
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
    s = make_scheduler(tiny_model, "kv_consumer")
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
    s = make_scheduler(tiny_model, "kv_consumer")
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


# -- worker-side bookkeeping (no KV registered: the lease and Done logic, failure reporting) --


def make_worker(model: Path, **extra: Any) -> PDWorker:
    s = make_scheduler(model, "kv_both", extra)
    return PDWorker(PDConfig.from_extra_config(extra), s.vllm_config, "eng", NUM_BLOCKS)


def test_worker_frees_prefill_blocks_on_done_from_every_reader_or_at_lease_end(
    tiny_model: Path,
) -> None:
    w = make_worker(tiny_model, kv_lease=30, transfer_timeout=1)
    try:
        w._on_done(Done("eng", ["early"], 0, 1))  # Done may beat the scheduler's metadata
        w._on_done(Done("other-engine", ["a"], 0, 1))  # not ours: ignored
        w.start_load_kv(PDConnectorMetadata(send={"a": 30.0, "early": 30.0, "b": 0.3}))
        assert w.get_finished() == ({"early"}, None)
        w._on_done(Done("eng", ["a"], 0, 2))  # the first of two decode ranks
        assert w.get_finished() == (None, None)
        w._on_done(Done("eng", ["a"], 0, 2))  # the same rank again does not count twice
        assert w.get_finished() == (None, None)
        w._on_done(Done("eng", ["a"], 1, 2))
        assert w.get_finished() == ({"a"}, None)
        wait_until(lambda: w.get_finished()[0] == {"b"}, 5, "the lease of b to end")
        assert w.stats.take() is not None  # the expired lease was counted
    finally:
        w.shutdown()


def test_worker_reports_blocks_of_an_unreachable_prefill_as_load_errors(tiny_model: Path) -> None:
    ctx = zmq.Context.instance()
    mute = ctx.socket(zmq.ROUTER)  # a side channel that never answers
    mute.setsockopt(zmq.LINGER, 0)
    port = mute.bind_to_random_port("tcp://127.0.0.1")
    w = make_worker(tiny_model, handshake_timeout=0.5, transfer_timeout=2)
    try:
        remote = RemotePrefill.parse(
            remote_params(PROMPT, remote_side_channels=[f"tcp://127.0.0.1:{port}"])
        )
        assert remote is not None
        w.start_load_kv(PDConnectorMetadata(recv=[RecvSpec("d-9", [4, 5, 6], [1, 2, 3], remote)]))
        t0 = time.monotonic()
        wait_until(lambda: "d-9" in (w._recv_done or ()), 10, "the failed load to finish")
        assert time.monotonic() - t0 < 5
        assert w.get_finished() == (None, {"d-9"})
        assert w.take_load_errors() == {4, 5, 6}
        assert w.take_load_errors() == set()
        # a load queued right behind it fails at once rather than waiting out its own deadline
        w.start_load_kv(PDConnectorMetadata(recv=[RecvSpec("d-10", [7], [1], remote)]))
        t0 = time.monotonic()
        wait_until(lambda: "d-10" in (w._recv_done or ()), 5, "the second load to fail")
        assert time.monotonic() - t0 < 0.4
        assert w.get_finished() == (None, {"d-10"}) and w.take_load_errors() == {7}
        # and the prefill was told (after the unanswered layout request), so it frees its
        # blocks before the lease ends
        got = []
        while mute.poll(2000):
            _identity, payload = mute.recv_multipart()
            got.append(decode(payload))
            if isinstance(got[-1], Done):
                break
        assert got[-1] == Done("prefill-engine", ["p-1"], 0, 1), got
    finally:
        w.shutdown()
        mute.close()
