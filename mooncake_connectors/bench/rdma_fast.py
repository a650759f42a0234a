"""``bench transfer --transports rdma --rdma-fast``: the CPU the rdma data path spends, compiled
(``_rdma_fast``: chained WRs, one doorbell per rail, C polling without the GIL) and pyverbs
(``MOONCAKE_CONNECTORS_PURE_PYTHON=1``: one pyverbs post per WR), in one process.

It runs on whatever libibverbs the process loaded. Meant for the emulated NIC
(tests/fake_ibverbs, built by tests/fake_ibverbs_lib.build()) in instant mode, where a WR that
passes the NIC's checks completes at once and moves no bytes, so what is measured is our CPU:
  LD_LIBRARY_PATH=build/fake-ibverbs/<digest> FAKE_IBV_INSTANT=1 FAKE_IBV_FABRIC=bench \\
  FAKE_IBV_DEVICES=mlx5_0:roce:4096,mlx5_1:roce:4096 mooncake-connectors bench transfer \\
  --transports rdma --rdma-fast --sizes 4K,64K,1M,16M,64M
One engine writes to its own buffers (loopback over every rail). Paths: ``compiled`` (the
default: a request up to the engine's slice size goes on direct QPs, transports/rdma/direct.py),
``compiled_rails`` (the same with ``direct_qps`` off: every request on the rails) and ``python``.
Per size and path: ``cpu_us_per_request`` (process CPU per engine.transfer of one request),
``cpu_us_per_wr`` (that over the request's 64 KiB WRs), ``direct_share`` (of its WRs, those that
went on direct QPs), the same for the rails alone (``rail_*``: Transport.submit of
prepared slices, inline, no engine), and GB/s per NIC (wall, CPU-bound here). ``scatter``: a
vLLM-shaped batch (layers x K/V x blocks of 32 KiB) submitted at once, with the remote blocks in
the local order (adjacent: coalesced) or shuffled (no two adjacent), CPU ms until all complete:
submitted for the rails' threads to complete (``submit``), and by a caller that waits for it
(``inline``: ``submit(..., inline_ok=True)``, what ``engine.run`` does, e.g. a PD decode's KV
load; on direct QPs where they are on); and through the engine (``engine``: one ``engine.run``
of the blocks as requests, the engine's per-request work included).
"""

from __future__ import annotations

import os
import random
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

from ..config import EngineConfig
from ..types import TransferOp

WR = 64 * 1024


def _slices(eng: Any, op: TransferOp, pairs: list[tuple[int, int, int]], done: Any) -> list[Any]:
    from ..transfer_core.transport import Slice

    desc = eng.refresh_peer(eng.segment_name)
    deadline = time.monotonic() + 60
    out = []
    for local, remote, n in pairs:
        s = Slice(op, local, remote, n, deadline, done)
        s.region = desc.find_region(remote, n)
        out.append(s)
    return out


class _Done:
    def __init__(self, n: int) -> None:
        self.left = n
        self.err: object = None
        self.ev = threading.Event()
        self.lock = threading.Lock()

    def __call__(self, s: Any, err: object) -> None:
        with self.lock:
            self.left -= 1
            if err is not None:
                self.err = err
            if self.left == 0:
                self.ev.set()


def _wrs(rdma: Any, seg: str) -> tuple[int, int]:
    """(WRs carried on direct QPs, on the rails' own QPs) to ``seg`` so far."""
    rails = rdma._peers[seg].rails
    direct = sum(r.direct_carried for r in rails)
    return direct, sum(r.carried for r in rails)


def _await_direct(eng: Any, rdma: Any, seg: str, src: int, dst: int) -> bool:
    """Small requests until every direct QP to ``seg`` is connected (in the background, on
    first need); False on the paths without them."""
    from ..transfer_core.transports.rdma.direct import READY

    if rdma._direct is None:
        return False
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        eng.write(seg, src, dst, 4096)
        rails = rdma._peers[seg].rails
        if all(r.direct is not None and r.direct.state == READY for r in rails):
            return True
        time.sleep(0.01)
    raise RuntimeError("rdma bench: the direct QPs did not connect within 20 s")


