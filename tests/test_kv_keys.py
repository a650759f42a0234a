"""Content hashes of KV blocks (mooncake_connectors.kv_keys): what each input changes (no engine).

The same checks over vLLM's own Request objects: integration_tests/vllm_pd/test_vllm_store_keys.py.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from mooncake_connectors.adapters.keys import Shard
from mooncake_connectors.adapters.vllm.store_keys import BlockKeys
from mooncake_connectors.errors import ConfigError
from mooncake_connectors.kv_keys import (
    KEY_VERSION,
    KeyInputs,
    MultiModalInput,
    block_hashes,
    embeds_digest,
    prompt_block_hashes,
)

BS = 16
TOKENS = list(range(1000, 1000 + 6 * BS + 1))  # six loadable blocks


def _differ_from(a: list[str], b: list[str], first: int) -> bool:
    return a[:first] == b[:first] and all(x != y for x, y in zip(a[first:], b[first:], strict=True))


def test_chained_hashes_name_the_whole_prefix() -> None:
    b = list(TOKENS)
    b[40] = 7  # in block 2
    ha, hb = block_hashes(TOKENS, BS), block_hashes(b, BS)
    assert len(ha) == 6  # full blocks only
    assert _differ_from([h.hex() for h in ha], [h.hex() for h in hb], 2)
    assert block_hashes(TOKENS[:50], BS) == ha[:3]  # the same prefix, the same hashes
    with pytest.raises(ConfigError):
        block_hashes(TOKENS, 0)


def test_the_last_prompt_token_is_never_in_a_stored_block() -> None:
    assert len(prompt_block_hashes(list(range(64)), 16)) == 3  # 64 tokens: block 3 holds the last
    assert len(prompt_block_hashes(list(range(65)), 16)) == 4
    assert prompt_block_hashes([], 16) == []


def test_a_salt_changes_every_block() -> None:
    plain = prompt_block_hashes(TOKENS, BS)
    a = prompt_block_hashes(TOKENS, BS, KeyInputs(cache_salt="tenant-a"))
    b = prompt_block_hashes(TOKENS, BS, KeyInputs(cache_salt="tenant-b"))
    assert _differ_from(a, b, 0) and _differ_from(a, plain, 0)
    assert prompt_block_hashes(TOKENS, BS, KeyInputs(cache_salt="")) == plain  # as vLLM: no salt
    assert a == prompt_block_hashes(TOKENS, BS, KeyInputs(cache_salt="tenant-a"))


def test_the_lora_adapter_name_and_path_change_every_block() -> None:
    plain = prompt_block_hashes(TOKENS, BS)
    x = prompt_block_hashes(TOKENS, BS, KeyInputs(lora_name="x", lora_path="/a/x"))
    assert _differ_from(x, plain, 0)
    assert _differ_from(x, prompt_block_hashes(TOKENS, BS, KeyInputs("", "y", "/a/x")), 0)
    assert _differ_from(x, prompt_block_hashes(TOKENS, BS, KeyInputs(None, "x", "/b/x")), 0)
    # the fields do not run into each other
    assert _differ_from(
        prompt_block_hashes(TOKENS, BS, KeyInputs(cache_salt="ab")),
        prompt_block_hashes(TOKENS, BS, KeyInputs(lora_name="ab")),
        0,
    )


def test_an_image_changes_the_blocks_from_its_placeholder_on() -> None:
    def keys(*mm: MultiModalInput) -> list[str]:
        return prompt_block_hashes(TOKENS, BS, KeyInputs(multimodal=mm))

    cat = keys(MultiModalInput("cat", 40, 20))  # blocks 2 and 3
    assert cat == keys(MultiModalInput("cat", 40, 20))
    assert _differ_from(cat, keys(MultiModalInput("dog", 40, 20)), 2)
    assert _differ_from(cat, keys(MultiModalInput("cat", 41, 20)), 2)  # another position
    assert _differ_from(cat, keys(), 2)
    two = keys(MultiModalInput("dog", 70, 4), MultiModalInput("cat", 40, 20))
    assert two == keys(MultiModalInput("cat", 40, 20), MultiModalInput("dog", 70, 4))
    assert _differ_from(two, cat, 4)  # the second image is in block 4
    with pytest.raises(ConfigError):
        MultiModalInput("cat", 0, 0)


def test_prompt_embeddings_change_their_block_on() -> None:
    def digests(at: int) -> tuple[bytes, ...]:
        return tuple(embeds_digest("float16", (BS, 4), bytes([i == at]) * BS * 8) for i in range(6))

    a = prompt_block_hashes(TOKENS, BS, KeyInputs(embeds=digests(-1)))
    assert _differ_from(a, prompt_block_hashes(TOKENS, BS, KeyInputs(embeds=digests(3))), 3)
    assert _differ_from(a, prompt_block_hashes(TOKENS, BS), 0)
    with pytest.raises(ConfigError, match="one per block"):
        prompt_block_hashes(TOKENS, BS, KeyInputs(embeds=digests(-1)[:2]))


def test_the_namespace_carries_the_key_version() -> None:
    (k,) = BlockKeys("vllm", "org/m", "bfloat16.b16.h2x64", Shard(False)).keys(["ab"], ["l0"])
    assert k == f"vllm/{KEY_VERSION}/org%2Fm/bfloat16.b16.h2x64/tp0-1.pp0-1/ab/l0"
    assert KEY_VERSION != "v1"  # v1 had no version part and hashed token ids alone


def test_another_process_computes_the_same_hashes() -> None:
    inputs = KeyInputs("s", "x", "/a/x", (MultiModalInput("cat", 40, 20),))
    code = (
        "from mooncake_connectors.kv_keys import *;"
        "print(prompt_block_hashes(list(range(1000, 1097)), 16,"
        " KeyInputs('s', 'x', '/a/x', (MultiModalInput('cat', 40, 20),))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
        env={"PYTHONHASHSEED": "random", "PYTHONPATH": ":".join(sys.path)},
    )  # fmt: skip
    assert out.stdout.strip() == str(prompt_block_hashes(TOKENS, BS, inputs))
