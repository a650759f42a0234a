"""``bench sglang --mooncake-on-ours``: SGLang's own Mooncake backend on our store, in the
benchmark's process, through the ``mooncake`` alias (a fresh interpreter: the alias is process
state). The benchmark checks the bytes of every system's first round itself and exits non-zero
on a difference, so a run that answers is a run whose pages came back intact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sglang", reason="SGLang is not installed (it lives in its own venv)")
pytestmark = [pytest.mark.sglang, pytest.mark.timeout(600)]

from mooncake_connectors.config import ALIAS_ENV  # noqa: E402


def test_sglang_mooncake_backend_runs_on_our_store_in_the_bench(tmp_path: Path) -> None:
    out = tmp_path / "alias.json"
    argv = [sys.executable, "-m", "mooncake_connectors", "bench", "sglang", "--rounds", "1",
            "--cases", "small,mla", "--pages", "4", "--no-layer-first", "--mooncake-on-ours",
            "-o", str(out)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != ALIAS_ENV}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=540, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["system_mooncake"].startswith("SGLang's MooncakeStore on mooncake-connectors")
    # SGLang's backend held our facade, not the wheel's client
    assert result["mooncake_store_class"].startswith("mooncake_connectors."), result
    for case in ("small page_first", "mla page_first"):
        for op in ("batch_set_v1", "batch_exists", "batch_get_v1"):
            row = result["results"][case][op]
            assert set(row) == {"ours", "ours_tcp", "mooncake"}, row
            assert row["mooncake"]["pages_s"] > 0
        # the ratios say what they compare against: here SGLang's backend on the alias
        assert result["ratios_ours_tcp_vs_mooncake"][case]["batch_get_v1"] > 0
    assert not result["notes"], result["notes"]
