"""Mooncake-format request traces (``FAST25-release/traces/*.jsonl``).

One JSON object per line with exactly ``timestamp`` (ms, ascending), ``input_length``,
``output_length`` and ``hash_ids`` (chained prefix-block ids, 512 tokens a block). A malformed
line is a :class:`~mooncake_connectors.errors.ConfigError` naming the line, never a silent skip:
a replay over a quietly truncated trace would report numbers for a different workload.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator
from pathlib import Path

from ..errors import ConfigError

TRACE_BLOCK_TOKENS = 512


@dataclasses.dataclass(frozen=True)
class TraceRequest:
    """One request of a trace, arrival in seconds from the start of the replay."""

    request_id: int
    arrival_s: float
    input_tokens: int
    output_tokens: int
    block_hashes: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.request_id < 0:
            raise ConfigError("request_id must be >= 0", request_id=self.request_id)
        if not math.isfinite(self.arrival_s) or self.arrival_s < 0:
            raise ConfigError("arrival_s must be a finite time >= 0", arrival_s=self.arrival_s)
        if self.input_tokens <= 0:
            raise ConfigError("input_tokens must be > 0", input_tokens=self.input_tokens)
        if self.output_tokens <= 0:
            raise ConfigError("output_tokens must be > 0", output_tokens=self.output_tokens)


def parse_trace_line(line: str, request_id: int, speedup: float = 1.0) -> TraceRequest:
    """Parse one trace line; ``speedup`` > 1 compresses arrival times (a heavier load)."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"trace line {request_id + 1} is not JSON: {exc.msg}") from exc
    if not isinstance(obj, dict):
        raise ConfigError(f"trace line {request_id + 1} is not a JSON object")
    missing = {"timestamp", "input_length", "output_length", "hash_ids"} - obj.keys()
    if missing:
        raise ConfigError(f"trace line {request_id + 1} lacks {sorted(missing)}")
    ts, n_in, n_out, hashes = (
        obj["timestamp"],
        obj["input_length"],
        obj["output_length"],
        obj["hash_ids"],
    )
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (ts, n_in, n_out)):
        raise ConfigError(f"trace line {request_id + 1}: timestamp/lengths must be integers")
    if not isinstance(hashes, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) for h in hashes
    ):
        raise ConfigError(f"trace line {request_id + 1}: hash_ids must be a list of integers")
    if len(hashes) != math.ceil(n_in / TRACE_BLOCK_TOKENS):
        raise ConfigError(
            f"trace line {request_id + 1}: {len(hashes)} hash_ids for {n_in} tokens, "
            f"expected ceil({n_in}/{TRACE_BLOCK_TOKENS})"
        )
    return TraceRequest(
        request_id=request_id,
        arrival_s=ts / 1000.0 / speedup,
        input_tokens=n_in,
        output_tokens=n_out,
        block_hashes=tuple(hashes),
    )


def iter_trace(
    path: str | Path, limit: int | None = None, speedup: float = 1.0
) -> Iterator[TraceRequest]:
    """Yield the first ``limit`` requests (all when None) in arrival order."""
    if limit is not None and limit <= 0:
        raise ConfigError("limit must be > 0", limit=limit)
    if not math.isfinite(speedup) or speedup <= 0:
        raise ConfigError("speedup must be a finite number > 0", speedup=speedup)
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"trace file not found: {p}", path=str(p))
    last = -math.inf
    rid = 0
    with p.open() as fh:
        for line in fh:
            if not line.strip():
                continue
            req = parse_trace_line(line, rid, speedup)
            if req.arrival_s < last:
                raise ConfigError(f"trace line {rid + 1}: timestamps must be ascending")
            last = req.arrival_s
            yield req
            rid += 1
            if limit is not None and rid >= limit:
                return


def load_trace(
    path: str | Path, limit: int | None = None, speedup: float = 1.0
) -> list[TraceRequest]:
    """Read a whole trace (see :func:`iter_trace`); an empty trace is a ConfigError."""
    reqs = list(iter_trace(path, limit, speedup))
    if not reqs:
        raise ConfigError(f"trace {path} has no requests", path=str(path))
    return reqs
