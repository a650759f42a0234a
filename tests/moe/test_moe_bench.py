"""The ``bench moe`` command runs end to end and reports what RESULTS.md quotes."""

from __future__ import annotations

import importlib.util
import json

from typer.testing import CliRunner

from mooncake_connectors.cli import app


def test_bench_moe_command_prints_the_measurements() -> None:
    result = CliRunner().invoke(app, ["bench", "moe", "--rounds", "2"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    routing = data["routing"]
    for key in ("plain_indexing_us", "deterministic_us", "random_us"):
        assert routing[key] > 0
    assert (routing["tokens"], routing["top_k"], routing["logical_experts"]) == (4096, 8, 256)
    assert routing["rank0_dead_fallback_entries"] > 0
    placement = data["placement"]
    assert (placement["logical_experts"], placement["ranks"]) == (256, 64)
    assert placement["elastic_one_rank_loss_moves"] == placement["elastic_lost_experts"]
    assert data["deepseek_reference"] is not None
    for row in data["balance_max_over_mean"]:
        assert row["ours"] <= 1.05 * row["deepseek_reference"]
        assert row["ours"] < row["no_replication"]
    # The vLLM policy row runs where vLLM is installed (asserted in integration_tests/vllm_eplb)
    # and says why not elsewhere.
    row = data["vllm_eplb_policy"]
    if importlib.util.find_spec("vllm") is None:
        assert row["available"] is False and "vLLM not importable" in row["reason"]
    else:
        assert row["available"] is True and len(row["cases"]) == 3
    sglang_row = data["sglang_eplb_policy"]
    if importlib.util.find_spec("sglang") is None:
        assert sglang_row["available"] is False
        assert "SGLang not importable" in sglang_row["reason"]
    else:  # asserted in integration_tests/sglang_eplb
        assert sglang_row["available"] is True and len(sglang_row["cases"]) == 3
