"""The rdma transport's pyverbs path (MOONCAKE_CONNECTORS_PURE_PYTHON=1) before and after a
change, alternated in one window: process CPU per engine.transfer of one WRITE request, one
engine writing to its own buffers over the emulated NIC in instant mode.

    LD_LIBRARY_PATH=build/fake-ibverbs/<digest> FAKE_IBV_INSTANT=1 \\
    FAKE_IBV_DEVICES=mlx5_0:roce:4096,mlx5_1:roce:4096 MOONCAKE_CONNECTORS_SPIN_US=0 \\
    .venv-rdma/bin/python benchmarks/rdma_pure_before_after.py REV -o OUT.json

"before" is the package at git revision REV (``git archive`` into a temporary directory, run
with it first on PYTHONPATH), "after" the working tree; each measured in a process of its own,
alternated ``--pairs`` times. Median of 3 rounds per size per process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHILD = """
import json, os, statistics, time
os.environ["MOONCAKE_CONNECTORS_PURE_PYTHON"] = "1"
import mooncake_connectors
from mooncake_connectors.config import EngineConfig
from mooncake_connectors.types import TransferOp
from mooncake_connectors.transfer_core.engine import TransferEngine, TransferRequest
cfg = EngineConfig(metadata="memory", transports=("rdma",),
                   transport_settings={"rdma": {"slice_size": 65536}}, timeout=120)
out = {"package": mooncake_connectors.__file__, "cpu_us_per_request": {}}
with TransferEngine(cfg) as eng:
    span = 64 << 20
    buf = eng.allocate_buffer(2 * span)
    seg = eng.segment_name
    src, dst = buf.addr, buf.addr + span
    eng.transfer([TransferRequest(TransferOp.WRITE, seg, src, dst, span)])
    for size in (4096, 65536, 1 << 20):
        reqs = [TransferRequest(TransferOp.WRITE, seg, src, dst, size)]
        ops = 1000 if size < (1 << 20) else 300
        for _ in range(50):
            eng.transfer(reqs)
        v = []
        for _ in range(3):
            c0 = time.process_time()
            for _ in range(ops):
                eng.transfer(reqs)
            v.append((time.process_time() - c0) / ops * 1e6)
        out["cpu_us_per_request"][str(size)] = round(statistics.median(v), 1)
print(json.dumps(out))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("rev")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("-o", "--output", required=True)
    args = ap.parse_args()
    runs: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", args.rev, "mooncake_connectors"],
            check=True, capture_output=True,
        ).stdout  # fmt: skip
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        for i in range(args.pairs):
            for which, path in (("after", ""), ("before", tmp)):
                env = {**os.environ, "FAKE_IBV_FABRIC": f"pure{os.getpid()}{i}{which}"}
                if path:
                    env["PYTHONPATH"] = path
                got = subprocess.run(
                    [sys.executable, "-c", CHILD], env=env, cwd=path or ROOT, check=True,
                    capture_output=True, text=True, timeout=600,
                )  # fmt: skip
                res = json.loads(got.stdout.strip().splitlines()[-1])
                runs.append({"which": which, "at": time.strftime("%H:%M:%S"), **res})
    load = os.getloadavg()[0]
    Path(args.output).write_text(
        json.dumps({"benchmark": "rdma_pure_before_after", "before_rev": args.rev,
                    "loadavg_1m_after": round(load, 2), "runs": runs}, indent=2) + "\n"
    )  # fmt: skip


if __name__ == "__main__":
    main()