def _one_path(
    pure: bool, sizes: list[int], rounds: int, scatter: tuple[int, int], direct: bool = True
) -> dict[str, Any]:
    from ..transfer_core.engine import TransferEngine, TransferRequest
    from ..transfer_core.transports.fast import PURE_ENV

    if pure:
        os.environ[PURE_ENV] = "1"
    else:
        os.environ.pop(PURE_ENV, None)
    layers, blocks = scatter
    block = 32 * 1024
    span = max(max(sizes), layers * 2 * blocks * block)
    cfg = EngineConfig(
        metadata="memory",
        transports=("rdma",),
        transport_settings={"rdma": {"slice_size": WR, "direct_qps": direct}},
        timeout=120,
    )
    out: dict[str, Any] = {}
    with TransferEngine(cfg) as eng:
        rdma: Any = next(t for t in eng.transports if t.name == "rdma")
        nics = len(rdma.nics)
        compiled = all(st.nic.compiled for st in rdma.nics.values())
        out["compiled"] = compiled
        out["nics"] = nics
        buf = eng.allocate_buffer(2 * span)
        seg = eng.segment_name
        src, dst = buf.addr, buf.addr + span
        eng.transfer([TransferRequest(TransferOp.WRITE, seg, src, dst, span)])  # connect all
        out["direct_qps"] = _await_direct(eng, rdma, seg, src, dst)
        peer = eng.refresh_peer(seg)
        per_size: dict[str, Any] = {}
        for size in sizes:
            ops = max(4, min(2000, (128 << 20) // size))
            wrs = -(-size // WR)
            req: dict[str, list[float]] = {}
            for _ in range(rounds):
                reqs = [TransferRequest(TransferOp.WRITE, seg, src, dst, size)]
                w0 = _wrs(rdma, seg)
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(ops):
                    eng.transfer(reqs)
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                w1 = _wrs(rdma, seg)
                direct_wrs, rail_wrs = w1[0] - w0[0], w1[1] - w0[1]
                req.setdefault("direct", []).append(direct_wrs / max(1, direct_wrs + rail_wrs))
                req.setdefault("cpu", []).append(cpu / ops * 1e6)
                req.setdefault("wall", []).append(wall / ops * 1e6)
                req.setdefault("gbps", []).append(size * ops / wall / 1e9 / nics)
                # the transport alone: prepared slices, submitted inline (no engine around it)
                cpu_r = 0.0
                for _ in range(ops):
                    done = _Done(1)
                    (s,) = _slices(eng, TransferOp.WRITE, [(src, dst, size)], done)
                    c1 = time.process_time()
                    rdma.submit(peer, [s], inline_ok=True)
                    if not done.ev.wait(60) or done.err is not None:
                        raise RuntimeError(f"rail bench: {done.err}")
                    cpu_r += time.process_time() - c1
                req.setdefault("rail", []).append(cpu_r / ops * 1e6)
            med = {k: statistics.median(v) for k, v in req.items()}
            per_size[str(size)] = {
                "wrs_64k": wrs,
                "requests_per_round": ops,
                "cpu_us_per_request": round(med["cpu"], 2),
                "cpu_us_per_wr": round(med["cpu"] / wrs, 3),
                "wall_us_per_request": round(med["wall"], 2),
                "direct_share": round(med["direct"], 3),
                "gb_per_s_per_nic": round(med["gbps"], 3),
                "rail_cpu_us_per_request": round(med["rail"], 2),
                "rail_cpu_us_per_wr": round(med["rail"] / wrs, 3),
            }
        out["sizes"] = per_size
        out["scatter"] = _scatter(eng, rdma, peer, src, dst, layers, blocks, block, rounds)
    return out


def _scatter(
    eng: Any, rdma: Any, peer: Any, src: int, dst: int, layers: int, blocks: int, block: int,
    rounds: int,
) -> dict[str, Any]:  # fmt: skip
    from ..transfer_core.engine import TransferRequest

    n = layers * 2 * blocks
    res: dict[str, Any] = {"layers": layers, "kv": 2, "blocks_per_layer": blocks,
                           "block_bytes": block, "blocks": n}  # fmt: skip
    order = list(range(blocks))
    shuffled = order[:]
    random.Random(7).shuffle(shuffled)
    for name, remote_order in (("adjacent", order), ("shuffled", shuffled)):
        cpu_ms: list[float] = []
        submit_ms: list[float] = []
        inline_ms: list[float] = []
        pairs = []
        for lk in range(layers * 2):  # (layer, K or V): one contiguous span each side
            base = lk * blocks * block
            pairs += [(src + base + i * block, dst + base + j * block, block)
                      for i, j in zip(order, remote_order, strict=True)]  # fmt: skip
        for _ in range(rounds):
            for inline in (False, True):
                done = _Done(n)
                slices = _slices(eng, TransferOp.WRITE, pairs, done)
                c0, t0 = time.process_time(), time.thread_time()
                rdma.submit(peer, slices, inline_ok=inline)
                if not inline:
                    submit_ms.append((time.thread_time() - t0) * 1e3)
                if not done.ev.wait(120) or done.err is not None:
                    raise RuntimeError(f"scatter bench: {done.err}")
                (inline_ms if inline else cpu_ms).append((time.process_time() - c0) * 1e3)
        engine_ms: list[float] = []
        reqs = [TransferRequest(TransferOp.WRITE, eng.segment_name, lo, ro, ln)
                for lo, ro, ln in pairs]  # fmt: skip
        for _ in range(rounds):
            c0 = time.process_time()
            eng.run(reqs, timeout=120).raise_for_status()
            engine_ms.append((time.process_time() - c0) * 1e3)
        res[name] = {
            "cpu_ms_planned_posted_completed": round(statistics.median(cpu_ms), 2),
            "submit_thread_cpu_ms": round(statistics.median(submit_ms), 2),
            "inline_cpu_ms_planned_posted_completed": round(statistics.median(inline_ms), 2),
            "engine_run_cpu_ms": round(statistics.median(engine_ms), 2),
        }
    return res


def run_rdma_fast(
    sizes: list[int] | None = None,
    rounds: int = 3,
    scatter: tuple[int, int] = (32, 320),
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    from ..transfer_core.transports.fast import spin_us

    sizes = sizes or [4096, WR, 1 << 20, 16 << 20, 64 << 20]
    load_before = os.getloadavg()
    paths: dict[str, Any] = {}
    runs = (("compiled", False, True), ("compiled_rails", False, False), ("python", True, False))
    for step, (name, pure, direct) in enumerate(runs):
        paths[name] = _one_path(pure, sizes, rounds, scatter, direct)
        if progress:
            progress(step + 1, len(runs))
    for name in ("compiled", "compiled_rails"):
        if not paths[name]["compiled"]:
            paths[name]["note"] = "_rdma_fast is not built here: this is the pyverbs path too"
    return {
        "benchmark": "rdma_fast_overhead",
        "unit": "process CPU µs (or ms) per request / per 64 KiB WR; median of rounds",
        "libibverbs": os.environ.get("LD_LIBRARY_PATH", "(system)"),
        "instant": os.environ.get("FAKE_IBV_INSTANT", ""),
        "devices": os.environ.get("FAKE_IBV_DEVICES", ""),
        "rounds": rounds,
        "wr_bytes": WR,
        "spin_us": spin_us(),
        "cpus": os.cpu_count(),
        "loadavg_1m_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "paths": paths,
    }
