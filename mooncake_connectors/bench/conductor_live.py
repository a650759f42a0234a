"""``mooncake-connectors bench conductor-live``: round-robin vs cache-aware PD proxy, real engines.

Two prefill engines (our PD connector, prefix caching on, KV events on ``ipc://`` endpoints) and
one decode engine on the locally built model, then two proxies over the same engines:
``--policy round-robin`` and ``--policy local-cache`` fed by the engines' KV events (it profiles
the engines at start). The workload is ``docs`` long shared prefixes ("documents"; an odd
number by default, so round-robin spreads each one over both prefill engines) with
``questions`` different suffixes each, sent one at a time in interleaved order (doc 0 q 0, doc 1
q 0, …, doc 0 q 1, …), streaming; TTFT is from sending to the first streamed chunk through the
proxy. Each policy gets its own documents (fresh prefixes, nothing cached from the other run)
and the runs alternate ``rounds`` times, so slow phases of a shared machine hit both.

Reported per policy: mean and median TTFT, and the prefill engines' prefix-cache hit rate
(``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total`` deltas).
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .launch import Server, VllmServer, completion, random_prompt
from .tiny_model import build

_BLOCK = 32


class _Proxy(Server):
    name = "proxy"

    def __init__(self, log_dir: Path, args: list[str]) -> None:
        super().__init__(log_dir)
        self.args = args

    def command(self) -> list[str]:
        import sys

        return [
            sys.executable,
            "-m",
            "mooncake_connectors",
            "proxy",
            "--port",
            str(self.port),
            *self.args,
        ]


def _hits(engine: VllmServer) -> tuple[float, float]:
    """(prefix-cache hit tokens, queried tokens) so far."""
    return (
        engine.metric("vllm:prefix_cache_hits_total"),
        engine.metric("vllm:prefix_cache_queries_total"),
    )


def _tokenize_cost(url: str, model: Path, calls: int = 20) -> dict[str, Any]:
    """What keying a text prompt costs the proxy: an instance's /tokenize vs a local tokenizer."""
    rng = random.Random(5)
    text = " ".join(f"w{rng.randrange(10**6)}" for _ in range(400))
    body = json.dumps({"model": "tiny", "prompt": text}).encode()
    remote = []
    n = 0
    for _ in range(calls):
        req = urllib.request.Request(
            url + "/tokenize", data=body, headers={"Content-Type": "application/json"}
        )
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=60) as r:
            n = len(json.loads(r.read())["tokens"])
        remote.append(time.perf_counter() - t0)
    out: dict[str, Any] = {
        "prompt_tokens": n,
        "remote_median_ms": round(1e3 * statistics.median(remote), 2),
    }
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return out
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    local = []
    for _ in range(calls):
        t0 = time.perf_counter()
        tok.encode(text)
        local.append(time.perf_counter() - t0)
    out["local_median_ms"] = round(1e3 * statistics.median(local), 3)
    return out


def _ttft(url: str, prompt: list[int], max_tokens: int, timeout: float = 300.0) -> float:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    t0 = time.perf_counter()
    first = None
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            if first is None and raw.startswith(b"data: {"):
                first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError("no streamed token")
    return first


