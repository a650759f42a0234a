"""A quick profile of live vLLM instances for the conductor's estimators.

The conductor plans with a prefill time model ``a + b·new + c·(n² - p²)`` and a decode step model
(:mod:`.estimators`). For a live proxy they come from the instances themselves, before serving:

- **prefill**: after one warm-up request per instance (an engine's first request is seconds
  slower), the prefill instances compute prompts of a few lengths with ``max_tokens=1``, all
  instances at once (so instances sharing cores are profiled at their busy-pool speed); the
  wall time of each answer (so HTTP and scheduling overhead lands in ``a``) is fitted with
  :func:`~.estimators.fit_prefill_model`. Prompts are random token ids drawn from the tokenizer's
  output on random text, so no two share a cached prefix.
- **decode**: the first decode instance answers with 1 and with ``decode_tokens`` tokens; the
  difference over ``decode_tokens - 1`` is the step time at batch 1; ``batch`` concurrent answers
  give its growth per sequence. KV capacity comes from ``vllm:cache_config_info``.

- **store load** (:func:`calibrate_store_load`, only for a store deployment): what loading a
  prefix from the store costs a prefill instance, against computing it.

It costs a few seconds per instance and sends only throw-away prompts. A deployment that knows its
numbers passes them instead (``--prefill-model``, ``--decode-model``; see docs/conductor.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from aiohttp import ClientError, ClientSession, ClientTimeout

from ..errors import ConfigError
from .estimators import DecodeModel, PrefillModel, TransferModel, fit_prefill_model
from .live import parse_vllm_metrics
from .store_probe import StoreProbe
from .upstream import upstream_connector

DEFAULT_LENGTHS = (64, 256, 512, 1024, 1536)


@dataclasses.dataclass(frozen=True)
class Calibration:
    model: str
    max_model_len: int
    block_size: int
    prefill: PrefillModel
    decode: DecodeModel
    samples: tuple[tuple[int, int, float], ...]

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "max_model_len": self.max_model_len,
            "block_size": self.block_size,
            "prefill": dataclasses.asdict(self.prefill),
            "decode": dataclasses.asdict(self.decode),
            "samples": [list(s) for s in self.samples],
        }


def _session(timeout: float) -> ClientSession:
    """A client session to the engines, every call bounded by ``timeout`` (in a running loop)."""
    return ClientSession(timeout=ClientTimeout(total=timeout), connector=upstream_connector())


async def _json(s: ClientSession, method: str, url: str, body: Any = None) -> Any:
    async with s.request(method, url, json=body) as r:
        if r.status != 200:
            raise ConfigError(f"{method} {url} answered {r.status}: {(await r.text())[:300]}")
        return await r.json()


async def _prefill_seconds(s: ClientSession, url: str, model: str, prompt: list[int]) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
    t0 = time.perf_counter()
    await _json(s, "POST", url + "/v1/completions", body)
    return time.perf_counter() - t0


async def _generate_seconds(
    s: ClientSession, url: str, model: str, prompt: list[int], n: int
) -> float:
    """Wall time of a greedy ``n``-token answer (not streamed: the API server may coalesce a
    fast engine's tokens into few stream chunks, so chunk gaps are not step times)."""
    body = {
        "model": model, "prompt": prompt, "max_tokens": n, "temperature": 0.0,
        "ignore_eos": True,
    }  # fmt: skip
    t0 = time.perf_counter()
    await _json(s, "POST", url + "/v1/completions", body)
    return time.perf_counter() - t0


async def calibrate(
    prefill: Sequence[str],
    decode: Sequence[str],
    **kwargs: Any,
) -> Calibration:
    """Profile the instances (see the module docstring); every call is bounded by ``timeout``.

    Raises :class:`ConfigError` naming what failed (an instance down, an unexpected answer).
    """
    try:
        return await _calibrate(prefill, decode, **kwargs)
    except ConfigError:
        raise
    except (ClientError, asyncio.TimeoutError, KeyError, IndexError, ValueError) as exc:
        raise ConfigError(f"calibrating the instances failed: {exc!r}") from exc


async def _calibrate(
    prefill: Sequence[str],
    decode: Sequence[str],
    *,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    decode_tokens: int = 64,
    batch: int = 4,
    timeout: float = 120.0,
    seed: int = 0,
) -> Calibration:
    if not prefill or not decode:
        raise ConfigError("calibration needs prefill and decode instances")
    rng = random.Random(seed)
    async with _session(timeout) as s:
        models = await _json(s, "GET", prefill[0] + "/v1/models")
        entry = models["data"][0]
        model, max_len = str(entry["id"]), int(entry.get("max_model_len") or 2048)
        async with s.get(prefill[0] + "/metrics") as r:
            load = parse_vllm_metrics(await r.text())
        async with s.get(decode[0] + "/metrics") as r:
            dload = parse_vllm_metrics(await r.text())
        if load.block_size is None:
            raise ConfigError(f"{prefill[0]} does not publish vllm:cache_config_info block_size")
        text = " ".join(f"w{rng.randrange(10**6)}" for _ in range(2000))
        pool = (await _json(s, "POST", prefill[0] + "/tokenize", {"model": model, "prompt": text}))[
            "tokens"
        ]
        if not pool:
            raise ConfigError("the tokenizer returned no tokens")

        def prompt(n: int) -> list[int]:
            return [rng.choice(pool) for _ in range(n)]

        usable = [n for n in lengths if n < max_len - 8] or [
            max_len // 4,
            max_len // 2,
            max_len - 8,
        ]
        if len(set(usable)) < 3:
            raise ConfigError("calibration needs three distinct prompt lengths", lengths=usable)
        for url in (*prefill, *decode):  # warm-up: an engine's first request is slow
            await _prefill_seconds(s, url, model, prompt(32))
        samples: list[tuple[int, int, float]] = []
        for n in usable:
            # all prefill instances at once: instances that share cores (or memory bandwidth)
            # are profiled at the speed they have when the pool is busy, which is when the
            # estimate decides admissions
            times = await asyncio.gather(
                *(_prefill_seconds(s, url, model, prompt(n)) for url in prefill)
            )
            samples.extend((n, 0, t) for t in times)
        pmodel = fit_prefill_model(samples)
        # decode step: (n-token answer - 1-token answer) / (n - 1), alone and ``batch`` at once
        url = decode[0]
        first = statistics.median(
            [await _generate_seconds(s, url, model, prompt(32), 1) for _ in range(3)]
        )
        whole = statistics.median(
            [await _generate_seconds(s, url, model, prompt(32), decode_tokens) for _ in range(2)]
        )
        one = max(1e-4, (whole - first) / (decode_tokens - 1))
        t0 = time.perf_counter()
        await asyncio.gather(
            *(_generate_seconds(s, url, model, prompt(32), decode_tokens) for _ in range(batch))
        )
        together = time.perf_counter() - t0
        many = max(one, (together - batch * first) / (decode_tokens - 1))
        per_seq = (many - one) / max(1, batch - 1)
        capacity = dload.kv_capacity_tokens or max_len * 64
        dmodel = DecodeModel(
            base_s=max(1e-4, one - per_seq), per_seq_s=per_seq, per_kv_token_s=0.0,
            capacity_tokens=capacity,
        )  # fmt: skip
    return Calibration(model, max_len, load.block_size, pmodel, dmodel, tuple(samples))


def _metric_sum(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def calibrate_store_load(
    prefill: Sequence[str],
    probe: StoreProbe,
    pmodel: PrefillModel,
    *,
    lengths: Sequence[int] = (256, 1024),
    timeout: float = 120.0,
    save_timeout: float = 30.0,
    seed: int = 1,
) -> tuple[TransferModel, dict[str, Any]]:
    """Measure what loading a prefix from the store costs a prefill instance.

    For each length: the first instance computes a fresh prompt (its store connector saves the
    blocks when the request ends); once the store lists them, the second instance answers a
    fresh prompt of the same length (nothing cached) and then the saved one (loaded from the
    store). The load time is the difference plus the prefill the load saved (from ``pmodel``);
    ``latency + tokens / rate`` is fitted to the lengths. The second instance's
    ``vllm:external_prefix_cache_hits`` must rise, or its store connector is missing and the
    start is refused. The result is a :class:`TransferModel` in tokens (``kv_bytes_per_token``
    1, ``bandwidth_bytes_per_s`` in tokens per second).
    """
    if len(prefill) < 2:
        raise ConfigError("loading prefixes from the store needs at least two prefill instances")
    src, dst = prefill[0], prefill[1]
    rng = random.Random(seed)
    samples: list[tuple[int, float]] = []
    try:
        async with _session(timeout) as s:
            model = str((await _json(s, "GET", src + "/v1/models"))["data"][0]["id"])
            text = " ".join(f"v{rng.randrange(10**6)}" for _ in range(3000))
            pool = (await _json(s, "POST", src + "/tokenize", {"model": model, "prompt": text}))[
                "tokens"
            ]
            for n in lengths:
                saved = [rng.choice(pool) for _ in range(n)]
                fresh = [rng.choice(pool) for _ in range(n)]
                await _prefill_seconds(s, src, model, saved)
                want = len(probe.keys(saved))
                deadline = time.monotonic() + save_timeout
                held = 0
                while (held := await asyncio.to_thread(probe.held_blocks, saved)) < want:
                    if time.monotonic() > deadline:
                        raise ConfigError(
                            f"the store lists {held} of the {want} blocks {src} should have "
                            f"saved: is its store connector on, and the key template right? "
                            f"(probe: {probe.stats()})"
                        )
                    await asyncio.sleep(0.05)
                async with s.get(dst + "/metrics") as r:
                    hits0 = _metric_sum(await r.text(), "vllm:external_prefix_cache_hits_total")
                base = await _prefill_seconds(s, dst, model, fresh)
                loaded = await _prefill_seconds(s, dst, model, saved)
                async with s.get(dst + "/metrics") as r:
                    hits1 = _metric_sum(await r.text(), "vllm:external_prefix_cache_hits_total")
                if hits1 <= hits0:
                    raise ConfigError(
                        f"{dst} did not load a prefix the store holds "
                        "(vllm:external_prefix_cache_hits unchanged): run the prefill instances "
                        "with MultiConnector over MooncakeConnectorsPD and MooncakeConnectorsStore"
                    )
                tokens = held * probe.block_size
                saved_prefill = pmodel.time(n) - pmodel.time(n, tokens)
                samples.append((tokens, max(0.0, loaded - base + saved_prefill)))
    except (ClientError, asyncio.TimeoutError, KeyError, IndexError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"measuring the store load failed: {exc!r}") from exc
    xs = np.array([t for t, _ in samples], dtype=float)
    ys = np.array([y for _, y in samples], dtype=float)
    if len(set(xs.tolist())) >= 2:
        slope, icpt = np.polyfit(xs, ys, 1)
    else:
        slope, icpt = float(ys.mean() / max(xs.mean(), 1.0)), 0.0
    per_token = max(float(slope), 1e-9)  # a load is never free, however noisy the measure
    latency = max(float(icpt), 0.0)
    model_out = TransferModel(1.0 / per_token, 1, latency)
    report = {
        "samples": [list(x) for x in samples],
        "per_token_s": per_token,
        "latency_s": latency,
        "source": src,
        "loader": dst,
    }
    return model_out, report
