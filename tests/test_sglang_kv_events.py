"""SGLang's KV events, encoded by SGLang's own classes, feed the conductor's cache index.

Runs where SGLang is installed (the SGLang venv); the events are built with
``sglang.srt.disaggregation.kv_events`` and encoded as its ZMQ publisher encodes them.
"""

from __future__ import annotations

import pytest

kv = pytest.importorskip("sglang.srt.disaggregation.kv_events", reason="SGLang is not installed")

import msgspec  # noqa: E402

from mooncake_connectors.conductor.cache_index import BlockRemoved, BlockStored  # noqa: E402
from mooncake_connectors.conductor.hashing import prefix_block_hashes  # noqa: E402
from mooncake_connectors.conductor.kv_events import VllmEventTranslator  # noqa: E402

PAGE = 4


def encode(*events: object) -> bytes:
    # what SGLang's ZmqEventPublisher sends as the payload frame
    return msgspec.msgpack.Encoder().encode(kv.KVEventBatch(ts=1.0, events=list(events)))


def test_sglang_pages_become_the_same_keys_as_a_prompt() -> None:
    tokens = list(range(100, 100 + 3 * PAGE))
    t = VllmEventTranslator("sglang-0", PAGE)
    first = kv.BlockStored(
        block_hashes=[11, 12], parent_block_hash=None, token_ids=tokens[: 2 * PAGE],
        block_size=PAGE, lora_id=None, medium=kv.StorageMedium.GPU.value,
    )  # fmt: skip
    second = kv.BlockStored(
        block_hashes=[13], parent_block_hash=12, token_ids=tokens[2 * PAGE :],
        block_size=PAGE, lora_id=None,
    )  # fmt: skip
    out = t.translate_batch(encode(first, second))
    keys = prefix_block_hashes(tokens, PAGE)
    assert out == [BlockStored("sglang-0", tuple(keys[:2])), BlockStored("sglang-0", (keys[2],))]
    removed = t.translate_batch(encode(kv.BlockRemoved(block_hashes=[13])))
    assert removed == [BlockRemoved("sglang-0", (keys[2],))]
    assert t.translate_batch(encode(kv.AllBlocksCleared()))[0].instance == "sglang-0"
    assert t.stats.malformed == 0


def test_salted_and_offloaded_pages_are_skipped() -> None:
    t = VllmEventTranslator("sglang-0", PAGE)
    salted = kv.BlockStored(
        block_hashes=[1], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=PAGE,
        lora_id=None, cache_salt="tenant-a",
    )  # fmt: skip
    offloaded = kv.BlockStored(
        block_hashes=[2], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=PAGE,
        lora_id=None, medium=kv.StorageMedium.CPU.value,
    )  # fmt: skip
    assert t.translate_batch(encode(salted, offloaded)) == []
    assert t.stats.skipped_extra_keys == 1 and t.stats.skipped_other_tier == 1
