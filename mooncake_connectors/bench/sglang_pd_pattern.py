"""``bench sglang-pd --pattern``: the engine calls SGLang's Mooncake PD sender makes, no SGLang.

For one request SGLang's ``MooncakeKVManager._send_kvcache_generic`` issues one
``batch_transfer_sync_write(session, srcs, dsts, lengths)``: for every K and V layer buffer (plain
MHA, positional pairing), one block per run of consecutive page indices (``group_concurrent_
contiguous``), ``item_len`` (one page) times the run's length; then ``send_aux`` one more call
with one block per aux buffer. This harness issues exactly that list through Mooncake's Python
API, from this process (the prefill) to a target process holding the decode's registered buffers,
on the same script for each engine: our facade (``mooncake_connectors.compat.TransferEngine``,
TCP only or default transports) and Mooncake's wheel (``mooncake.engine.TransferEngine``), protocol
tcp, P2PHANDSHAKE, 127.0.0.1. Used where SGLang's processes cannot be started in the time at hand
(the full flow is :mod:`.sglang_pd`); it measures the data path, not SGLang's control messages.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
from typing import Any

from .procs import loadavg, machine

_TARGET = """
import sys, numpy as np
kind, size = sys.argv[1], int(sys.argv[2])
if kind == "mooncake":
    from mooncake.engine import TransferEngine
    te = TransferEngine()
else:
    from mooncake_connectors.compat import TransferEngine
    te = TransferEngine(transports=None if kind == "ours" else "tcp")
assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
buf = np.zeros(size, dtype=np.uint8)
assert te.register_memory(buf.ctypes.data, size) == 0
print(te.get_rpc_port(), buf.ctypes.data, flush=True)
sys.stdin.read()
"""


def _engine(kind: str) -> Any:
    if kind == "mooncake":
        from mooncake.engine import TransferEngine as MooncakeTE

        return MooncakeTE()
    from ..compat import TransferEngine

    return TransferEngine(transports=None if kind == "ours" else "tcp")


def sglang_blocks(
    src_base: int,
    dst_base: int,
    buffers: int,
    buf_bytes: int,
    item: int,
    src: list[int],
    dst: list[int],
) -> list[tuple[int, int, int]]:
    """SGLang's block list for one request: per buffer, per run of consecutive (src, dst) pages."""
    runs: list[tuple[int, int, int]] = []  # (src page, dst page, pages)
    for s, d in zip(src, dst, strict=True):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return [
        (src_base + b * buf_bytes + s * item, dst_base + b * buf_bytes + d * item, n * item)
        for b in range(buffers)
        for s, d, n in runs
    ]


def run_pattern(
    *,
    systems: list[str],
    layers: int,
    item: int,
    src: list[int],
    dst: list[int],
    requests: int,
    rounds: int,
) -> dict[str, Any]:
    import numpy as np

    pages = max(src + dst) + 2
    buffers = 2 * layers
    buf_bytes = pages * item
    size = buffers * buf_bytes + 4096  # + the aux rows
    env = dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1")
    targets: dict[str, subprocess.Popen[str]] = {}
    engines: dict[str, tuple[Any, str, list[tuple[int, int, int]], int]] = {}
    local = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
    try:
        for kind in systems:
            proc = subprocess.Popen(
                [sys.executable, "-c", _TARGET, kind, str(size)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=env,
            )
            targets[kind] = proc
            assert proc.stdout is not None
            port, addr = proc.stdout.readline().split()
            te = _engine(kind)
            assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
            assert te.batch_register_memory([local.ctypes.data], [size]) == 0
            blocks = sglang_blocks(local.ctypes.data, int(addr), buffers, buf_bytes, item, src, dst)
            engines[kind] = (te, f"127.0.0.1:{port}", blocks, int(addr) + buffers * buf_bytes)
        samples: dict[str, list[float]] = {k: [] for k in engines}
        order = list(engines)
        import time

        aux = local.ctypes.data + buffers * buf_bytes
        for r in range(rounds + 1):
            for kind in order[r % len(order) :] + order[: r % len(order)]:
                te, session, blocks, dst_aux = engines[kind]
                srcs, dsts, lens = (list(x) for x in zip(*blocks, strict=True))
                for _ in range(requests):
                    t0 = time.perf_counter()
                    rc = te.batch_transfer_sync_write(session, srcs, dsts, lens)
                    rc2 = te.batch_transfer_sync_write(session, [aux], [dst_aux], [256])
                    dt = time.perf_counter() - t0
                    if rc != 0 or rc2 != 0:
                        raise RuntimeError(
                            f"{kind}: batch_transfer_sync_write returned {rc}, {rc2}"
                        )
                    if r:
                        samples[kind].append(dt)
        nbytes = sum(n for _, _, n in engines[order[0]][2])
        out: dict[str, Any] = {
            "bytes_per_request": nbytes,
            "blocks_per_request": len(engines[order[0]][2]),
        }
        for kind, xs in samples.items():
            med = statistics.median(xs)
            out[kind] = {
                "n": len(xs),
                "p50_ms": round(med * 1e3, 3),
                "p99_ms": round(sorted(xs)[min(len(xs) - 1, int(0.99 * len(xs)))] * 1e3, 3),
                "gb_s": round(nbytes / med / 1e9, 3),
            }
        for te, _, _, _ in engines.values():
            if hasattr(te, "close"):
                te.close()
        out["machine"], out["loadavg"] = machine(), loadavg()
        return out
    finally:
        for proc in targets.values():
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait(15)
