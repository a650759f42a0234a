"""Connector statistics in vLLM's connector-stats channel (PD transfers, store loads and saves),
and the PD connector's on vLLM's ``/metrics``.

Workers hand a snapshot to vLLM each step (``get_kv_connector_stats``); vLLM aggregates them,
logs ``KV Transfer metrics: ...`` at its stats interval and hands the same data to ``PDPromMetrics``
(``build_prom_metrics``), which exports it on the API server's own ``/metrics``:

- ``vllm:mooncake_connectors_pd_load_seconds`` histogram: one request's KV read on decode;
- ``vllm:mooncake_connectors_pd_load_bytes_total``, ``..._loads_total``,
  ``..._failed_loads_total``, ``..._expired_leases_total``, ``..._pushes_total``,
  ``..._push_overlapped_bytes_total`` counters.

The transfer engine's own Prometheus metrics (``metrics_port``) count bytes, requests and latency
per transport underneath.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, ClassVar

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine


@dataclasses.dataclass
class ListStats(KVConnectorStats):  # type: ignore[misc]  # Any without vLLM
    """Lists of observations since the last snapshot (one entry per request or event) under
    the names in ``KEYS``; subclasses add ``record_*`` methods and ``reduce``."""

    KEYS: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        for key in self.KEYS:
            self.data.setdefault(key, [])

    def __getstate__(self) -> dict[str, Any]:  # the lock does not cross processes
        return {"data": self.data}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.data = state["data"]
        self._lock = threading.Lock()

    def _add(self, **values: float) -> None:
        with self._lock:
            for key, value in values.items():
                self.data[key].append(value)

    def take(self) -> ListStats | None:
        """A snapshot of what was recorded (None when nothing was), and start over."""
        with self._lock:
            if self.is_empty():
                return None
            snap = type(self)(data={k: list(v) for k, v in self.data.items()})
            self.reset()
        return snap

    def reset(self) -> None:
        for key in self.KEYS:
            self.data[key] = []

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in self.KEYS)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key in self.KEYS:
            self.data.setdefault(key, []).extend(other.data.get(key, []))
        return self


def _avg_ms(secs: list[float]) -> float:
    return round(1e3 * sum(secs) / len(secs), 3) if secs else 0


def _p90_ms(secs: list[float]) -> float:
    s = sorted(secs)
    return round(1e3 * s[min(len(s) - 1, int(0.9 * len(s)))], 3) if s else 0


@dataclasses.dataclass
class PDStats(ListStats):
    """PD transfers: per-request load time and bytes, failed loads, expired leases."""

    KEYS: ClassVar[tuple[str, ...]] = (
        "load_seconds",
        "load_bytes",
        "load_requests",
        "failed_loads",
        "expired_leases",
        "pushes",
        "push_overlapped_bytes",
    )

    def record_load(self, seconds: float, nbytes: int, nrequests: int) -> None:
        self._add(load_seconds=seconds, load_bytes=nbytes, load_requests=nrequests)

    def record_push(
        self, tail_seconds: float, nbytes: int, nrequests: int, overlapped: int
    ) -> None:
        """A load the prefill pushed layer by layer; its time is the part after the prefill's
        last forward (what the push did not hide behind compute); ``overlapped``: bytes whose
        write started while the prefill's forward was still running."""
        self.record_load(tail_seconds, nbytes, nrequests)
        self._add(pushes=1, push_overlapped_bytes=overlapped)

    def record_failed_load(self) -> None:
        self._add(failed_loads=1)

    def record_expired_lease(self) -> None:
        self._add(expired_leases=1)

    def reduce(self) -> dict[str, int | float]:
        secs = self.data["load_seconds"]
        n = len(secs)
        total_bytes = sum(self.data["load_bytes"])
        total_secs = sum(secs)
        return {
            "Num successful transfers": n,
            "Avg xfer time (ms)": _avg_ms(secs),
            "P90 xfer time (ms)": _p90_ms(secs),
            "Avg MB per transfer": round(total_bytes / n / 2**20, 3) if n else 0,
            "Throughput (MB/s)": round(total_bytes / 2**20 / total_secs, 3) if total_secs else 0,
            "Num failed transfers": len(self.data["failed_loads"]),
            "Num KV expired reqs": len(self.data["expired_leases"]),
            "Num layer-wise pushes": len(self.data["pushes"]),
        }


