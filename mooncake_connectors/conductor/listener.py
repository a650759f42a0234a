"""The proxy's listening port: request deadlines, accept back-off, and what a body must be.

aiohttp alone lets a client hold a connection as long as it likes: a request line and headers
trickled a byte at a time, or a body shorter than its ``Content-Length``, are waited on with no
bound. And asyncio's accept loop, at EMFILE, logs a traceback and re-arms itself once per queued
connection, so it spins. Here the listening socket is ours:

* each accepted connection runs aiohttp's :class:`~aiohttp.web.RequestHandler` with a guard: a
  request (request line, headers and body) must arrive whole within ``read_deadline`` seconds of
  its first byte, and a connection with no request started is closed after ``idle_timeout``;
  while the proxy works on a request (both legs, the relayed stream) nothing is cut;
* a failed ``accept()`` backs off (:class:`~mooncake_connectors.netguard.AcceptBackoff`, one
  rate-limited log line) instead of spinning.

:func:`read_json_object` turns a request body into the dict the proxy forwards, or a
:class:`~mooncake_connectors.errors.ProtocolError` (answered with 400).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import ssl
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from ..errors import ProtocolError
from ..netguard import (
    BACKLOG,
    HTTP_IDLE_TIMEOUT,
    HTTP_REQUEST_TIMEOUT,
    AcceptBackoff,
    RateLimitedLog,
    listener_closed,
)

log = logging.getLogger(__name__)

READ_DEADLINE = HTTP_REQUEST_TIMEOUT  # a whole request, from its first byte (the project's 10 s)
IDLE_TIMEOUT = HTTP_IDLE_TIMEOUT  # a connection with no request started
MAX_DEPTH = 64  # JSON nesting a request may have (tool schemas nest a few levels, not hundreds)

_IDLE, _READING, _SERVING = range(3)


class _GuardedHandler(web.RequestHandler):
    """aiohttp's connection handler, closed when a request is not in by its deadline."""

    def __init__(
        self,
        manager: web.Server,
        *,
        loop: asyncio.AbstractEventLoop,
        read_deadline: float,
        idle_timeout: float,
        cuts: RateLimitedLog,
        bad: RateLimitedLog,
    ) -> None:
        # access_log=None: no line per request (aiohttp takes None so; its annotation says Logger)
        super().__init__(
            manager,
            loop=loop,
            keepalive_timeout=idle_timeout,
            access_log=None,  # type: ignore[arg-type]
        )
        self.read_deadline = read_deadline
        self.idle_timeout = idle_timeout
        self.cuts = cuts
        self.bad = bad
        self.phase = _IDLE
        self.timer: asyncio.TimerHandle | None = None

    def log_exception(self, *args: Any, **kw: Any) -> None:
        # A request aiohttp's parser refused (bad request line, headers, lengths) is a peer's
        # doing, answered 400: one rate-limited line, no traceback. Anything else is ours.
        exc = kw.get("exc_info")
        if isinstance(exc, HttpProcessingError):
            self.bad.warning(
                "refused a malformed request (%s): %s",
                exc.code,
                " ".join(exc.message.split())[:200],
            )
            return
        super().log_exception(*args, **kw)

    def arm(self, phase: int, seconds: float | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.phase = phase
        if seconds is not None:
            self.timer = self._loop.call_later(seconds, self.cut)

    def cut(self) -> None:
        self.timer = None
        what = "request not in" if self.phase == _READING else "connection idle"
        limit = self.read_deadline if self.phase == _READING else self.idle_timeout
        peer = self.transport.get_extra_info("peername") if self.transport else None
        self.cuts.warning("proxy: closed %s: %s after %.3gs", peer, what, limit)
        self.force_close()
        if self.transport is not None:
            self.transport.close()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.arm(_IDLE, self.idle_timeout)

    def data_received(self, data: bytes) -> None:
        if self.phase == _IDLE:  # the first byte of a request starts its deadline
            self.arm(_READING, self.read_deadline)
        super().data_received(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.arm(_IDLE, None)
        super().connection_lost(exc)


@web.middleware
async def guard_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Reads the whole body under the request's deadline, then serves it with no deadline."""
    guard = request.protocol if isinstance(request.protocol, _GuardedHandler) else None
    try:
        await request.read()  # kept by aiohttp: the handler's read() returns it
    except ConnectionError:
        # the client left, or the deadline cut it: there is no one to answer
        return web.Response(status=408)
    if guard is None:
        return await handler(request)
    guard.arm(_SERVING, None)
    try:
        return await handler(request)
    finally:
        if guard.transport is not None:  # the next request, if any, starts from idle
            guard.arm(_IDLE, guard.idle_timeout)


class GuardedListener:
    """``app`` served on ``host:port`` (0: any free port; ``port`` says which) once started."""

    def __init__(
        self,
        app: web.Application,
        host: str,
        port: int,
        *,
        ssl_context: ssl.SSLContext | None = None,
        read_deadline: float = READ_DEADLINE,
        idle_timeout: float = IDLE_TIMEOUT,
    ) -> None:
        if read_deadline <= 0 or idle_timeout <= 0:
            raise ValueError("the read deadline and the idle timeout must be > 0")
        self.runner = web.AppRunner(app, handle_signals=False, access_log=None)
        self.ssl_context = ssl_context
        self.read_deadline = read_deadline
        self.idle_timeout = idle_timeout
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.create_server((host, port), family=family, backlog=BACKLOG)
        self.sock.setblocking(False)
        self.port: int = self.sock.getsockname()[1]
        self.backoff = AcceptBackoff(f"proxy {host}:{self.port}", log)
        self.cuts = RateLimitedLog(log)
        self.bad = RateLimitedLog(log, burst=5)
        self._task: asyncio.Task[None] | None = None
        self._connecting: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """Run the application's startup hooks, then accept."""
        await self.runner.setup()
        self._task = asyncio.get_running_loop().create_task(self._accept_loop())

    async def close(self) -> None:
        """Stop accepting, close every connection, run the application's cleanup hooks."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.sock.close()
        for t in list(self._connecting):
            t.cancel()
        await asyncio.gather(*self._connecting, return_exceptions=True)
        await self.runner.cleanup()

    def _protocol(self) -> _GuardedHandler:
        server = self.runner.server
        if server is None:
            raise RuntimeError("the runner is not set up")
        return _GuardedHandler(
            server,
            loop=asyncio.get_running_loop(),
            read_deadline=self.read_deadline,
            idle_timeout=self.idle_timeout,
            cuts=self.cuts,
            bad=self.bad,
        )

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(self.sock)
            except OSError as exc:
                if listener_closed(exc):
                    return
                # EMFILE and the like: the listener stays readable, so retrying at once spins
                await asyncio.sleep(self.backoff.failed(exc))
                continue
            self.backoff.succeeded()
            task = loop.create_task(self._connect(conn))
            self._connecting.add(task)
            task.add_done_callback(self._connecting.discard)

    async def _connect(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            # with TLS this awaits the handshake, bounded like a request
            await loop.connect_accepted_socket(
                self._protocol,
                conn,
                ssl=self.ssl_context,
                ssl_handshake_timeout=self.read_deadline if self.ssl_context else None,
            )
        except OSError as exc:  # a refused certificate, a plaintext client, a reset
            conn.close()
            self.cuts.warning("proxy: connection dropped before its first request: %s", exc)


def _refuse_constant(name: str) -> NoReturn:
    raise ProtocolError(f"{name} is not a JSON number")


def _depth(obj: Any) -> int:
    """How deeply ``obj`` nests (iterative: a deep body must not exhaust the stack here)."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        item, d = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, d)
            if deepest > MAX_DEPTH:
                break
            stack.extend((v, d + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


def read_json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or :class:`~mooncake_connectors.errors.ProtocolError`.

    Refused: anything but UTF-8, ``NaN``/``Infinity`` (not JSON; the engines would get them
    verbatim), nesting deeper than :data:`MAX_DEPTH` (the legs copy and re-encode the body
    recursively), and anything that is not an object.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProtocolError(f"request body is not UTF-8: {exc}") from exc
    try:
        body = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError as exc:
        raise ProtocolError(f"request body nests deeper than {MAX_DEPTH} levels") from exc
    except ValueError as exc:
        raise ProtocolError(f"request body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ProtocolError("request body must be an object")
    if _depth(body) > MAX_DEPTH:
        raise ProtocolError(f"request body nests deeper than {MAX_DEPTH} levels")
    return body
