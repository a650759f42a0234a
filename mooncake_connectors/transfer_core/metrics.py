"""Prometheus metrics of the transfer engine (prometheus-client, default registry).

The data path calls the small helpers below. Its per-request counts are noted cheaply and added
up in bulk (``_DataPath``); the rare ones (failures, retries) use prometheus-client metrics with
their label children cached, because ``labels()`` costs microseconds per call.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import socket
import threading
from collections.abc import Iterable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Counter, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from ..config import bearer_ok, info_needs_token
from ..netguard import GuardedHandler, GuardedHTTPServer
from ..tls import TlsConfig, server_context

SLICE_FAILURES = Counter(
    "mooncake_connectors_transfer_slice_failures", "Failed slice attempts", ["transport", "kind"]
)
RETRIES = Counter(
    "mooncake_connectors_transfer_retries",
    "Slice attempts moved to another lane or transport",
    ["transport"],
)
LATENCY_BUCKETS = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1, 5, 30)
# the "le" labels, as prometheus-client writes them (repr of the float, for bounds this size)
_BOUNDS = [repr(float(b)) for b in LATENCY_BUCKETS] + ["+Inf"]
_FLUSH_AT = 512  # events noted before the thread noting the next one adds them up


def _counter(
    name: str, doc: str, labels: list[str], values: dict[tuple[str, str], int]
) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=labels)
    for key, n in sorted(values.items()):
        family.add_metric(list(key), n)
    return family


class _DataPath(Collector):
    """Bytes moved, requests finished and their latency, one event per request or slice.

    A prometheus-client Counter or Histogram update takes a lock and costs about a microsecond,
    several of them a request: here the data path only appends its event to a list (atomic
    under the GIL) and the events are added up in bulk, when a list grows long or when the
    metrics are collected, so a scrape always sees every event noted before it."""

    def __init__(self) -> None:
        self.moved: list[tuple[str, str, int]] = []
        self.finished: list[tuple[str, str, float]] = []
        self._lock = threading.Lock()
        self._bytes: dict[tuple[str, str], int] = {}
        self._requests: dict[tuple[str, str], int] = {}
        # per op: a count per bucket (the last one is +Inf), and the sum of the latencies
        self._buckets: dict[str, list[int]] = {}
        self._sums: dict[str, float] = {}

    def flush(self) -> None:
        with self._lock:
            # Appends only ever go to the end, and only this (locked) code removes: taking the
            # first n and deleting them loses no event a thread adds meanwhile.
            n = len(self.moved)
            moved = self.moved[:n]
            del self.moved[:n]
            n = len(self.finished)
            finished = self.finished[:n]
            del self.finished[:n]
            counts = self._bytes
            for transport, op, nbytes in moved:
                key = (transport, op)
                counts[key] = counts.get(key, 0) + nbytes
            requests = self._requests
            for op, status, seconds in finished:
                key = (op, status)
                requests[key] = requests.get(key, 0) + 1
                buckets = self._buckets.get(op)
                if buckets is None:
                    buckets = self._buckets[op] = [0] * (len(LATENCY_BUCKETS) + 1)
                buckets[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
                self._sums[op] = self._sums.get(op, 0.0) + seconds

    def collect(self) -> Iterable[Metric]:
        self.flush()
        with self._lock:
            moved = _counter(
                "mooncake_connectors_transfer_bytes",
                "Bytes moved by completed slices",
                ["transport", "op"],
                self._bytes,
            )
            requests = _counter(
                "mooncake_connectors_transfer_requests",
                "Transfer requests by final status",
                ["op", "status"],
                self._requests,
            )
            latency = HistogramMetricFamily(
                "mooncake_connectors_transfer_latency_seconds",
                "Latency of transfer requests, submit to completion",
                labels=["op"],
            )
            for op, buckets in sorted(self._buckets.items()):
                cumulative = list(itertools.accumulate(buckets))
                latency.add_metric(
                    [op], list(zip(_BOUNDS, cumulative, strict=True)), self._sums[op]
                )
        return [moved, requests, latency]


_DATA_PATH = _DataPath()
REGISTRY.register(_DATA_PATH)


@functools.cache
def _child(metric: Any, *labels: str) -> Any:
    return metric.labels(*labels)


def moved(transport: str, op: str, nbytes: int) -> None:
    events = _DATA_PATH.moved
    events.append((transport, op, nbytes))
    if len(events) >= _FLUSH_AT:
        _DATA_PATH.flush()


def finished(op: str, status: str, seconds: float) -> None:
    events = _DATA_PATH.finished
    events.append((op, status, seconds))
    if len(events) >= _FLUSH_AT:
        _DATA_PATH.flush()


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