@dataclasses.dataclass
class StoreStats(ListStats):
    """Store connector: per-request loads and saves (time, bytes, blocks), failures, and blocks
    a save skipped because the store already held them."""

    KEYS: ClassVar[tuple[str, ...]] = (
        "load_seconds",
        "load_bytes",
        "load_blocks",
        "failed_loads",
        "save_seconds",
        "save_bytes",
        "save_blocks",
        "skipped_blocks",
        "failed_saves",
    )

    def record_load(self, seconds: float, nbytes: int, nblocks: int) -> None:
        self._add(load_seconds=seconds, load_bytes=nbytes, load_blocks=nblocks)

    def record_failed_load(self) -> None:
        self._add(failed_loads=1)

    def record_save(self, seconds: float, nbytes: int, nblocks: int, skipped: int) -> None:
        self._add(save_seconds=seconds, save_bytes=nbytes, save_blocks=nblocks)
        self._add(skipped_blocks=skipped)

    def record_failed_save(self) -> None:
        self._add(failed_saves=1)

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        return {
            "Num store loads": len(d["load_seconds"]),
            "Avg load time (ms)": _avg_ms(d["load_seconds"]),
            "P90 load time (ms)": _p90_ms(d["load_seconds"]),
            "Blocks loaded": int(sum(d["load_blocks"])),
            "MB loaded": round(sum(d["load_bytes"]) / 2**20, 3),
            "Num failed loads": len(d["failed_loads"]),
            "Num store saves": len(d["save_seconds"]),
            "Avg save time (ms)": _avg_ms(d["save_seconds"]),
            "Blocks saved": int(sum(d["save_blocks"])),
            "Blocks already stored": int(sum(d["skipped_blocks"])),
            "MB saved": round(sum(d["save_bytes"]) / 2**20, 3),
            "Num failed saves": len(d["failed_saves"]),
        }


_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 20.0]

# (stats key, metric name, kind, help). kind: "seconds" -> a histogram of every entry; "sum" ->
# a counter of the entries' sum; "count" -> a counter of the number of entries.
_Spec = tuple[str, str, str, str]


class PromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]  # Any without vLLM
    """A connector's stats in vLLM's Prometheus registry, one child per engine (``SPECS``)."""

    PREFIX: ClassVar[str] = ""
    SPECS: ClassVar[tuple[_Spec, ...]] = ()

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._series: list[tuple[str, str, dict[int, Any]]] = []
        for key, name, kind, doc in self.SPECS:
            cls = self._histogram_cls if kind == "seconds" else self._counter_cls
            kw: dict[str, Any] = {"buckets": _BUCKETS} if kind == "seconds" else {}
            metric = cls(name=self.PREFIX + name, documentation=doc, labelnames=labelnames, **kw)
            per_engine = create_metric_per_engine(metric, per_engine_labelvalues)
            self._series.append((key, kind, per_engine))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, kind, per_engine in self._series:
            values = transfer_stats_data.get(key) or []
            if kind == "seconds":
                for v in values:
                    per_engine[engine_idx].observe(v)
            elif amount := (sum(values) if kind == "sum" else len(values)):
                per_engine[engine_idx].inc(amount)


class PDPromMetrics(PromMetrics):
    PREFIX = "vllm:mooncake_connectors_pd_"
    SPECS = (
        ("load_seconds", "load_seconds", "seconds", "One request's KV read from prefill (decode)."),
        ("load_bytes", "load_bytes", "sum", "KV bytes read from prefill instances."),
        ("load_seconds", "loads", "count", "Requests whose KV was read."),
        ("failed_loads", "failed_loads", "count", "Requests whose KV read failed or timed out."),
        (
            "expired_leases",
            "expired_leases",
            "count",
            "Finished prefill requests whose blocks were freed before any decode read them.",
        ),
        ("pushes", "pushes", "count", "Loads the prefill pushed layer by layer (decode)."),
        (
            "push_overlapped_bytes",
            "push_overlapped_bytes",
            "sum",
            "Pushed KV bytes whose write started while the prefill's forward was running.",
        ),
    )


class StorePromMetrics(PromMetrics):
    PREFIX = "vllm:mooncake_connectors_store_"
    SPECS = (
        ("load_seconds", "load_seconds", "seconds", "One request's KV load from the store."),
        ("load_seconds", "loads", "count", "Requests that loaded KV from the store."),
        ("load_bytes", "load_bytes", "sum", "KV bytes loaded from the store."),
        ("load_blocks", "load_blocks", "sum", "Blocks loaded from the store (all layers)."),
        ("failed_loads", "failed_loads", "count", "Loads that failed (blocks recomputed)."),
        ("save_seconds", "save_seconds", "seconds", "One request's KV save to the store."),
        ("save_bytes", "save_bytes", "sum", "KV bytes saved to the store."),
        ("save_blocks", "save_blocks", "sum", "Blocks saved to the store."),
        ("skipped_blocks", "skipped_blocks", "sum", "Blocks not saved: the store had them."),
        ("failed_saves", "failed_saves", "count", "Saves that failed."),
    )