def run_conductor_benchmark(
    *,
    docs: int = 3,
    questions: int = 4,
    prefix_tokens: int = 1024,
    suffix_tokens: int = 64,
    max_tokens: int = 8,
    rounds: int = 3,
    work_dir: Path | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    tmp = None
    if work_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="conductor-bench-")
        work_dir = Path(tmp.name)
    work_dir.mkdir(parents=True, exist_ok=True)
    model = build(work_dir / "model")
    logs = work_dir / "logs"
    logs.mkdir(exist_ok=True)
    kv = {
        "kv_connector": "MooncakeConnectorsPD",
        "kv_connector_module_path": "mooncake_connectors.adapters.vllm",
        "kv_load_failure_policy": "recompute",
    }
    sockets = [f"ipc://{logs}/events-{i}.sock" for i in range(2)]
    prefill = [
        VllmServer(
            logs,
            model,
            core=0,
            kv_transfer_config={**kv, "kv_role": "kv_producer"},
            max_model_len=2048,
            args=(
                "--block-size",
                str(_BLOCK),
                "--enable-prefix-caching",
                "--kv-events-config",
                json.dumps(
                    {
                        "enable_kv_cache_events": True,
                        "publisher": "zmq",
                        "endpoint": ep,
                        "topic": "kv-events",
                    }
                ),
            ),
        )
        for ep in sockets
    ]
    decode = VllmServer(
        logs,
        model,
        core=1,
        kv_transfer_config={**kv, "kv_role": "kv_consumer"},
        max_model_len=2048,
        args=("--block-size", str(_BLOCK)),
    )
    engines = [*prefill, decode]
    proxies: list[Server] = []
    total = 2 * rounds * docs * questions
    done = 0
    try:
        for s in engines:
            s.launch()
        for s in engines:
            s.wait_ready()
        for s in engines:  # an engine's first request is seconds slower
            completion(s.url, random_prompt(1, 32), 1)
        common = [a for p in prefill for a in ("--prefill", p.url)] + ["--decode", decode.url]
        rr = _Proxy(logs, [*common, "--policy", "round-robin"])
        events = [f"--kv-events={p.url}={ep}" for p, ep in zip(prefill, sockets, strict=True)]
        ca = _Proxy(logs, [*common, "--policy", "local-cache", "--admission", "none", *events])
        for px in (rr, ca):
            proxies.append(px.launch())
        for px in (rr, ca):
            px.wait_ready(timeout=600)
        ttfts: dict[str, list[float]] = {"round-robin": [], "local-cache": []}
        hits: dict[str, list[float]] = {"round-robin": [0.0, 0.0], "local-cache": [0.0, 0.0]}
        seed = 1000
        for _ in range(rounds):
            for name, proxy in (("round-robin", rr), ("local-cache", ca)):
                prefixes = [random_prompt(seed + d, prefix_tokens) for d in range(docs)]
                seed += docs
                before = [_hits(e) for e in prefill]
                for q in range(questions):
                    for d in range(docs):
                        suffix = random_prompt(seed * 7919 + q * 31 + d, suffix_tokens)
                        ttfts[name].append(_ttft(proxy.url, [*prefixes[d], *suffix], max_tokens))
                        done += 1
                        if progress is not None:
                            progress(done, total)
                for e, (h0, q0) in zip(prefill, before, strict=True):
                    h1, q1 = _hits(e)
                    hits[name][0] += h1 - h0
                    hits[name][1] += q1 - q0
        tokenize = _tokenize_cost(prefill[0].url, model)
        with urllib.request.urlopen(ca.url + "/conductor/stats", timeout=10) as r:
            stats = json.loads(r.read())
        result: dict[str, Any] = {
            "workload": {
                "docs": docs,
                "questions": questions,
                "prefix_tokens": prefix_tokens,
                "suffix_tokens": suffix_tokens,
                "max_tokens": max_tokens,
                "rounds": rounds,
                "block_size": _BLOCK,
            },
            "policies": {
                name: {
                    "requests": len(v),
                    "mean_ttft_ms": round(1e3 * statistics.fmean(v), 1),
                    "median_ttft_ms": round(1e3 * statistics.median(v), 1),
                    "p90_ttft_ms": round(1e3 * sorted(v)[int(0.9 * (len(v) - 1))], 1),
                    "prefix_cache_hit_rate": round(hits[name][0] / hits[name][1], 3)
                    if hits[name][1]
                    else None,
                }
                for name, v in ttfts.items()
            },
            "calibration": {
                "prefill_model": stats["prefill_model"],
                "decode_model": stats["decode_model"],
            },
            "tokenize": tokenize,
        }
        return result
    finally:
        for server in (*proxies, *engines):
            server.stop()
        if tmp is not None:
            tmp.cleanup()
