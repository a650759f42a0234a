"""PD transfer statistics in vLLM's connector-stats channel.

Workers hand a snapshot to vLLM each step (``get_kv_connector_stats``); vLLM aggregates them and
logs ``KV Transfer metrics: ...`` at its stats interval. The transfer engine's own Prometheus
metrics (``metrics_port``) count bytes, requests and latency per transport underneath.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

_KEYS = ("load_seconds", "load_bytes", "load_requests", "failed_loads", "expired_leases")


@dataclasses.dataclass
class PDStats(KVConnectorStats):  # type: ignore[misc]  # Any without vLLM
    """Lists of observations since the last snapshot (one entry per request or event)."""

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        for key in _KEYS:
            self.data.setdefault(key, [])

    def __getstate__(self) -> dict[str, Any]:  # the lock does not cross processes
        return {"data": self.data}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.data = state["data"]
        self._lock = threading.Lock()

    def record_load(self, seconds: float, nbytes: int, nrequests: int) -> None:
        with self._lock:
            self.data["load_seconds"].append(seconds)
            self.data["load_bytes"].append(nbytes)
            self.data["load_requests"].append(nrequests)

    def record_failed_load(self) -> None:
        with self._lock:
            self.data["failed_loads"].append(1)

    def record_expired_lease(self) -> None:
        with self._lock:
            self.data["expired_leases"].append(1)

    def take(self) -> PDStats | None:
        """A snapshot of what was recorded (None when nothing was), and start over."""
        with self._lock:
            if self.is_empty():
                return None
            snap = PDStats(data={k: list(v) for k, v in self.data.items()})
            self.reset()
        return snap

    def reset(self) -> None:
        for key in _KEYS:
            self.data[key] = []

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in _KEYS)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key in _KEYS:
            self.data.setdefault(key, []).extend(other.data.get(key, []))
        return self

    def reduce(self) -> dict[str, int | float]:
        secs = sorted(self.data["load_seconds"])
        n = len(secs)
        total_bytes = sum(self.data["load_bytes"])
        total_secs = sum(secs)
        return {
            "Num successful transfers": n,
            "Avg xfer time (ms)": round(1e3 * total_secs / n, 3) if n else 0,
            "P90 xfer time (ms)": round(1e3 * secs[min(n - 1, int(0.9 * n))], 3) if n else 0,
            "Avg MB per transfer": round(total_bytes / n / 2**20, 3) if n else 0,
            "Throughput (MB/s)": round(total_bytes / 2**20 / total_secs, 3) if total_secs else 0,
            "Num failed transfers": len(self.data["failed_loads"]),
            "Num KV expired reqs": len(self.data["expired_leases"]),
        }
