from __future__ import annotations

import json
from pathlib import Path

import pytest

from mooncake_connectors.conductor.trace import load_trace
from mooncake_connectors.errors import ConfigError


def write(tmp_path: Path, lines: list[object]) -> Path:
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return p


def rec(ts: int, n: int = 600, out: int = 5, hashes: list[int] | None = None) -> dict[str, object]:
    return {"timestamp": ts, "input_length": n, "output_length": out, "hash_ids": hashes or [0, 1]}


def test_reads_the_shipped_slice(trace_head: Path) -> None:
    reqs = load_trace(trace_head)
    assert len(reqs) == 600
    assert [r.request_id for r in reqs] == list(range(600))
    assert reqs[0].block_hashes[0] == 0
    assert reqs[299].arrival_s == pytest.approx(102.0)
    assert reqs[299].block_hashes == (0, 7813)


def test_limit_and_speedup(tmp_path: Path) -> None:
    p = write(tmp_path, [rec(0), rec(1000), rec(4000)])
    reqs = load_trace(p, limit=2, speedup=2.0)
    assert [r.arrival_s for r in reqs] == [0.0, 0.5]


@pytest.mark.parametrize(
    "bad",
    [
        "not json",
        "[1, 2]",
        {"timestamp": 0, "input_length": 600, "output_length": 5},
        rec(0, hashes=[0]),  # 600 tokens need 2 blocks of 512
        rec(0, n=0, hashes=[]),
        rec(0, out=0),
        {"timestamp": 0.5, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]},
    ],
)
def test_malformed_lines_raise(tmp_path: Path, bad: object) -> None:
    with pytest.raises(ConfigError):
        load_trace(write(tmp_path, [rec(0), bad]))


def test_descending_timestamps_raise(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        load_trace(write(tmp_path, [rec(10), rec(5)]))


def test_missing_or_empty_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        load_trace(tmp_path / "nope.jsonl")
    empty = tmp_path / "e.jsonl"
    empty.write_text("")
    with pytest.raises(ConfigError):
        load_trace(empty)
    with pytest.raises(ConfigError):
        load_trace(write(tmp_path, [rec(0)]), limit=0)
