"""KV events of MooncakeConnectorsStore: the blocks a save put in the store reach vLLM's event
publisher as ``BlockStored`` (issue 25), engine-free.

vLLM's own Scheduler and a worker-role connector over a real store (in this process) and
KV-shaped tensors; the publisher is a recording subclass of vLLM's ``EventPublisher`` (the seam
where vLLM would send the batch to routers over ZMQ).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import free_port, wait_until
from store_cluster import in_process_store

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")

from test_pd_scheduler import BS, HASHER, step
from test_vllm_store_scheduler import (
    KCC,
    PROMPT,
    connected,
    kv_tensors,
    make_scheduler,
    meta,
    registered,  # noqa: F401  # fixture
    vllm_config,
)
from vllm import SamplingParams
from vllm.distributed.kv_events import MEDIUM_CPU, BlockStored, EventBatch, EventPublisher
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from mooncake_connectors.adapters.vllm.store_connector import MooncakeConnectorsStore
from mooncake_connectors.adapters.vllm.store_events import StoreEventLog
from mooncake_connectors.adapters.vllm.store_inputs import key_inputs
from mooncake_connectors.adapters.vllm.store_keys import prompt_block_hashes
from mooncake_connectors.adapters.vllm.store_scheduler import BlockSpec, StoreConnectorMetadata
from mooncake_connectors.store.server import StoreServer

pytestmark = pytest.mark.vllm


@pytest.fixture
def store() -> Iterator[tuple[str, StoreServer]]:
    with in_process_store(64 << 20) as store:
        yield store


class Recorder(EventPublisher):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__(0)
        self.batches: list[EventBatch] = []

    def publish(self, events: EventBatch) -> None:
        self.batches.append(events)

    def shutdown(self) -> None:
        return


def worker_connector(model: Path, master: str) -> MooncakeConnectorsStore:
    extra = {"master": master, "timeout": 3.0, "load_async": True}
    c = MooncakeConnectorsStore(
        vllm_config(model, "kv_both", extra, True), KVConnectorRole.WORKER, KCC
    )
    c.worker.register_kv_caches(kv_tensors(fill=1), 0)
    assert c.worker.store is not None and c.worker.store.wait_connected(10)
    return c


def saved(c: MooncakeConnectorsStore, rid: str) -> bool:
    sending, _ = c.worker.get_finished()
    return rid in (sending or ())


def test_a_save_publishes_block_stored_with_the_store_keys_hashes(tiny_model: Path, store) -> None:
    s = connected(make_scheduler(tiny_model, store[0]))
    s.kv_event_publisher = pub = Recorder()
    w = worker_connector(tiny_model, store[0])
    try:
        sp = SamplingParams(max_tokens=1)
        r = Request("e1", PROMPT, sp, None, cache_salt="tenant-a", block_hasher=HASHER)
        s.add_request(r)
        step(s, {"e1": 5})
        out, _ = step(s)
        (save,) = meta(out).saves
        w.worker.start_load_kv(StoreConnectorMetadata(saves=[save]))
        wait_until(lambda: saved(w, "e1"), 10, "the save")
        kv_events = w.get_kv_connector_kv_cache_events()
        assert w.get_kv_connector_kv_cache_events() is None  # taken once
        assert not any(b.events for b in pub.batches)  # nothing announced before the save
        step(s, kv=KVConnectorOutput(finished_sending={"e1"}, kv_cache_events=kv_events))
        stored = [e for b in pub.batches for e in b.events if isinstance(e, BlockStored)]
        (event,) = stored
        hashes = prompt_block_hashes(PROMPT, BS, key_inputs(r, BS))
        assert event.block_hashes == [bytes.fromhex(h) for h in hashes]
        assert event.medium == MEDIUM_CPU and event.block_size == BS
        assert event.token_ids == PROMPT[: 6 * BS] and event.parent_block_hash is None
        assert event.extra_keys is not None and event.extra_keys[0] == ("tenant-a",)
        # saved again (the objects are there already): announced again, the store holds them
        s.add_request(Request("e2", PROMPT, sp, None, cache_salt="tenant-a", block_hasher=HASHER))
        s.connector.scheduler.load = False
        step(s, {"e2": 5})
        out, _ = step(s)
        (save,) = meta(out).saves
        w.worker.start_load_kv(StoreConnectorMetadata(saves=[save]))
        wait_until(lambda: saved(w, "e2"), 10, "the second save")
        (again,) = w.worker.take_events()
        assert again == event
    finally:
        w.shutdown()
        s.connector.shutdown()


def test_a_failed_save_announces_nothing(tiny_model: Path) -> None:
    w = worker_connector_without_store(tiny_model)
    try:
        hashes = prompt_block_hashes(PROMPT, BS)
        spec = BlockSpec("f", [1, 2], hashes[:2], token_ids=PROMPT[: 2 * BS])
        w.worker.start_load_kv(StoreConnectorMetadata(saves=[spec]))
        wait_until(lambda: saved(w, "f"), 10, "the save to be released")
        assert w.get_kv_connector_kv_cache_events() is None
    finally:
        w.shutdown()


def worker_connector_without_store(model: Path) -> MooncakeConnectorsStore:
    extra = {"master": f"127.0.0.1:{free_port()}", "timeout": 1.0}
    c = MooncakeConnectorsStore(
        vllm_config(model, "kv_both", extra, True), KVConnectorRole.WORKER, KCC
    )
    c.worker.register_kv_caches(kv_tensors(), 0)
    return c


def test_a_block_is_announced_once_every_tp_rank_holds_it() -> None:
    log = StoreEventLog(tp_size=2)
    a = BlockStored(
        block_hashes=[b"\x01" * 16],
        parent_block_hash=None,
        token_ids=list(range(BS)),
        block_size=BS,
        lora_id=None,
        medium=MEDIUM_CPU,
        lora_name=None,
    )
    log.add([a])
    assert log.take() == []  # rank 1 has not saved it yet
    log.add([a])
    assert log.take() == [a] and log.take() == []
