"""The overlap round of ``bench vllm-store``: a second instance asks while the first still runs.

Engine A gets a fresh prompt and a long answer to generate; as soon as A streams its first token
(its prefill is done, its request is still running), engine B gets the same prompt. With saves
during the prefill (``save_during_prefill``) B can find A's blocks in the store already; with
saves only at the end of a request it cannot until A finished. ``ttft_ms`` is B's time to its
first token, ``hit_fraction`` the share of prompt tokens B took from the store,
``tokens_identical`` whether B's greedy tokens are A's first ones, ``a_running`` whether A was
still generating when B's answer was complete (else the round measured no overlap).
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

from .launch import VllmServer, completion_body, iter_stream, random_prompt

_DEADLINE = 300.0  # s: A's first token, and A's whole answer


def _stream_a(url: str, prompt: list[int], max_tokens: int, out: dict[str, Any]) -> None:
    ids: list[int] = out["ids"]
    try:
        for event in iter_stream(
            url + "/v1/completions",
            completion_body(prompt, max_tokens, stream=True),
            timeout=_DEADLINE,
        ):
            for choice in event.get("choices") or []:
                ids.extend(choice.get("token_ids") or [])
            if ids:
                out["first"].set()
    except Exception as exc:  # reported by the caller
        out["error"] = exc
    finally:
        out["first"].set()
        out["done"].set()


def overlap(
    a: VllmServer, b: VllmServer, length: int, rounds: int, max_tokens: int, a_tokens: int
) -> dict[str, Any]:
    """``rounds`` overlap rounds of fresh ``length``-token prompts, summarised."""
    over = [
        _round(a, b, random_prompt(length * 100 + 70 + r, length), max_tokens, a_tokens)
        for r in range(rounds)
    ]
    return {
        "ttft_ms": round(statistics.median(o["ttft_ms"] for o in over), 1),
        "ttft_ms_all": [round(o["ttft_ms"], 1) for o in over],
        "hit_fraction_all": [round(o["hit_fraction"], 3) for o in over],
        "tokens_identical": all(o["tokens_identical"] for o in over),
        "a_running_all": [o["a_running"] for o in over],
    }


def _round(
    a: VllmServer, b: VllmServer, prompt: list[int], max_tokens: int, a_tokens: int
) -> dict[str, Any]:
    from .vllm_store import HITS, _stream

    out: dict[str, Any] = {
        "ids": [],
        "first": threading.Event(),
        "done": threading.Event(),
        "error": None,
    }
    t = threading.Thread(target=_stream_a, args=(a.url, prompt, a_tokens, out), daemon=True)
    t.start()
    if not out["first"].wait(_DEADLINE) or out["error"] is not None:
        raise RuntimeError(f"engine A gave no first token: {out['error']}")
    before = b.metric(HITS)
    ms, ids = _stream(b.url, prompt, max_tokens)
    running = not out["done"].is_set()
    hits = b.metric(HITS) - before
    t.join(_DEADLINE)
    if t.is_alive() or out["error"] is not None:
        raise RuntimeError(f"engine A's answer did not end: {out['error']}")
    time.sleep(0.5)  # A's finish-time save, before the next round
    return {
        "ttft_ms": ms,
        "hit_fraction": hits / len(prompt),
        "tokens_identical": ids == out["ids"][: len(ids)],
        "a_running": running,
    }
