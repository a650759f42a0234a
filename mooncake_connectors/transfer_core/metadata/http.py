"""``http``: the embedded metadata server (single-machine default) and its client.

Endpoint (``PATH`` defaults to ``/metadata``, as Mooncake's own HTTP metadata server):
    GET    PATH?key=K      200 value | 404
    PUT    PATH?key=K      body = value; 200 (``&ttl=SECONDS``: dropped unless PUT again by then)
    DELETE PATH?key=K      200 | 404
    GET    PATH?prefix=P   200 msgpack {key: value}
    GET    /health         200 "ok"
With a token configured every request needs ``Authorization: Bearer TOKEN`` (else 401), except
``/health`` on the default loopback binds (see ``config.info_needs_token``). A read-only server
(the one the ``p2p`` backend embeds: only its own process writes) answers PUT and DELETE with 405.
Without TLS the token travels in clear text: it keeps out those who cannot see the traffic,
nothing more. With TLS (an ``https://`` URL, the server given a certificate) it is encrypted, and
with mutual TLS (a CA) a client certificate signed by the CA stands in for the token.
"""

from __future__ import annotations

import http.client
import logging
import math
import ssl
import sys
import threading
import time
import urllib.parse

import msgspec

from ...config import EngineConfig, bearer_ok, info_needs_token, is_loopback
from ...errors import ConfigError, MetadataError
from ...netguard import HTTP_REQUEST_TIMEOUT, GuardedHandler, GuardedHTTPServer
from ...plugins import hookimpl
from ...tls import TlsConfig, client_context, server_context
from ..descriptor import SegmentDesc, encode_segment
from .base import SEGMENT_PREFIX, MetadataBackend

log = logging.getLogger(__name__)

MAX_VALUE = 64 * 1024 * 1024
MAX_TTL = 86400.0  # a lease longer than a day is a mistake, not a lease
_list_codec = msgspec.msgpack.Decoder(dict[str, bytes])


