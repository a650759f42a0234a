"""What ``bench vllm-pd`` reads back: the connectors' logged transfer times, and tail figures."""

from __future__ import annotations

import re
import statistics
import time

from .launch import VllmServer

_METRICS = re.compile(
    r"KV Transfer metrics: Num successful transfers=(\d+), Avg xfer time \(ms\)=([\d.]+)"
    r".*?Avg MB per transfer=([\d.]+)"
)


class TransferLog:
    """Reads the ``KV Transfer metrics`` lines a server logged since the last call."""

    def __init__(self, server: VllmServer) -> None:
        self.server = server
        self.seen = 0

    def lines(self) -> list[tuple[int, float, float]]:
        try:
            text = self.server.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return []
        found = [_METRICS.search(t) for t in text]
        hits = [(int(m[1]), float(m[2]), float(m[3])) for m in found if m]
        return hits

    def wait(self, requests: int, timeout: float = 60.0) -> tuple[float, float, int]:
        """(ms per request, MB per request, transfers) once ``requests`` transfers are logged."""
        end = time.monotonic() + timeout
        while True:
            new = self.lines()[self.seen :]
            count = sum(n for n, _, _ in new)
            if count >= requests or time.monotonic() > end:
                break
            time.sleep(0.25)
        self.seen += len(new)
        if not count:
            return float("nan"), float("nan"), 0
        total_ms = sum(n * ms for n, ms, _ in new)
        total_mb = sum(n * mb for n, _, mb in new)
        return total_ms / requests, total_mb / requests, count


def tail(values: list[float]) -> dict[str, float] | None:
    """Median, p90, p99, max and p99 / median of ``values`` (ms); None when too few for a p99.

    Percentiles interpolate between the sorted values (``statistics.quantiles``, inclusive):
    with 50 values p99 lies between the two largest."""
    if len(values) < 2:
        return None
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    med = statistics.median(values)
    out = {"median": med, "p90": cuts[89], "p99": cuts[98], "max": max(values)}
    res = {k: round(v, 1) for k, v in out.items()}
    res["p99_over_median"] = round(cuts[98] / med, 2) if med > 0 else float("nan")
    return res


def cold_summary(per_length: dict[str, list[float]]) -> dict[str, object] | None:
    """``bench vllm-pd --cold-sizes``: each length's first request (the first of its size
    through the fresh pair) apart from the rest of its length (warmed), and the tail over every
    request, firsts included, against the targets p99 <= 2x median and no request > 3x median.
    ``per_length``: length -> its requests' ms in the order they ran. None without values."""
    runs = {k: v for k, v in per_length.items() if v}
    every = [x for v in runs.values() for x in v]
    over_all = tail(every)
    if over_all is None:
        return None
    med = statistics.median(every)
    first = {k: round(v[0], 1) for k, v in runs.items()}
    warmed = {k: round(statistics.median(v[1:]), 1) for k, v in runs.items() if len(v) > 1}
    worst = max(every)
    return {
        "requests": len(every),
        "first_of_size_ms": first,
        "warmed_median_ms": warmed,
        "first_over_warmed_median": {
            k: round(v[0] / statistics.median(v[1:]), 2)
            for k, v in runs.items()
            if len(v) > 1 and statistics.median(v[1:]) > 0
        },
        "all_requests": over_all,
        "max_over_median": round(worst / med, 2) if med > 0 else float("nan"),
        "p99_within_2x_median": over_all["p99"] <= 2 * over_all["median"],
        "max_within_3x_median": worst <= 3 * med,
    }
