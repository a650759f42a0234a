"""The soak in CI: ``mooncake-connectors soak --minutes 2`` (real processes, faults every 12 s:
a server killed and restarted, the master killed and restarted, a link flap, a lossy spell).
No acknowledged put may be lost, no read may be wrong, and open fds must stay flat: per process
(incarnation), the last sample may exceed the first by a margin that tolerates connections
being re-made, not a descriptor per operation (thousands of operations run)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

FDS_MARGIN = 40


def test_two_minute_soak_loses_nothing_and_keeps_fds_flat(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    r = subprocess.run(
        [sys.executable, "-m", "mooncake_connectors", "soak", "--minutes", "2",
         "--fault-every", "12", "-o", str(out)],
        capture_output=True, text=True, timeout=170, check=False,
    )  # fmt: skip
    assert out.exists(), r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["acknowledged_puts_lost"] == 0, report["lost_keys"]
    assert report["corrupt_reads"] == 0
    assert {f["fault"] for f in report["faults"]} == {"server", "flap", "master", "lossy"}
    ops = sum(m.get("put", {}).get("ops", 0) + m.get("get", {}).get("ops", 0)
              for m in report["per_minute"])  # fmt: skip
    assert ops >= 1000
    assert sum(f["verified_keys"] for f in report["faults"]) > 0
    for proc, st in report["flat"].items():
        if st["samples"] >= 3:
            assert st["fds_last"] <= st["fds_first"] + FDS_MARGIN, (proc, st)
    assert r.returncode == 0, r.stderr[-3000:]
