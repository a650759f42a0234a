"""The README's main job, ``mooncake-connectors demo``, run as a user runs it (smaller)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/bootstrap --vllm)")

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def test_demo_command(tmp_path: Path) -> None:
    report_path = tmp_path / "demo.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "mooncake_connectors",
            "demo",
            "--prompts",
            "3",
            "--min-tokens",
            "300",
            "--max-prompt-tokens",
            "600",
            "--max-tokens",
            "8",
            "--work-dir",
            str(tmp_path / "work"),
            "--output",
            str(report_path),
        ],
        capture_output=True,
        text=True,
        timeout=800,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert (
        "tokens identical to the single engine: 3/3 disaggregated, 3/3 disaggregated store hit,"
        in run.stdout
    )
    # one line explaining each column
    for column in ("single engine: ", "disaggregated: ", "+ store hit: "):
        assert any(line.startswith(column) for line in run.stdout.splitlines()), column
    report = json.loads(report_path.read_text())
    assert report["all_identical"] is True
    assert report["prompt_tokens"] == [300, 450, 600]
    got, total = map(int, report["decode_prompt_tokens_from_transfer"].split("/"))
    assert total == 1350
    assert got >= total - 3 * 16  # all but at most the last partial block of each prompt
    # The repeat: the prefill engine (prefix caching off) loaded the prompts' full blocks from
    # the store instead of computing them (vLLM's CPU block size here is 128 tokens).
    from_store = report["one_at_a_time"]["disaggregated_store_hit"][
        "prefill_prompt_tokens_from_store"
    ]
    assert from_store >= total - 3 * 128
    for way in ("single_engine", "disaggregated", "disaggregated_store_hit"):
        assert report["one_at_a_time"][way]["ttft_ms_mean"] > 0
    for way in ("single_engine", "disaggregated"):
        assert report["overlapping"][way]["output_tokens_per_s"] > 0
        assert report["overlapping"][way]["longest_pause_ms_mean"] > 0
    # every engine process is gone
    ps = subprocess.run(["pgrep", "-f", str(tmp_path / "work")], capture_output=True, text=True)
    assert ps.stdout.strip() == ""