class _Handler(GuardedHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def _reply(self, code: int, body: bytes = b"", ctype: str = "application/octet-stream") -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if body:
            self.wfile.write(body)

    def _route(self) -> tuple[str, dict[str, str]] | None:
        url = urllib.parse.urlsplit(self.path)
        token = self.server.token
        public = url.path == "/health" and not info_needs_token(self.server.host, token)
        if token and not public and not bearer_ok(self.headers.get("Authorization"), token):
            self._reply(401, b"missing or wrong token", "text/plain")
            return None
        if url.path == "/health":
            self._reply(200, b"ok", "text/plain")
            return None
        if url.path.rstrip("/") != self.server.path:
            self._reply(404, b"unknown path", "text/plain")
            return None
        q = {k: v[0] for k, v in urllib.parse.parse_qs(url.query, keep_blank_values=True).items()}
        return url.path, q

    def do_GET(self) -> None:
        r = self._route()
        if r is None:
            return
        _, q = r
        store = self.server.store
        if "key" in q:
            with self.server.lock:
                self.server.expire(time.monotonic())
                value = store.get(q["key"])
            if value is None:
                self._reply(404, b"no such key", "text/plain")
            else:
                self._reply(200, value)
        elif "prefix" in q:
            p = q["prefix"]
            with self.server.lock:
                self.server.expire(time.monotonic())
                items = {k: v for k, v in store.items() if k.startswith(p)}
            self._reply(200, msgspec.msgpack.encode(items), "application/msgpack")
        else:
            self._reply(400, b"give ?key= or ?prefix=", "text/plain")

    def _writable(self) -> bool:
        if not self.server.writable:
            self._reply(405, b"this endpoint is read-only", "text/plain")
            self.close_connection = True  # an unread PUT body must not be taken for a request
        return self.server.writable

    def do_PUT(self) -> None:
        r = self._route()
        if r is None or not self._writable():
            return
        _, q = r
        try:
            length = int(self.headers.get("Content-Length", "-1"))
        except ValueError:
            length = -1
        if "key" not in q or not q["key"]:
            self._reply(400, b"PUT needs ?key=", "text/plain")
            self.close_connection = True
            return
        if length < 0 or length > MAX_VALUE:
            self._reply(413, b"value missing or larger than 64 MiB", "text/plain")
            self.close_connection = True
            return
        ttl = _ttl(q.get("ttl"))
        if ttl is None:
            self._reply(400, b"ttl must be a number of seconds in (0, 86400]", "text/plain")
            self.close_connection = True
            return
        body = self.rfile.read(length)
        if len(body) != length:
            self.close_connection = True
            return
        key = q["key"]
        with self.server.lock:
            now = time.monotonic()
            self.server.expire(now)
            self.server.store[key] = body
            if ttl:
                self.server.expiry[key] = now + ttl
            else:
                self.server.expiry.pop(key, None)
        self._reply(200)

    def do_DELETE(self) -> None:
        r = self._route()
        if r is None or not self._writable():
            return
        _, q = r
        key = q.get("key", "")
        with self.server.lock:
            self.server.expire(time.monotonic())
            found = self.server.store.pop(key, None) is not None
            self.server.expiry.pop(key, None)
        self._reply(200 if found else 404)


def _ttl(raw: str | None) -> float | None:
    """A PUT's lease: 0.0 for none, None when it is no number of seconds in (0, MAX_TTL]."""
    if raw is None:
        return 0.0
    try:
        ttl = float(raw)
    except ValueError:
        return None
    return ttl if math.isfinite(ttl) and 0 < ttl <= MAX_TTL else None


class _Server(GuardedHTTPServer):
    allow_reuse_address = True

    def __init__(
        self,
        addr: tuple[str, int],
        path: str,
        token: str | None,
        writable: bool = True,
        request_timeout: float = HTTP_REQUEST_TIMEOUT,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        super().__init__(addr, _Handler, request_timeout, tls)
        self.host = addr[0]
        self.path = path.rstrip("/") or "/"
        self.token = token
        self.writable = writable
        self.store: dict[str, bytes] = {}
        self.expiry: dict[str, float] = {}  # key -> monotonic time its lease runs out
        self._next_sweep = 0.0
        self.lock = threading.Lock()

    def expire(self, now: float) -> None:
        """Drop the keys whose lease ran out (caller holds ``lock``); a sweep at most every
        0.1 s, so a lookup costs a dict probe, not a scan of every lease."""
        if not self.expiry or now < self._next_sweep:
            return
        self._next_sweep = now + 0.1
        for key in [k for k, t in self.expiry.items() if t <= now]:
            del self.expiry[key]
            self.store.pop(key, None)


class MetadataHTTPServer:
    """The embedded metadata server; ``start()`` serves in a background thread."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 8080,
        *,
        path: str = "/metadata",
        token: str | None = None,
        writable: bool = True,
        request_timeout: float = HTTP_REQUEST_TIMEOUT,
        tls: TlsConfig | None = None,
    ) -> None:
        if not path.startswith("/"):
            raise ConfigError(f"metadata path must start with '/', got {path!r}")
        if tls is not None and tls.mutual:
            token = None  # every client presented a CA-signed certificate: that is the proof
        # request_timeout: a whole request (line, headers, body) must arrive within it
        ctx = server_context(tls) if tls is not None else None
        self._srv = _Server((host, port), path, token, writable, request_timeout, ctx)
        self.scheme = "https" if ctx is not None else "http"
        if not token and not is_loopback(host) and not (tls is not None and tls.mutual):
            log.warning(
                "metadata server bound to %s without a token: anyone who reaches it can read "
                "and replace segment descriptors",
                host,
            )
        self.host = host
        self.port = self._srv.server_address[1]
        self.path = path
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    @property
    def url(self) -> str:
        h = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{h}:{self.port}{self.path}"

    def start(self) -> MetadataHTTPServer:
        self._thread = threading.Thread(target=self._serve, name="mc-metadata-http", daemon=True)
        self._thread.start()
        return self

    def _serve(self) -> None:
        # Our own loop, not serve_forever: its shutdown() waits, without a bound, for the serve
        # thread to notice, and a thread frozen by interpreter exit never does.
        self._srv.timeout = 0.2
        while not self._stopping.is_set():
            try:
                self._srv.handle_request()
            except OSError:  # the socket was closed under us: stopping
                if not self._stopping.is_set():
                    log.exception("metadata server stopped on a socket error")
                return

    def wait(self) -> None:
        if self._thread is not None:
            while self._thread.is_alive():
                self._thread.join(timeout=1.0)

    def stop(self, timeout: float = 2.0) -> None:
        """Stop serving; waits at most ``timeout`` for the serve thread, and not at all during
        interpreter exit (its thread may already be frozen)."""
        self._stopping.set()
        t = self._thread
        if t is not None and t is not threading.current_thread() and not sys.is_finalizing():
            t.join(timeout)
        self._srv.server_close()

    # direct access for the p2p backend that embeds this server
    def local_put(self, key: str, value: bytes) -> None:
        with self._srv.lock:
            self._srv.store[key] = value

    def local_get(self, key: str) -> bytes | None:
        with self._srv.lock:
            return self._srv.store.get(key)

    def local_delete(self, key: str) -> bool:
        with self._srv.lock:
            return self._srv.store.pop(key, None) is not None


class HttpClient:
    """A small keep-alive client of the endpoint above; every call has a deadline."""

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 5.0,
        token: str | None = None,
        tls: TlsConfig | None = None,
    ) -> None:
        u = urllib.parse.urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ConfigError(f"metadata URL must look like http(s)://HOST:PORT/PATH, got {url!r}")
        self.url = url
        self.host = u.hostname
        self.port = u.port or (443 if u.scheme == "https" else 80)
        # https without our TLS files: a server with a certificate from the system's CAs
        self.tls: ssl.SSLContext | None = None
        if u.scheme == "https":
            self.tls = client_context(tls) if tls is not None else ssl.create_default_context()
        self.path = u.path or "/metadata"
        self.timeout = timeout
        self.token = token
        self._conn: http.client.HTTPConnection | None = None
        self._lock = threading.Lock()

    def _connect(self, timeout: float) -> http.client.HTTPConnection:
        if self.tls is not None:
            return http.client.HTTPSConnection(
                self.host, self.port, timeout=timeout, context=self.tls
            )
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def request(
        self, method: str, query: dict[str, str], body: bytes | None = None
    ) -> tuple[int, bytes]:
        target = f"{self.path}?{urllib.parse.urlencode(query)}"
        headers = {"Content-Length": str(len(body or b""))}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        with self._lock:
            for attempt in (0, 1):  # one reconnect: a kept-alive connection may have gone stale
                if self._conn is None:
                    self._conn = self._connect(self.timeout)
                try:
                    self._conn.request(method, target, body=body, headers=headers)
                    resp = self._conn.getresponse()
                    data = resp.read()
                    return resp.status, data
                except (OSError, http.client.HTTPException) as exc:
                    self._conn.close()
                    self._conn = None
                    if attempt == 1 or isinstance(exc, TimeoutError):
                        raise MetadataError(
                            f"metadata server {self.url} unreachable: {exc}", url=self.url
                        ) from exc
        raise AssertionError("unreachable")

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


def _check(status: int, data: bytes, url: str, ok: tuple[int, ...] = (200,)) -> None:
    if status == 401:
        raise MetadataError("metadata server refused our token", url=url)
    if status not in ok:
        raise MetadataError(
            f"metadata server answered {status}: {data[:200].decode(errors='replace')}", url=url
        )


class HttpMetadata(HttpClient, MetadataBackend):
    """The metadata backend served by :class:`MetadataHTTPServer`: a client of its endpoint
    (its constructor and :meth:`close` are the client's)."""

    scheme = "http"
    central = True

    @classmethod
    def from_url(cls, url: str, config: EngineConfig | None = None) -> HttpMetadata:
        if config is None:
            return cls(url)
        return cls(url, timeout=config.connect_timeout, token=config.auth_token, tls=config.tls)

    def put(self, key: str, value: bytes, ttl: float = 0.0) -> None:
        query = {"key": key, "ttl": repr(ttl)} if ttl > 0 else {"key": key}
        status, data = self.request("PUT", query, bytes(value))
        _check(status, data, self.url)

    def publish_segment(self, desc: SegmentDesc, lease: float = 0.0) -> None:
        self.put(SEGMENT_PREFIX + desc.name, encode_segment(desc), ttl=lease)

    def withdraw_segment(self, name: str, timeout: float) -> None:
        # Each of connect, send and receive gets a third: the whole call ends within timeout.
        conn = self._connect(max(timeout / 3, 0.01))
        target = f"{self.path}?{urllib.parse.urlencode({'key': SEGMENT_PREFIX + name})}"
        headers = {"Content-Length": "0"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        try:
            conn.request("DELETE", target, headers=headers)
            conn.getresponse().read()
        except (OSError, http.client.HTTPException) as exc:
            log.debug("withdrawing segment %s from %s at exit: %s", name, self.url, exc)
        finally:
            conn.close()

    def get(self, key: str) -> bytes | None:
        status, data = self.request("GET", {"key": key})
        if status == 404:
            return None
        _check(status, data, self.url)
        return data

    def delete(self, key: str) -> bool:
        status, data = self.request("DELETE", {"key": key})
        _check(status, data, self.url, ok=(200, 404))
        return status == 200

    def list(self, prefix: str) -> dict[str, bytes]:
        status, data = self.request("GET", {"prefix": prefix})
        _check(status, data, self.url)
        try:
            return _list_codec.decode(data)
        except msgspec.DecodeError as exc:
            raise MetadataError(f"bad listing from {self.url}: {exc}") from exc


@hookimpl
def mooncake_metadata() -> type[MetadataBackend]:
    return HttpMetadata
