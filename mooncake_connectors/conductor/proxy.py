"""The PD proxy: an OpenAI-compatible front that runs each request as prefill, then decode.

For ``/v1/completions`` and ``/v1/chat/completions`` (streaming or not) the proxy

1. sends the request to a prefill instance with ``max_tokens=1``, no streaming, and
   ``kv_transfer_params={"do_remote_decode": true}``; the answer's ``kv_transfer_params`` say
   where the prompt's KV blocks are;
2. sends the original request to a decode instance with those ``kv_transfer_params``, and relays
   the answer (or the event stream) to the client unchanged.

If the prefill leg fails, the decode leg runs without transfer parameters: decode computes the
prompt itself, the client still gets its answer. Instances are picked round-robin, each list on
its own, until the conductor's scheduler replaces that.

aiohttp is imported here only (``pip install 'mooncake-connectors[proxy]'``; vLLM installs it).
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import logging
from collections.abc import Sequence
from typing import Any

from aiohttp import ClientError, ClientSession, ClientTimeout, web

log = logging.getLogger(__name__)

_ROUTES = ("/v1/completions", "/v1/chat/completions")
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "content-encoding"}


class PDProxy:
    """Round-robin prefill → decode proxy; ``app`` is the aiohttp application."""

    def __init__(
        self,
        prefill: Sequence[str],
        decode: Sequence[str],
        *,
        timeout: float = 600.0,
    ) -> None:
        if not prefill or not decode:
            raise ValueError("the proxy needs at least one prefill and one decode URL")
        self.prefill = [u.rstrip("/") for u in prefill]
        self.decode = [u.rstrip("/") for u in decode]
        self._next_prefill = itertools.cycle(range(len(self.prefill)))
        self._next_decode = itertools.cycle(range(len(self.decode)))
        self._timeout = ClientTimeout(total=timeout)
        self._session: ClientSession | None = None
        self.app = web.Application()
        for route in _ROUTES:
            self.app.router.add_post(route, self._handle)
        self.app.router.add_get("/health", self._health)
        self.app.router.add_get("/v1/models", self._models)
        self.app.on_startup.append(self._start)
        self.app.on_cleanup.append(self._stop)

    async def _start(self, app: web.Application) -> None:
        self._session = ClientSession(timeout=self._timeout)

    async def _stop(self, app: web.Application) -> None:
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
        async with self.session.get(url) as r:
            return web.Response(
                body=await r.read(), status=r.status, content_type="application/json"
            )

    async def prefill_leg(self, path: str, body: dict[str, Any]) -> dict[str, Any] | None:
        """Run the prefill leg; its kv_transfer_params, or None when it failed."""
        leg = copy.deepcopy(body)
        leg["max_tokens"] = 1
        if "max_completion_tokens" in leg:
            leg["max_completion_tokens"] = 1
        leg["stream"] = False
        for key in ("stream_options", "min_tokens", "n", "best_of"):
            leg.pop(key, None)  # one token, one sequence: nothing that contradicts max_tokens=1
        leg["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
        url = self.prefill[next(self._next_prefill)] + path
        try:
            async with self.session.post(url, json=leg) as r:
                if r.status != 200:
                    log.warning("prefill %s answered %d: %s", url, r.status, await r.text())
                    return None
                data = await r.json()
        except (ClientError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
            log.warning("prefill %s failed: %r", url, exc)
            return None
        params = data.get("kv_transfer_params")
        return params if isinstance(params, dict) else None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return web.json_response({"error": "request body is not JSON"}, status=400)
        if not isinstance(body, dict):
            return web.json_response({"error": "request body must be an object"}, status=400)
        path = request.path
        params = await self.prefill_leg(path, body)
        decode_body = dict(body)
        if params is not None:
            decode_body["kv_transfer_params"] = params
        url = self.decode[next(self._next_decode)] + path
        try:
            upstream = await self.session.post(url, json=decode_body)
        except (ClientError, asyncio.TimeoutError) as exc:
            return web.json_response({"error": f"decode {url} failed: {exc!r}"}, status=502)
        async with upstream:
            headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_HEADERS}
            if not body.get("stream"):
                return web.Response(
                    body=await upstream.read(), status=upstream.status, headers=headers
                )
            out = web.StreamResponse(status=upstream.status, headers=headers)
            await out.prepare(request)
            async for chunk in upstream.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out


def run_proxy(
    prefill: Sequence[str],
    decode: Sequence[str],
    host: str = "127.0.0.1",
    port: int = 8000,
    timeout: float = 600.0,
) -> None:
    """Serve the proxy in the foreground until interrupted."""
    proxy = PDProxy(prefill, decode, timeout=timeout)
    web.run_app(proxy.app, host=host, port=port, print=None, access_log=None)
