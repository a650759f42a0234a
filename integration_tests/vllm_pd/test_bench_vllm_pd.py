"""``bench vllm-pd`` against vLLM's own default PD connector, NixlConnector (CPU buffer, UCX),
run as a user runs it: real engines on the tiny model, one short round."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/bootstrap --vllm)")
pytest.importorskip("nixl", reason="nixl is not installed (scripts/bootstrap --vllm installs it)")

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def test_ours_beside_nixl(tmp_path: Path) -> None:
    out = tmp_path / "pd.json"
    subprocess.run(
        [
            *(sys.executable, "-m", "mooncake_connectors", "bench", "vllm-pd"),
            *("--lengths", "300", "--rounds", "2", "--max-tokens", "4"),
            *("--no-push", "--no-mooncake", "--no-tcp-only", "--layers", "2"),
            *("--work-dir", str(tmp_path / "work"), "--output", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=800,
        check=True,
    )
    result = json.loads(out.read_text())
    nixl = next(v for k, v in result["results"].items() if "NixlConnector" in k)["300"]
    ours = next(v for k, v in result["results"].items() if "MooncakeConnectorsPD" in k)["300"]
    for name, system in (("nixl", nixl), ("ours", ours)):
        assert system["tokens_identical"], system  # the KV came over and decoding used it
        # each read was logged (a miss here names the engines' log lines that say why)
        assert system["transfers_logged"] >= 2 and system["mb"] > 0, (
            name,
            system,
            _log_lines(tmp_path / "work"),
        )
        assert len(system["decode_leg_ms_all"]) == 2
    assert nixl["mb"] == pytest.approx(ours["mb"], rel=0.01)  # the same KV both ways
    for field in ("decode_leg", "ttft", "transfer"):
        assert result[f"{field}_ratio_ours_over_nixl"]["300"] > 0


def _log_lines(work: Path) -> dict[str, list[str]]:
    """The engines' lines about KV transfers, failures and recomputation, per log file."""
    pick = re.compile(r"KV Transfer metrics|recompute|[Ff]ail|[Ee]rror|[Tt]imeout")
    return {
        p.name: [line for line in p.read_text(errors="replace").splitlines() if pick.search(line)][
            -40:
        ]
        for p in sorted(work.rglob("*.log"))
    }
