"""Prometheus metrics of the transfer engine (prometheus-client, default registry).

The data path calls the small helpers below; label children are cached because ``labels()``
costs microseconds per call.
"""

from __future__ import annotations

import functools
import socket
import threading
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Counter, Histogram, generate_latest

from ..config import bearer_ok, info_needs_token
from ..netguard import GuardedHandler, GuardedHTTPServer
from ..tls import TlsConfig, server_context

BYTES = Counter(
    "mooncake_connectors_transfer_bytes", "Bytes moved by completed slices", ["transport", "op"]
)
REQUESTS = Counter(
    "mooncake_connectors_transfer_requests", "Transfer requests by final status", ["op", "status"]
)
SLICE_FAILURES = Counter(
    "mooncake_connectors_transfer_slice_failures", "Failed slice attempts", ["transport", "kind"]
)
RETRIES = Counter(
    "mooncake_connectors_transfer_retries",
    "Slice attempts moved to another lane or transport",
    ["transport"],
)
LATENCY = Histogram(
    "mooncake_connectors_transfer_latency_seconds",
    "Latency of transfer requests, submit to completion",
    ["op"],
    buckets=(1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1, 5, 30),
)


@functools.cache
def _child(metric: Any, *labels: str) -> Any:
    return metric.labels(*labels)


def moved(transport: str, op: str, nbytes: int) -> None:
    _child(BYTES, transport, op).inc(nbytes)


def finished(op: str, status: str, seconds: float) -> None:
    _child(REQUESTS, op, status).inc()
    _child(LATENCY, op).observe(seconds)


def slice_failed(transport: str, kind: str) -> None:
    _child(SLICE_FAILURES, transport, kind).inc()


def retried(transport: str) -> None:
    _child(RETRIES, transport).inc()


_served: set[tuple[str, int]] = set()
_lock = threading.Lock()


def serve(host: str, port: int, token: str | None = None, tls: TlsConfig | None = None) -> None:
    """Serve /metrics on host:port once per process (idempotent: the first caller's token
    holds). Off the default loopback binds a set token is required as a bearer token, unless
    mutual TLS already asked for a CA-signed certificate."""
    with _lock:
        if (host, port) in _served:
            return
        guarded = info_needs_token(host, token) and not (tls is not None and tls.mutual)
        ctx = server_context(tls) if tls is not None and tls.cert is not None else None

        class Handler(GuardedHandler):
            def log_message(self, format: str, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                if guarded and not bearer_ok(self.headers.get("Authorization"), token or ""):
                    self.send_error(401, "missing or wrong token")
                    return
                body = generate_latest(REGISTRY)
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE_LATEST)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        class Server(GuardedHTTPServer):
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

        srv = Server((host, port), Handler, tls=ctx)
        threading.Thread(target=srv.serve_forever, name="mc-metrics-http", daemon=True).start()
        _served.add((host, port))
