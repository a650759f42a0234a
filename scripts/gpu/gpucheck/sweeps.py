"""The transfer sweeps and baselines of the GPU check: guarded READ/WRITE of each size between
the two processes, torch's own copies for comparison, and a vLLM-shaped KV round trip."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from .devmem import MIB, Dev, Guarded
from .target import KV, Target, tensor_sha

TARGETS = {"cuda_ipc_d2d_vs_torch_d2d": 0.9, "tcp_staged_vs_tcp_host": 0.8}


# -- measurements ----------------------------------------------------------------------------
def gbps(n: int, seconds: float) -> float:
    return round(n / seconds / 1e9, 2)


def best(repeat: int, fn: Callable[..., Any], *args: Any, **kw: Any) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(*args, **kw)
        times.append(time.perf_counter() - t0)
    return min(times)


class Run:
    def __init__(self, dev: Dev, tgt: Target, sizes: list[int], repeat: int) -> None:
        self.dev, self.tgt, self.sizes, self.repeat = dev, tgt, sizes, repeat
        self.bad: list[str] = []

    def sweep(
        self, engine: Any, local_kind: str, remote_kind: str, cap: int = 1 << 40
    ) -> dict[str, Any]:
        """READ then WRITE of each size up to ``cap`` between guarded local and remote
        targets; GB/s of each, every byte and both guard bands checked."""
        res: dict[str, Any] = {}
        seg = self.tgt.segment
        for i, n in enumerate(s for s in self.sizes if s <= cap):
            remote = self.tgt.call("alloc", kind=remote_kind, size=n, seed=i)
            local = Guarded(self.dev, engine, local_kind, n, seed=500 + i)
            raddr = remote["addr"]
            read_s = best(self.repeat, engine.read, seg, local.addr, raddr, n, timeout=120)
            ok_read = local.sha() == remote["sha"] and local.guards_ok()
            want = local.refill(1000 + i)
            write_s = best(self.repeat, engine.write, seg, local.addr, raddr, n, timeout=120)
            there = self.tgt.call("check", addr=raddr)
            ok_write = there["sha"] == want and there["guards_ok"] and local.guards_ok()
            if not (ok_read and ok_write):
                self.bad.append(f"{local_kind}->{remote_kind} {n}: read {ok_read} write {ok_write}")
            res[str(n)] = {
                "read_gbps": gbps(n, read_s),
                "write_gbps": gbps(n, write_s),
                "bytes_and_guards_ok": ok_read and ok_write,
            }
            local.free(engine)
            self.tgt.call("free", addr=raddr)
        return res


def torch_cuda() -> Any:
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def baselines(torch: Any, sizes: list[int], repeat: int) -> dict[str, Any]:
    out: dict[str, Any] = {"d2d_same_process": {}, "d2h_pinned": {}}

    def synced(dst: Any, src: Any) -> None:
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()

    for n in sizes:
        src = torch.empty(n, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        synced(dst, src)
        synced(host, src)
        out["d2d_same_process"][str(n)] = gbps(n, best(repeat, synced, dst, src))
        out["d2h_pinned"][str(n)] = gbps(n, best(repeat, synced, host, src))
    torch.cuda.empty_cache()
    return out


def kv_round_trip(torch: Any, engine: Any, run: Run) -> dict[str, Any]:
    """Blocks of the target's KV cache read into other block ids of ours, layer by layer,
    addressed by the connectors' own layout code; the blocks not read must stay as they were."""
    from mooncake_connectors.pd.layout import layer_layouts
    from mooncake_connectors.transfer_core import TransferRequest
    from mooncake_connectors.types import TransferOp

    ptrs = run.tgt.call("kv")["ptrs"]
    shape = (2, KV["blocks"], KV["block_size"], KV["heads"], KV["head_dim"])
    mine = {k: torch.zeros(shape, dtype=torch.bfloat16, device="cuda") for k in ptrs}
    for t in mine.values():
        engine.register(t)
    src_ids = list(range(40, 40 + 128))
    dst_ids = list(range(300, 300 + 128))
    reqs = []
    for name, t in mine.items():
        delta = ptrs[name] - int(t.data_ptr())  # same shape there: same offsets
        for lay in layer_layouts(name, t, KV["blocks"]):  # K and V planes
            for s, d in zip(src_ids, dst_ids, strict=True):
                src = lay.addr + delta + s * lay.stride
                dst = lay.addr + d * lay.stride
                reqs.append(
                    TransferRequest(TransferOp.READ, run.tgt.segment, dst, src, lay.block_bytes)
                )
    nbytes = sum(r.length for r in reqs)
    seconds = best(run.repeat, engine.transfer, reqs, timeout=120)
    got = tensor_sha(torch.stack([mine[k][:, dst_ids].contiguous() for k in sorted(mine)]))
    ok = got == run.tgt.call("kv_sha", blocks=src_ids)["sha"]
    others = [i for i in range(KV["blocks"]) if i not in set(dst_ids)]
    untouched = all(int(mine[k][:, others].count_nonzero()) == 0 for k in mine)
    if not (ok and untouched):
        run.bad.append(f"kv round trip: blocks read ok {ok}, other blocks untouched {untouched}")
    for t in mine.values():
        engine.unregister(int(t.data_ptr()))
    return {
        "requests": len(reqs),
        "bytes": nbytes,
        "gbps": gbps(nbytes, seconds),
        "bytes_ok": ok,
        "others_untouched": untouched,
    }


def targets(r: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets as ratios of this run's own figures; {} where not measured."""
    out: dict[str, Any] = {}
    try:
        base = r["baseline"]["d2d_same_process"]
        ipc = r["cuda_ipc"]["gpu_gpu"]
        out["cuda_ipc_d2d_vs_torch_d2d"] = {
            n: round(ipc[n]["read_gbps"] / base[n], 2) for n in ipc if int(n) >= 16 * MIB
        }
        staged, host = r["tcp"]["gpu_gpu_staged"], r["tcp"]["host_host"]
        out["tcp_staged_vs_tcp_host"] = {
            n: round(staged[n]["read_gbps"] / host[n]["read_gbps"], 2) for n in staged
        }
    except (KeyError, ZeroDivisionError, TypeError):
        pass
    return out
