"""``bench transfer --transports rdma``: our per-slice cost on the rdma path, in µs per slice.

One engine in one process moves bytes between two of its own buffers over its rdma transport
(connect exchange, rails, spraying, completions: the whole path), so every rdma slice costs
what our code spends on it plus what the verbs below spend. A second loop drives the same verbs
directly (post, selective signalling, poll on one connected QP) with none of our code: its µs
per slice is the floor of the verbs module in use. Ours minus the floor is our overhead per
slice, which bounds the slice rate one process can drive: at a 400 Gbps NIC a 64 KiB slice
leaves 1.31 µs.

With ``--rdma-verbs fake_verbs`` (tests/ on PYTHONPATH) this runs on the test-only fake; with
FAKE_VERBS_INSTANT=1 the fake completes a request when it is posted and moves no bytes, as a NIC
that needs no CPU would, so what is left is the CPU our code spends per slice.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from ..config import EngineConfig
from ..types import TransferOp


def _floor(verbs: str, slice_size: int, buf: Any, n: int) -> tuple[float, float]:
    """Wall and CPU seconds for ``n`` WRITEs of ``slice_size`` through the verbs alone."""
    from ..transfer_core.transports.rdma.verbs import Verbs

    v = Verbs(verbs)
    names = v.devices()
    a = v.open(names[0], 1, 0)
    b = v.open(names[-1], 1, 0)
    qa, qb = a.create_qp(128), b.create_qp(128)
    try:
        a.connect(qa, _addr(qb, b), 1)
        b.connect(qb, _addr(qa, a), 1)
        ma = a.reg_mr(buf.addr, buf.size, v.REMOTE_ACCESS)
        mb = b.reg_mr(buf.addr, buf.size, v.REMOTE_ACCESS)
        span = buf.size // 2
        t0, c0 = time.perf_counter(), time.process_time()
        posted = done = 0
        while done < n:
            while posted < n and posted - done < 128:
                off = (posted * slice_size) % span
                signaled = posted % 16 == 15 or posted == n - 1
                a.post(qa, posted, True, buf.addr + off, slice_size, ma.lkey,
                       buf.addr + span + off, mb.rkey, signaled)  # fmt: skip
                posted += 1
            for c in a.poll(16):
                done = c.wr_id + 1
        elapsed = (time.perf_counter() - t0, time.process_time() - c0)
        for m in (ma, mb):
            a.destroy(m)
        return elapsed
    finally:
        a.destroy(qa)
        b.destroy(qb)
        a.close()
        b.close()


def _addr(qp: Any, nic: Any) -> Any:
    from ..transfer_core.transports.rdma.verbs import QpAddr

    return QpAddr(int(qp.qp_num), 1, nic.gid, nic.lid)


def run_rdma_overhead(
    verbs: str = "pyverbs",
    sizes: list[int] | None = None,
    rounds: int = 5,
    slice_size: int = 64 * 1024,
    nic_gbps: float = 400.0,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    from ..transfer_core.engine import TransferEngine, TransferRequest

    sizes = sizes or [64 * 1024, 1 << 20, 16 << 20]
    span = max(sizes)
    cfg = EngineConfig(
        metadata="memory",
        transports=("rdma",),
        transport_settings={"rdma": {"verbs": verbs, "slice_size": slice_size}},
        timeout=120,
    )
    per: dict[str, list[float]] = {}
    total = rounds * (2 * len(sizes) + 1)
    step = 0
    with TransferEngine(cfg) as eng:
        buf = eng.allocate_buffer(2 * span)
        seg = eng.segment_name
        # connect every rail before anything is timed
        eng.transfer([TransferRequest(TransferOp.WRITE, seg, buf.addr, buf.addr + span, span)])
        for _ in range(rounds):
            for size in sizes:
                ops = max(1, (32 << 20) // size)
                for op in (TransferOp.WRITE, TransferOp.READ):
                    reqs = [TransferRequest(op, seg, buf.addr, buf.addr + span, size)]
                    t0, c0 = time.perf_counter(), time.process_time()
                    for _ in range(ops):
                        eng.transfer(reqs)
                    slices = ops * -(-size // slice_size)
                    wall = (time.perf_counter() - t0) / slices * 1e6
                    cpu = (time.process_time() - c0) / slices * 1e6
                    per.setdefault(f"ours {op.name} {size}", []).append(wall)
                    per.setdefault(f"ours {op.name} {size} cpu", []).append(cpu)
                    step += 1
                    if progress:
                        progress(step, total)
            n = (32 << 20) // slice_size
            wall, cpu = _floor(verbs, slice_size, buf, n)
            per.setdefault("verbs floor WRITE", []).append(wall / n * 1e6)
            per.setdefault("verbs floor WRITE cpu", []).append(cpu / n * 1e6)
            step += 1
            if progress:
                progress(step, total)
    table = {k: round(statistics.median(v), 2) for k, v in per.items()}
    budget = slice_size * 8 / (nic_gbps * 1e9) * 1e6
    overhead = {
        k: round(v - table["verbs floor WRITE" + (" cpu" if k.endswith("cpu") else "")], 2)
        for k, v in table.items()
        if k.startswith("ours")
    }
    return {
        "benchmark": "rdma_overhead",
        "unit": "µs per rdma slice (wall; 'cpu': CPU time of the whole process), median of rounds",
        "verbs": verbs,
        "slice_size": slice_size,
        "rounds": rounds,
        "results": table,
        "overhead_us_per_slice": overhead,
        "nic": {
            "gbps": nic_gbps,
            "budget_us_per_slice": round(budget, 3),
            "slices_per_s": round(nic_gbps * 1e9 / 8 / slice_size),
        },
        "overhead_vs_budget": {k: round(v / budget, 1) for k, v in overhead.items()},
        "max_gbps_one_process": {
            k: round(slice_size * 8 / (v * 1e-6) / 1e9, 2) for k, v in table.items() if v > 0
        },
    }
