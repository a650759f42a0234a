"""``mooncake-connectors demo``: prefill/decode disaggregation on one machine, end to end.

What it starts, all on 127.0.0.1 and all stopped again at the end (also on errors or Ctrl-C):

1. a tiny Llama built locally (``tiny_model``; no model hub needed);
2. a prefill and a decode vLLM engine with ``MooncakeConnectorsPD``, one CPU core each;
3. ``mooncake-connectors proxy`` in front of them.

Then it sends the same prompts (300-1500 tokens, greedy) two ways:

- **single engine**: straight to one vLLM engine, which prefills and decodes itself;
- **disaggregated**: through the proxy: the prefill engine computes the prompt, the decode engine
  pulls its KV over our transfer engine and generates.

Each way runs once one request at a time (TTFT per request, from send to first streamed token)
and once with all requests at once (output tokens per second). The report says whether every
disaggregated answer equals the single-engine answer token for token, and how many prompt tokens
the decode engine took from the transfer rather than computing them.

Prefix caching is off on both engines so every request is really prefilled: the comparison is
"one engine does everything" against "the work is split and the KV moves".
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .launch import ProxyServer, VllmServer, stream_completion

Say = Callable[[str], None]
_EXTERNAL = "vllm:external_prefix_cache_hits_total"  # prompt tokens a KV connector provided


def demo_prompts(count: int, low: int, high: int, seed: int = 7) -> list[list[int]]:
    """``count`` token-id prompts with lengths spread evenly over [low, high]."""
    rng = random.Random(seed)
    step = (high - low) / max(1, count - 1)
    return [[rng.randrange(2, 1024) for _ in range(int(low + i * step))] for i in range(count)]


def _sequential(url: str, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    ttft, answers = [], []
    for p in prompts:
        first, _, ids = stream_completion(url, p, max_tokens)
        ttft.append(first)
        answers.append(ids)
    return {
        "ttft_ms_mean": round(1e3 * statistics.fmean(ttft), 1),
        "ttft_ms_p50": round(1e3 * statistics.median(ttft), 1),
        "ttft_ms_max": round(1e3 * max(ttft), 1),
        "answers": answers,
    }


def _concurrent(url: str, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        done = list(pool.map(lambda p: stream_completion(url, p, max_tokens), prompts))
    wall = time.perf_counter() - t0
    tokens = sum(len(ids) for _, _, ids in done)
    return {
        "requests": len(prompts),
        "seconds": round(wall, 3),
        "output_tokens_per_s": round(tokens / wall, 1),
        "requests_per_s": round(len(prompts) / wall, 2),
        "answers": [ids for _, _, ids in done],
    }


def run_demo(
    *,
    prompts: int = 8,
    min_tokens: int = 300,
    max_prompt_tokens: int = 1500,
    max_tokens: int = 32,
    work_dir: Path | None = None,
    say: Say = lambda _: None,
) -> dict[str, Any]:
    """Run the demo; see the module docstring. Returns a JSON-able report."""
    from .tiny_model import build

    if prompts < 1 or not 1 <= min_tokens <= max_prompt_tokens:
        raise ValueError("need prompts >= 1 and 1 <= min_tokens <= max_prompt_tokens")
    work = Path(work_dir or tempfile.mkdtemp(prefix="mc-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    say(f"building the tiny model in {work / 'model'}")
    model = build(work / "model")
    max_len = max_prompt_tokens + max_tokens + 64
    args = ("--no-enable-prefix-caching",)
    pd = {"kv_connector": "MooncakeConnectorsPD", "kv_load_failure_policy": "recompute"}
    prefill = VllmServer(
        work, model, core=0, max_model_len=max_len, args=args,
        kv_transfer_config={**pd, "kv_role": "kv_producer"},
    )  # fmt: skip
    decode = VllmServer(
        work, model, core=1, max_model_len=max_len, args=args,
        kv_transfer_config={**pd, "kv_role": "kv_consumer"},
    )  # fmt: skip
    proxy = ProxyServer(work, [prefill.url], [decode.url])
    servers = [prefill, decode, proxy]
    try:
        say("starting the prefill and decode vLLM engines (about a minute on two cores)")
        for s in servers:
            s.launch()
        for s in servers:
            s.wait_ready()
        say(f"prefill {prefill.url}, decode {decode.url}, proxy {proxy.url}")
        batch = demo_prompts(prompts, min_tokens, max_prompt_tokens)
        stream_completion(prefill.url, batch[0][:64], 2)  # warm both paths once
        stream_completion(proxy.url, batch[-1][:64], 2)
        external0 = decode.metric(_EXTERNAL)
        say(f"{prompts} prompts, one at a time: single engine, then disaggregated")
        single = _sequential(prefill.url, batch, max_tokens)
        disagg = _sequential(proxy.url, batch, max_tokens)
        external = decode.metric(_EXTERNAL) - external0
        say(f"{prompts} prompts at once: single engine, then disaggregated")
        single_tp = _concurrent(prefill.url, batch, max_tokens)
        disagg_tp = _concurrent(proxy.url, batch, max_tokens)
    finally:
        for s in reversed(servers):
            s.stop()
    reference = single["answers"]
    identical = sum(a == b for a, b in zip(disagg["answers"], reference, strict=True))
    identical_tp = sum(a == b for a, b in zip(disagg_tp["answers"], reference, strict=True))
    prompt_tokens = sum(len(p) for p in batch)
    for d in (single, disagg, single_tp, disagg_tp):
        d.pop("answers")
    return {
        "demo": "vllm-pd",
        "model": str(model),
        "prompts": prompts,
        "prompt_tokens": [len(p) for p in batch],
        "max_tokens": max_tokens,
        "one_at_a_time": {"single_engine": single, "disaggregated": disagg},
        "all_at_once": {"single_engine": single_tp, "disaggregated": disagg_tp},
        "tokens_identical": {
            "one_at_a_time": f"{identical}/{prompts}",
            "all_at_once": f"{identical_tp}/{prompts}",
        },
        "all_identical": identical == prompts and identical_tp == prompts,
        "decode_prompt_tokens_from_transfer": f"{int(external)}/{prompt_tokens}",
        "logs": str(work),
    }


def render(report: dict[str, Any]) -> str:
    """The report as a few lines for a terminal."""
    one, all_ = report["one_at_a_time"], report["all_at_once"]
    lines = [
        f"{report['prompts']} prompts of {min(report['prompt_tokens'])}-"
        f"{max(report['prompt_tokens'])} tokens, {report['max_tokens']} generated each (greedy)",
        "",
        f"{'':28}{'single engine':>16}{'disaggregated':>16}",
        f"{'TTFT mean (ms)':28}{one['single_engine']['ttft_ms_mean']:>16}"
        f"{one['disaggregated']['ttft_ms_mean']:>16}",
        f"{'TTFT p50 (ms)':28}{one['single_engine']['ttft_ms_p50']:>16}"
        f"{one['disaggregated']['ttft_ms_p50']:>16}",
        f"{'throughput (output tok/s)':28}{all_['single_engine']['output_tokens_per_s']:>16}"
        f"{all_['disaggregated']['output_tokens_per_s']:>16}",
        "",
        f"tokens identical to the single engine: {report['tokens_identical']['one_at_a_time']}"
        f" one at a time, {report['tokens_identical']['all_at_once']} all at once",
        f"decode prompt tokens taken from the KV transfer: "
        f"{report['decode_prompt_tokens_from_transfer']}",
        f"engine logs: {report['logs']}",
    ]
    return "\n".join(lines)
