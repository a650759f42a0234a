"""``mooncake-connectors bench conductor-live``: the PD proxy's placement policies, real engines.

Three prefill engines run vLLM's MultiConnector over our PD connector (producer) and our store
connector (save and load), with prefix caching on and KV events on ``ipc://`` endpoints; one
decode engine runs the PD connector (consumer); one store master and one store server hold the
saved prefixes. Every policy runs over the same engines and store, each through its own proxy:
``round-robin``; ``local-cache`` fed by the KV events (it profiles the engines at start; the
others are given its models); ``global-cache`` and ``adaptive`` with the store's master as the
global cache index (``global-cache`` measures the store load at start, ``adaptive`` is given it).
Note that the engines' store connector loads whatever the store holds under every policy: the
policies differ only in where they place each request.

The workload is ``docs`` long shared prefixes ("documents") with ``questions`` different
suffixes each, in interleaved order (doc 0 q 0, doc 1 q 0, …, doc 0 q 1, …), streaming; TTFT is
from sending to the first streamed chunk through the proxy. With ``rate`` > 0 the requests are
sent open-loop at that many per second (queues form, which is where the policies differ); with
0 one at a time. Each policy gets its own documents (fresh prefixes) and the policies alternate
``rounds`` times, so slow phases of a shared machine hit all of them.

Reported per policy: mean, median and p90 TTFT; goodput, the requests whose TTFT met the SLO
per second of the policy's windows (and their share); the prefill engines' prefix-cache hit rate
and the tokens they loaded from the store (``vllm:external_prefix_cache_hits_total``). The SLO
is ``slo_factor`` times the profiled prefill time of one whole prompt unless given.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..kv_keys import KEY_VERSION
from .launch import Server, StoreMaster, StoreServerProcess, VllmServer, completion, random_prompt
from .procs import CLI
from .tiny_model import build

_BLOCK = 32
POLICIES = ("round-robin", "local-cache", "global-cache", "adaptive")


def store_keys_template(block: int = _BLOCK) -> str:
    """The key of one layer of one block, as the store connector of the tiny model saves it
    (namespace ``vllm``, ``model_name`` ``tiny``, rank 0), ``{block}`` for the block hash."""
    layer = "model.layers.1.self_attn.attn"
    return f"vllm/{KEY_VERSION}/tiny/bfloat16.b{block}.h2x64/tp0-1.pp0-1/{{block}}/{layer}"


def store_prefill_config(master: str) -> dict[str, Any]:
    """``--kv-transfer-config`` of a prefill engine: MultiConnector over PD and the store."""
    module = "mooncake_connectors.adapters.vllm"
    return {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "connectors": [
                {
                    "kv_connector": "MooncakeConnectorsPD",
                    "kv_connector_module_path": module,
                    "kv_role": "kv_producer",
                    "kv_connector_extra_config": {"transfer_timeout": 10.0, "kv_lease": 30.0},
                },
                {
                    "kv_connector": "MooncakeConnectorsStore",
                    "kv_connector_module_path": module,
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {
                        "master": master,
                        "model_name": "tiny",
                        "timeout": 10.0,
                    },
                },
            ]
        },
    }


def events_config(endpoint: str) -> str:
    return json.dumps(
        {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
         "topic": "kv-events"}
    )  # fmt: skip


class _Proxy(Server):
    name = "proxy"

    def __init__(self, log_dir: Path, args: list[str]) -> None:
        super().__init__(log_dir)
        self.args = args

    def command(self) -> list[str]:
        return [*CLI, "proxy", "--port", str(self.port), *self.args]

    def stats(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.url + "/conductor/stats", timeout=10) as r:
            out: dict[str, Any] = json.loads(r.read())
            return out


def _hits(engine: VllmServer) -> tuple[float, float, float]:
    """(prefix-cache hit tokens, queried tokens, tokens loaded by the connectors) so far."""
    return (
        engine.metric("vllm:prefix_cache_hits_total"),
        engine.metric("vllm:prefix_cache_queries_total"),
        engine.metric("vllm:external_prefix_cache_hits_total"),
    )


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


def _run_requests(
    url: str, prompts: list[list[int]], max_tokens: int, rate: float
) -> tuple[list[float | None], float]:
    """TTFTs (None: failed) of ``prompts`` sent one at a time or open-loop at ``rate`` per
    second, and the window: first send to last answer."""
    out: list[float | None] = [None] * len(prompts)
    t0 = time.perf_counter()
    if rate <= 0:
        for i, p in enumerate(prompts):
            out[i] = _ttft(url, p, max_tokens)
        return out, time.perf_counter() - t0

    def one(i: int) -> None:
        try:
            out[i] = _ttft(url, prompts[i], max_tokens)
        except (OSError, RuntimeError):
            out[i] = None

    threads = []
    for i in range(len(prompts)):
        delay = t0 + i / rate - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        t = threading.Thread(target=one, args=(i,), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join(timeout=600)  # each request has its own 300 s deadline
    return out, time.perf_counter() - t0


def run_conductor_benchmark(
    *,
    docs: int = 3,
    questions: int = 4,
    prefix_tokens: int = 1024,
    suffix_tokens: int = 64,
    max_tokens: int = 8,
    rounds: int = 2,
    rate: float = 4.0,
    slo_s: float | None = None,
    slo_factor: float = 3.0,
    policies: tuple[str, ...] = POLICIES,
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
    master = StoreMaster(logs)
    store = StoreServerProcess(logs, master.address, memory="512M")
    sockets = [f"ipc://{logs}/events-{i}.sock" for i in range(3)]
    prefill = [
        VllmServer(
            logs,
            model,
            core=i % 2,
            kv_transfer_config=store_prefill_config(master.address),
            max_model_len=2048,
            args=(
                "--block-size",
                str(_BLOCK),
                "--enable-prefix-caching",
                "--kv-events-config",
                events_config(ep),
            ),
        )
        for i, ep in enumerate(sockets)
    ]
    decode = VllmServer(
        logs, model, core=1, max_model_len=2048, args=("--block-size", str(_BLOCK)),
        kv_transfer_config={
            "kv_connector": "MooncakeConnectorsPD",
            "kv_connector_module_path": "mooncake_connectors.adapters.vllm",
            "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute",
        },
    )  # fmt: skip
    engines = [*prefill, decode]
    started: list[Server] = []
    total = len(policies) * rounds * docs * questions
    done = 0
    try:
        for st in (master, store):
            started.append(st.launch())
            st.wait_ready()
        for e in engines:
            started.append(e.launch())
        for e in engines:
            e.wait_ready()
        for e in engines:  # an engine's first request is seconds slower
            completion(e.url, random_prompt(1, 32), 1)
        common = [a for p in prefill for a in ("--prefill", p.url)] + ["--decode", decode.url]
        events = [f"--kv-events={p.url}={ep}" for p, ep in zip(prefill, sockets, strict=True)]
        store_args = ["--store-master", master.address, "--store-keys", store_keys_template()]
        conductor = ["--admission", "none", "--metrics-interval", "0.5", *events]
        proxies: dict[str, _Proxy] = {}
        # local-cache profiles the engines; the others are given its models
        lc = _Proxy(logs, [*common, "--policy", "local-cache", *conductor])
        started.append(lc.launch())
        lc.wait_ready(timeout=900)
        proxies["local-cache"] = lc
        cal = lc.stats()
        pm, dm = cal["prefill_model"], cal["decode_model"]
        models = [
            "--block-size", str(cal["block_tokens"]),
            "--prefill-model", f"{pm['a']},{pm['b']},{pm['c']}",
            "--decode-model",
            f"{dm['base_s']},{dm['per_seq_s']},{dm['per_kv_token_s']},{dm['capacity_tokens']}",
        ]  # fmt: skip
        store_load: dict[str, Any] | None = None
        if "global-cache" in policies or "adaptive" in policies:
            gc_ = _Proxy(logs, [*common, "--policy", "global-cache", *conductor, *models,
                                *store_args])  # fmt: skip
            started.append(gc_.launch())
            gc_.wait_ready(timeout=900)  # it measures the store load
            proxies["global-cache"] = gc_
            store_load = gc_.stats()["store_load"]
            assert store_load is not None
            per_token = 1.0 / store_load["bandwidth_bytes_per_s"]
            load_arg = f"{per_token!r},{store_load['latency_s']!r}"
            ad = _Proxy(
                logs,
                [*common, "--policy", "adaptive", *conductor, *models, *store_args,
                 "--store-load", load_arg],
            )  # fmt: skip
            started.append(ad.launch())
            ad.wait_ready(timeout=300)
            proxies["adaptive"] = ad
        rr = _Proxy(logs, [*common, "--policy", "round-robin"])
        started.append(rr.launch())
        rr.wait_ready(timeout=300)
        proxies["round-robin"] = rr
        n_prompt = prefix_tokens + suffix_tokens
        prefill_s = pm["a"] + pm["b"] * n_prompt + pm["c"] * n_prompt * n_prompt
        slo = slo_s if slo_s is not None else slo_factor * prefill_s
        ttfts: dict[str, list[float | None]] = {p: [] for p in policies}
        windows = dict.fromkeys(policies, 0.0)
        hits = {p: [0.0, 0.0, 0.0] for p in policies}
        seed = 1000
        for _ in range(rounds):
            for name in policies:
                prefixes = [random_prompt(seed + d, prefix_tokens) for d in range(docs)]
                seed += docs
                prompts = [
                    [*prefixes[d], *random_prompt(seed * 7919 + q * 31 + d, suffix_tokens)]
                    for q in range(questions)
                    for d in range(docs)
                ]
                before = [_hits(e) for e in prefill]
                got, window = _run_requests(proxies[name].url, prompts, max_tokens, rate)
                ttfts[name].extend(got)
                windows[name] += window
                for e, b in zip(prefill, before, strict=True):
                    for k, v in enumerate(_hits(e)):
                        hits[name][k] += v - b[k]
                done += len(prompts)
                if progress is not None:
                    progress(done, total)
        result: dict[str, Any] = {
            "workload": {
                "docs": docs,
                "questions": questions,
                "prefix_tokens": prefix_tokens,
                "suffix_tokens": suffix_tokens,
                "max_tokens": max_tokens,
                "rounds": rounds,
                "rate_per_s": rate,
                "block_size": _BLOCK,
                "prefill_engines": len(prefill),
                "slo_s": round(slo, 4),
            },
            "policies": {
                name: _summary(v, windows[name], hits[name], slo) for name, v in ttfts.items()
            },
            "calibration": {
                "prefill_model": pm,
                "decode_model": dm,
                "store_load": store_load,
            },
        }
        return result
    finally:
        for server in reversed(started):
            server.stop()
        if tmp is not None:
            tmp.cleanup()


def _summary(
    got: list[float | None], window: float, hits: list[float], slo: float
) -> dict[str, Any]:
    ok = sorted(t for t in got if t is not None)
    good = sum(1 for t in ok if t <= slo)
    return {
        "requests": len(got),
        "failed": len(got) - len(ok),
        "mean_ttft_ms": round(1e3 * statistics.fmean(ok), 1) if ok else None,
        "median_ttft_ms": round(1e3 * statistics.median(ok), 1) if ok else None,
        "p90_ttft_ms": round(1e3 * ok[int(0.9 * (len(ok) - 1))], 1) if ok else None,
        "within_slo": good,
        "goodput_per_s": round(good / window, 3) if window > 0 else None,
        "window_s": round(window, 2),
        "prefix_cache_hit_rate": round(hits[0] / hits[1], 3) if hits[1] else None,
        "store_loaded_tokens": int(hits[2]),
    }
