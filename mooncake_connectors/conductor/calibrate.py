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

from aiohttp import ClientError, ClientSession, ClientTimeout

from ..errors import ConfigError
from .estimators import DecodeModel, PrefillModel, fit_prefill_model
from .live import parse_vllm_metrics

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
    async with ClientSession(timeout=ClientTimeout(total=timeout)) as s:
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
