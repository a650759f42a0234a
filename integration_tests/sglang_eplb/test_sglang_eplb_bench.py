"""``bench moe``'s SGLang row runs end to end (small sizes) and writes valid JSON.

Both sides are SGLang's own ``eplb_algorithms.rebalance_experts``: once as SGLang answers it
(its default ``auto`` algorithm), once through the hook our plugin registers around it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("sglang")

from typer.testing import CliRunner

from mooncake_connectors.bench.moe_sglang import DEEPSEEK_V3_EXPERT_BYTES
from mooncake_connectors.cli import app


def test_bench_moe_sglang_row_writes_valid_json(tmp_path: Path) -> None:
    out = tmp_path / "moe_sglang.json"
    result = CliRunner().invoke(
        app,
        [
            "bench", "moe", "--only", "sglang", "--engine-experts", "16",
            "--engine-cases", "4x24x1x4,4x24x2x4", "--output", str(out),
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert set(data) == {"machine", "deepseek_reference", "sglang_eplb_policy"}
    row = data["sglang_eplb_policy"]
    assert row["available"] is True and row["logical_experts"] == 16
    assert [(c["ranks"], c["physical_experts"], c["nodes"]) for c in row["cases"]] == [
        (4, 24, 1),
        (4, 24, 2),
    ]
    for case in row["cases"]:
        assert case["sglang_algorithm"] == "deepseek_hierarchical"  # SGLang's "auto" here
        for side in ("sglang_default", "ours"):
            got = case[side]
            assert 1.0 <= got["max_over_mean_mean"] <= got["max_over_mean_worst"]
            assert got["rearranged_bytes"] == got["cross_rank_moves"] * DEEPSEEK_V3_EXPERT_BYTES
            assert 0 < got["cross_rank_moves"] <= case["windows"] * case["layers"] * 24
        ratio = case["ours_over_sglang"]
        assert ratio["max_over_mean_mean"] == round(
            case["ours"]["max_over_mean_mean"] / case["sglang_default"]["max_over_mean_mean"], 4
        )


def test_bench_moe_refuses_a_bad_case_or_section() -> None:
    bad_case = CliRunner().invoke(
        app, ["bench", "moe", "--only", "sglang", "--engine-cases", "4x25x1x4"]
    )
    assert bad_case.exit_code == 2 and "slots must divide over ranks" in bad_case.output
    bad_section = CliRunner().invoke(app, ["bench", "moe", "--only", "sglang,nope"])
    assert (
        bad_section.exit_code == 2 and "unknown bench moe sections ['nope']" in bad_section.output
    )
