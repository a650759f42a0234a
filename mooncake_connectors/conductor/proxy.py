"""The PD proxy: an OpenAI-compatible front that runs each request as prefill, then decode.

For ``/v1/completions`` and ``/v1/chat/completions`` (streaming or not) the proxy

1. sends the request to a prefill instance with ``max_tokens=1``, no streaming, and
   ``kv_transfer_params={"do_remote_decode": true}``; the answer's ``kv_transfer_params`` say
   where the prompt's KV blocks are;
2. sends the original request to a decode instance with those ``kv_transfer_params``, and relays
   the answer (or the event stream) to the client unchanged.

``kv_transfer_params`` belong to the proxy: one a client sends is dropped, so neither leg ever
carries the client's (a client must not choose where a decode reads KV from). The decode leg's
are the prefill's answer's, or, with push, the proxy's own; if the prefill leg fails or answers
without them, the decode leg runs with none: decode computes the prompt itself, the client still
gets its answer.

Errors: a body that is not a UTF-8 JSON object (or that holds ``NaN``/``Infinity``, or nests
deeper than 64 levels) is answered 400; a decode instance that cannot be reached, or whose
answer breaks off, 502; both in the OpenAI error format. The listening port
(:mod:`.listener`) cuts a request not in within ``read_deadline`` seconds of its first byte and
a connection idle for ``idle_timeout``, and backs off when ``accept()`` fails (EMFILE).

With ``push=True`` (layer-wise push) both legs start at once once the proxy knows the prefill
instance (its engine id and side channels, learned from an earlier prefill answer): the prefill
request carries a fresh ``push_id`` and the decode request the same id plus where the prefill's
side channels are, so the prefill writes each layer's KV into the blocks the decode allocated
while it computes the next. The first request to each prefill instance runs as a pull.

Instances are picked round-robin (each list on its own), or, given a :class:`~.live.LiveConductor`,
by the conductor: the prompt is tokenized (token-id prompts as they are, text through an
instance's ``/tokenize``), keyed into prefix blocks and scheduled; a rejection is answered with
HTTP 429 and an OpenAI-style error body naming the reason. Meanwhile the proxy polls every
instance's ``/metrics`` for load and, with a KV events endpoint, receives the prefill instances'
vLLM KV events (:class:`~.live.KVEventSubscriber`). ``GET /conductor/stats`` and
``GET /conductor/decisions`` show the conductor's picture and its recent decisions; answers carry
``x-conductor-*`` headers (chosen instances, cached blocks, estimated TTFT).

aiohttp is imported here, in :mod:`.listener` and in :mod:`.calibrate` only (``pip install
'mooncake-connectors[proxy]'``; vLLM installs it).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import itertools
import json
import logging
import signal
import time
import uuid
from collections.abc import Sequence
from typing import Any

from aiohttp import ClientError, ClientSession, ClientTimeout, web

from ..errors import ConfigError, ProtocolError
from ..pd import params as pdp
from ..tls import TlsConfig, client_context, server_context
from .estimators import DecodeModel, PrefillModel, TransferModel
from .listener import (
    IDLE_TIMEOUT,
    READ_DEADLINE,
    GuardedListener,
    guard_middleware,
    read_json_object,
)
from .live import CacheSource, KVEventSubscriber, LiveConductor, parse_vllm_metrics
from .scheduler import Conductor, ConductorConfig
from .store_probe import StoreProbe, key_inputs_of
from .types import Admission, Placement, PlacementPolicy, Rejection
from .upstream import upstream_connector

log = logging.getLogger(__name__)

_ROUTES = ("/v1/completions", "/v1/chat/completions")
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "content-encoding"}


class UpstreamError(Exception):
    """An instance did not give the proxy what it needed (tokens, a leg's answer)."""


class PDProxy:
    """Prefill → decode proxy; ``app`` is the aiohttp application.

    Without ``live`` instances are picked round-robin. With it, the conductor picks them (or
    rejects with 429); ``kv_events`` maps prefill URLs to their engines' KV event endpoints
    (none: no events, e.g. the optimistic cache source); ``/metrics`` of every instance
    is polled every ``metrics_interval`` seconds (each poll bounded by ``metrics_timeout``).
    """

    def __init__(
        self,
        prefill: Sequence[str],
        decode: Sequence[str],
        *,
        timeout: float = 600.0,
        live: LiveConductor | None = None,
        kv_events: dict[str, str] | None = None,
        metrics_interval: float = 1.0,
        metrics_timeout: float = 2.0,
        tokenize_timeout: float = 10.0,
        push: bool = False,
        tls: TlsConfig | None = None,
    ) -> None:
        if not prefill or not decode:
            raise ValueError("the proxy needs at least one prefill and one decode URL")
        self.prefill = [u.rstrip("/") for u in prefill]
        self.decode = [u.rstrip("/") for u in decode]
        if live is not None:
            cfg = live.conductor.config
            if (
                list(cfg.prefill_instances) != self.prefill
                or list(cfg.decode_instances) != self.decode
            ):
                raise ConfigError("the conductor's instances must be the proxy's URLs")
        self.live = live
        if kv_events and live is None:
            raise ConfigError("KV events need the conductor (a policy other than round-robin)")
        self.events = [
            KVEventSubscriber(inst.rstrip("/"), ep, live)
            for inst, ep in (kv_events or {}).items()
            if live is not None
        ]
        self._metrics_interval = metrics_interval
        self._metrics_timeout = ClientTimeout(total=metrics_timeout)
        self._tokenize_timeout = ClientTimeout(total=tokenize_timeout)
        self._next_prefill = itertools.cycle(range(len(self.prefill)))
        self._next_decode = itertools.cycle(range(len(self.decode)))
        self._next_tokenizer = itertools.cycle(range(len(self.prefill)))
        self._timeout = ClientTimeout(total=timeout)
        self._session: ClientSession | None = None
        self._poller: asyncio.Task[None] | None = None
        self.metrics_errors: dict[str, str] = {}
        self.push = push
        # TLS: the listener's context (with a CA, clients need a CA-signed certificate), and
        # the one for https:// instance URLs (our certificate, their CA-signed one)
        self.server_ssl = server_context(tls) if tls is not None and tls.cert else None
        self._upstream_ssl = client_context(tls) if tls is not None else None
        # prefill URL -> where its engine's side channels are (from its last answer), for push
        self.prefill_engines: dict[str, pdp.PrefillEngine] = {}
        self._legs: set[asyncio.Task[Any]] = set()  # prefill legs running beside their decode
        self.tokenize = {"calls": 0, "total_s": 0.0, "max_s": 0.0}
        # the middleware reads each body under the listener's deadline before a handler runs
        self.app = web.Application(middlewares=[guard_middleware])
        for route in _ROUTES:
            self.app.router.add_post(route, self._handle)
        self.app.router.add_get("/health", self._health)
        self.app.router.add_get("/v1/models", self._models)
        self.app.router.add_get("/conductor/stats", self._stats)
        self.app.router.add_get("/conductor/decisions", self._decisions)
        self.app.on_startup.append(self._start)
        self.app.on_cleanup.append(self._stop)

    async def _start(self, app: web.Application) -> None:
        ssl = self._upstream_ssl
        self._session = ClientSession(timeout=self._timeout, connector=upstream_connector(ssl))
        if self.live is not None:
            for sub in self.events:
                sub.start()
            self._poller = asyncio.get_running_loop().create_task(self._poll_metrics())

    async def _stop(self, app: web.Application) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        for sub in self.events:
            await sub.stop()
        if self.live is not None and self.live.store is not None:
            self.live.store.close()
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> ClientSession:
        if self._session is None:
            raise RuntimeError("proxy not started")
        return self._session

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"prefill": self.prefill, "decode": self.decode})

    async def _models(self, request: web.Request) -> web.StreamResponse:
        url = self.decode[next(self._next_decode)] + "/v1/models"
        try:
            async with self.session.get(url) as r:
                return web.Response(
                    body=await r.read(), status=r.status, content_type="application/json"
                )
        except (ClientError, asyncio.TimeoutError) as exc:
            return _error(502, f"decode {url} failed: {exc!r}", "upstream_error")

    async def _stats(self, request: web.Request) -> web.Response:
        if self.live is None:
            return web.json_response({"policy": "round-robin"})
        out = self.live.stats()
        out["kv_events"] = {sub.instance: sub.stats() for sub in self.events}
        out["metrics_errors"] = dict(self.metrics_errors)
        t = self.tokenize
        out["tokenize"] = {
            "calls": t["calls"],
            "mean_ms": round(1e3 * t["total_s"] / t["calls"], 3) if t["calls"] else None,
            "max_ms": round(1e3 * t["max_s"], 3),
        }
        return web.json_response(out)

    async def _decisions(self, request: web.Request) -> web.Response:
        return web.json_response(list(self.live.decisions) if self.live is not None else [])

    # ---- feeds -------------------------------------------------------------------------------

    async def _poll_one(self, url: str) -> None:
        assert self.live is not None
        try:
            async with self.session.get(url + "/metrics", timeout=self._metrics_timeout) as r:
                if r.status != 200:
                    raise UpstreamError(f"HTTP {r.status}")
                text = await r.text()
            self.live.observe_load(url, parse_vllm_metrics(text))
        except (ClientError, asyncio.TimeoutError, UpstreamError, ConfigError, ValueError) as exc:
            if url not in self.metrics_errors:
                log.warning("metrics of %s unavailable: %r", url, exc)
            self.metrics_errors[url] = repr(exc)
            return
        if self.metrics_errors.pop(url, None) is not None:
            log.info("metrics of %s available again", url)

    async def _poll_metrics(self) -> None:
        while True:
            await asyncio.gather(*(self._poll_one(u) for u in (*self.prefill, *self.decode)))
            await asyncio.sleep(self._metrics_interval)

    # ---- requests ----------------------------------------------------------------------------

    async def _tokenize(self, body: dict[str, Any]) -> list[int]:
        """Token ids of one prompt through an instance's /tokenize (the next one on failure)."""
        errors = []
        for _ in range(len(self.prefill)):
            url = self.prefill[next(self._next_tokenizer)] + "/tokenize"
            t0 = time.perf_counter()
            try:
                async with self.session.post(url, json=body, timeout=self._tokenize_timeout) as r:
                    if r.status != 200:
                        raise UpstreamError(f"HTTP {r.status}: {(await r.text())[:300]}")
                    data = await r.json()
                tokens = data["tokens"]
                if not isinstance(tokens, list):
                    raise UpstreamError("no token list in the answer")
            except (ClientError, asyncio.TimeoutError, UpstreamError, KeyError, ValueError) as exc:
                errors.append(f"{url}: {exc!r}")
                continue
            dt = time.perf_counter() - t0
            self.tokenize["calls"] += 1
            self.tokenize["total_s"] += dt
            self.tokenize["max_s"] = max(self.tokenize["max_s"], dt)
            return [int(t) for t in tokens]
        raise UpstreamError("cannot tokenize the prompt: " + "; ".join(errors))

    async def prompt_tokens(self, path: str, body: dict[str, Any]) -> tuple[list[int], int]:
        """(token ids keyed for the prefix, total prompt tokens) of a request.

        Several prompts in one request: the first one's tokens are keyed, all are counted.
        """
        model = body.get("model")
        if path.endswith("/chat/completions"):
            req: dict[str, Any] = {"model": model, "messages": body.get("messages")}
            for key in ("add_generation_prompt", "continue_final_message", "chat_template",
                        "chat_template_kwargs", "tools", "add_special_tokens"):  # fmt: skip
                if key in body:
                    req[key] = body[key]
            req.setdefault("add_generation_prompt", True)
            tokens = await self._tokenize(req)
            return tokens, len(tokens)
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            prompts: list[Any] = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt:
            prompts = prompt
        else:
            raise ValueError("prompt must be a string, a list of token ids, or a list of those")
        out: list[list[int]] = []
        for p in prompts:
            if isinstance(p, str):
                out.append(await self._tokenize({"model": model, "prompt": p}))
            elif isinstance(p, list) and all(isinstance(t, int) for t in p):
                out.append(list(p))
            else:
                raise ValueError("prompt must be a string, a list of token ids, or a list of those")
        return out[0], sum(len(p) for p in out)

    async def prefill_leg(
        self,
        path: str,
        body: dict[str, Any],
        url: str | None = None,
        push_id: str | None = None,
    ) -> dict[str, Any] | None:
        """Run the prefill leg; its kv_transfer_params, or None when it failed."""
        leg = copy.deepcopy(body)
        leg["max_tokens"] = 1
        if "max_completion_tokens" in leg:
            leg["max_completion_tokens"] = 1
        leg["stream"] = False
        for key in ("stream_options", "min_tokens", "n", "best_of"):
            leg.pop(key, None)  # one token, one sequence: nothing that contradicts max_tokens=1
        leg["kv_transfer_params"] = pdp.encode(pdp.PrefillLeg(push_id=push_id))
        base = url if url is not None else self.prefill[next(self._next_prefill)]
        target = base + path
        try:
            async with self.session.post(target, json=leg) as r:
                if r.status != 200:
                    log.warning("prefill %s answered %d: %s", target, r.status, await r.text())
                    return None
                data = await r.json()
        except (ClientError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
            log.warning("prefill %s failed: %r", target, exc)
            return None
        params = data.get("kv_transfer_params")
        if not isinstance(params, dict):
            return None
        # vLLM's prefill scheduler adds its own prefix-cache hits here, and a decode request
        # carrying them reports those as its cached tokens instead of the ones it loaded: with
        # the key dropped the decode counts the transferred prompt, as vLLM's MooncakeConnector
        # (whose prefill returns no params) does.
        params.pop("remote_prefill_cached_tokens", None)
        # What the answer says about the prefill's engine, for later pushed decode requests; the
        # params themselves go to the decode instance as they are, which validates them.
        with contextlib.suppress(ProtocolError):
            self.prefill_engines[base] = pdp.decode(params, pdp.PrefillEngine)
        return params

    def _push_params(self, prefill: str) -> tuple[str, dict[str, Any]] | None:
        engine = self.prefill_engines.get(prefill) if self.push else None
        if engine is None:
            return None
        push_id = uuid.uuid4().hex
        return push_id, pdp.encode(pdp.PushParams.to(engine, push_id))

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        try:
            body = read_json_object(await request.read())
        except ProtocolError as exc:
            return _error(400, str(exc), "invalid_request_error")
        # the proxy's field (see the module docstring): never forwarded from a client
        body.pop("kv_transfer_params", None)
        if self.live is None:
            prefill, decode = self.prefill[next(self._next_prefill)], None
            return await self._run(request, body, prefill, decode, None, {})
        live = self.live
        try:
            tokens, n = await self.prompt_tokens(request.path, body)
        except ValueError as exc:
            return _error(400, str(exc), "invalid_request_error")
        except UpstreamError as exc:
            return _error(502, str(exc), "upstream_error")
        store_blocks = None
        if live.store is not None:
            # one Exists call to the store's master, bounded by the probe's timeout
            inputs = key_inputs_of(body)
            store_blocks = await asyncio.to_thread(live.store.held_blocks, tokens, inputs)
        decision = live.schedule(tokens, n, store_blocks)
        if isinstance(decision, Rejection):
            return _rejection(decision, live)
        headers = _placement_headers(decision)
        return await self._run(
            request, body, decision.prefill, decision.decode, decision.request_id, headers
        )

    async def _run(
        self,
        request: web.Request,
        body: dict[str, Any],
        prefill: str,
        decode: str | None,
        rid: int | None,
        extra_headers: dict[str, str],
    ) -> web.StreamResponse:
        live = self.live
        path = request.path
        out_tokens = 0
        try:
            decode_body = dict(body)
            push = self._push_params(prefill)
            if push is not None:
                # Both legs at once: the prefill writes each layer into the decode's blocks.
                leg = asyncio.ensure_future(self.prefill_leg(path, body, prefill, push[0]))
                self._legs.add(leg)
                leg.add_done_callback(self._legs.discard)
                if live is not None and rid is not None:
                    leg.add_done_callback(lambda _: live.prefill_done(rid))
                decode_body["kv_transfer_params"] = push[1]
            else:
                params = await self.prefill_leg(path, body, prefill)
                if live is not None and rid is not None:
                    live.prefill_done(rid)
                if params is not None:
                    decode_body["kv_transfer_params"] = params
            url = (decode or self.decode[next(self._next_decode)]) + path
            try:
                upstream = await self.session.post(url, json=decode_body)
            except (ClientError, asyncio.TimeoutError) as exc:
                return _error(502, f"decode {url} failed: {exc!r}", "upstream_error")
            async with upstream:
                headers = {
                    k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_HEADERS
                }
                headers.update(extra_headers)
                if not body.get("stream"):
                    try:
                        data = await upstream.read()
                    except (ClientError, asyncio.TimeoutError) as exc:
                        return _error(502, f"decode {url} broke off: {exc!r}", "upstream_error")
                    if live is not None and rid is not None:
                        live.decode_started(rid)
                        out_tokens = _completion_tokens(data)
                    return web.Response(body=data, status=upstream.status, headers=headers)
                out = web.StreamResponse(status=upstream.status, headers=headers)
                await out.prepare(request)
                try:
                    async for chunk in upstream.content.iter_any():
                        if live is not None and rid is not None:
                            if out_tokens == 0:
                                live.decode_started(rid)
                            out_tokens += chunk.count(b"data: {")  # ~one token per event
                        await out.write(chunk)
                    await out.write_eof()
                except (ClientError, asyncio.TimeoutError, ConnectionError) as exc:
                    # the status is sent: end the connection so the stream reads as cut short
                    log.warning("stream from %s to the client broke off: %r", url, exc)
                    out.force_close()
                return out
        finally:
            if live is not None and rid is not None:
                live.finished(rid, out_tokens)


def _completion_tokens(data: bytes) -> int:
    try:
        usage = json.loads(data).get("usage") or {}
        return int(usage.get("completion_tokens") or 0)
    except (ValueError, AttributeError, TypeError):
        return 0


def _error(status: int, message: str, kind: str, code: str | None = None) -> web.Response:
    """An error in the OpenAI format (``{"error": {message, type, param, code}}``)."""
    return web.json_response(
        {"error": {"message": message, "type": kind, "param": None, "code": code}}, status=status
    )


def _rejection(r: Rejection, live: LiveConductor) -> web.Response:
    cfg = live.conductor.config
    body = {
        "error": {
            "message": f"request rejected by the conductor: {r.detail}",
            "type": "rate_limit_exceeded",
            "param": None,
            "code": r.reason.value,
        },
        "conductor": {
            "reason": r.reason.value,
            "est_ttft_s": round(r.est_ttft_s, 4),
            "ttft_slo_s": cfg.ttft_slo_s,
            "est_tbt_s": round(r.est_tbt_s, 4),
            "tbt_slo_s": cfg.tbt_slo_s,
        },
    }
    headers = {"retry-after": "1", "x-conductor-reject-reason": r.reason.value}
    return web.json_response(body, status=r.http_status, headers=headers)


def _placement_headers(p: Placement) -> dict[str, str]:
    return {
        "x-conductor-request-id": str(p.request_id),
        "x-conductor-prefill": p.prefill,
        "x-conductor-decode": p.decode,
        "x-conductor-cached-blocks": str(p.local_blocks),
        "x-conductor-load-blocks": str(p.fetch_blocks),
        "x-conductor-est-ttft-ms": f"{p.est_ttft_s * 1e3:.1f}",
    }


# Placements a live proxy can carry out on its own; the fetching ones (global-cache, adaptive)
# plan a prefix load, which the prefill instances' store connector carries out: they need the
# store (``store_master`` and ``store_keys``).
LIVE_PLACEMENTS = (
    PlacementPolicy.RANDOM,
    PlacementPolicy.LOAD_BALANCE,
    PlacementPolicy.LOCAL_CACHE,
)
STORE_PLACEMENTS = (PlacementPolicy.GLOBAL_CACHE, PlacementPolicy.ADAPTIVE)


@dataclasses.dataclass(frozen=True)
class ConductorOptions:
    """How a live proxy schedules; models and block size left None are profiled at start."""

    placement: PlacementPolicy = PlacementPolicy.LOCAL_CACHE
    admission: Admission = Admission.EARLY
    ttft_slo_s: float = 10.0
    tbt_slo_s: float = 1.0
    cache_source: CacheSource = CacheSource.EVENTS
    kv_events: dict[str, str] = dataclasses.field(default_factory=dict)
    block_size: int | None = None
    prefill_model: PrefillModel | None = None
    decode_model: DecodeModel | None = None
    expected_output_tokens: float = 64.0
    metrics_interval_s: float = 1.0
    learn_instance_speed: bool = False
    # The store as global cache index (see .store_probe): its master and key template; the
    # load model (seconds per token and fixed cost) is measured at start unless given.
    store_master: str | None = None
    store_keys: str | None = None
    store_load: TransferModel | None = None
    store_timeout_s: float = 1.0

    def __post_init__(self) -> None:
        if (self.store_master is None) != (self.store_keys is None):
            raise ConfigError("the store needs both its master and its key template")
        if self.placement in STORE_PLACEMENTS and self.store_master is None:
            raise ConfigError(
                f"placement {self.placement.value!r} plans prefix fetches between prefill "
                "instances, which only the store carries out: run the prefill instances with "
                "MultiConnector over MooncakeConnectorsPD and MooncakeConnectorsStore and give "
                "the store's master and key template; or use one of "
                + ", ".join(p.value for p in LIVE_PLACEMENTS)
            )
        if self.placement not in (*LIVE_PLACEMENTS, *STORE_PLACEMENTS):
            raise ConfigError(f"placement {self.placement.value!r} cannot run live")
        if self.metrics_interval_s <= 0:
            raise ConfigError("metrics_interval_s must be > 0")


async def build_conductor(
    prefill: Sequence[str], decode: Sequence[str], options: ConductorOptions
) -> tuple[LiveConductor, dict[str, Any] | None]:
    """The live conductor over these instances; profiles them for what ``options`` leave out.

    Returns it with the calibration (as a dict) when one ran.
    """
    prefill = [u.rstrip("/") for u in prefill]
    decode = [u.rstrip("/") for u in decode]
    kv = {k.rstrip("/"): v for k, v in options.kv_events.items()}
    if options.cache_source is CacheSource.EVENTS:
        missing = [p for p in prefill if p not in kv]
        if missing or set(kv) - set(prefill):
            raise ConfigError(
                "cache source 'events' needs one --kv-events URL=ENDPOINT per prefill instance "
                "(or --cache-source optimistic)",
                missing=missing, unknown=sorted(set(kv) - set(prefill)),
            )  # fmt: skip
    elif kv:
        raise ConfigError("--kv-events given with --cache-source optimistic: pick one")
    pmodel, dmodel, block = options.prefill_model, options.decode_model, options.block_size
    report: dict[str, Any] | None = None
    if pmodel is None or dmodel is None or block is None:
        from .calibrate import calibrate

        cal = await calibrate(prefill, decode)
        report = cal.as_dict()
        pmodel, dmodel, block = pmodel or cal.prefill, dmodel or cal.decode, block or cal.block_size
    probe = None
    transfer = TransferModel(1e9, 1)  # costs fetches, which only the store's placements plan
    if options.store_master is not None and options.store_keys is not None:
        probe = StoreProbe(
            options.store_master, options.store_keys, block, timeout=options.store_timeout_s
        )
        transfer = options.store_load or TransferModel(1e9, 1)
        if options.placement in STORE_PLACEMENTS and options.store_load is None:
            from .calibrate import calibrate_store_load

            try:
                transfer, load_report = await calibrate_store_load(prefill, probe, pmodel)
            except BaseException:
                probe.close()
                raise
            report = {**(report or {}), "store_load": load_report}
    cfg = ConductorConfig(
        prefill_instances=tuple(prefill),
        decode_instances=tuple(decode),
        prefill_model=pmodel,
        transfer_model=transfer,
        store=probe is not None,
        decode_model=dmodel,
        placement=options.placement,
        admission=options.admission,
        ttft_slo_s=options.ttft_slo_s,
        tbt_slo_s=options.tbt_slo_s,
        block_tokens=block,
        expected_output_tokens=options.expected_output_tokens,
        learn_instance_speed=options.learn_instance_speed,
    )
    live = LiveConductor(Conductor(cfg), cache_source=options.cache_source, store=probe)
    return live, report


def run_proxy(
    prefill: Sequence[str],
    decode: Sequence[str],
    host: str = "127.0.0.1",
    port: int = 8000,
    timeout: float = 600.0,
    options: ConductorOptions | None = None,
    push: bool = False,
    tls: TlsConfig | None = None,
    read_deadline: float = READ_DEADLINE,
    idle_timeout: float = IDLE_TIMEOUT,
) -> None:
    """Serve the proxy in the foreground until SIGINT or SIGTERM (round-robin without
    ``options``); ``read_deadline`` and ``idle_timeout`` bound each client connection (see
    :mod:`.listener`)."""
    live = None
    kv_events: dict[str, str] = {}
    interval = 1.0
    if options is not None:
        live, report = asyncio.run(build_conductor(prefill, decode, options))
        if report is not None:
            log.warning("conductor calibration: %s", json.dumps(report))
        kv_events = options.kv_events
        interval = options.metrics_interval_s
    proxy = PDProxy(
        prefill, decode, timeout=timeout, live=live, kv_events=kv_events,
        metrics_interval=interval, push=push, tls=tls,
    )  # fmt: skip
    asyncio.run(_serve(proxy, host, port, read_deadline, idle_timeout))


async def _serve(
    proxy: PDProxy, host: str, port: int, read_deadline: float, idle_timeout: float
) -> None:
    listener = GuardedListener(
        proxy.app, host, port, ssl_context=proxy.server_ssl,
        read_deadline=read_deadline, idle_timeout=idle_timeout,
    )  # fmt: skip
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await listener.start()
        await stop.wait()
    finally:
        await listener.close()
