#!/usr/bin/env python3
"""GPU check of the transfer engine: cuda_ipc and tcp-staged GPU transfers between two processes.

Needs one CUDA GPU and cuda-python's ``cuda.bindings``; torch with CUDA adds the baselines, the
"kernel writes, then transfer at once" ordering case and the vLLM-shaped KV case (skipped,
and said so, without it). The package is used from the working tree (PYTHONPATH) and never
installed: the built-in transports and metadata backends are found without entry points.

Device memory is made through the driver (cuMemAlloc, and VMM: cuMemCreate chunks mapped into
one larger reservation, as torch's expandable segments grow), with a guard band of known bytes
on both sides of every target; every transfer is checked by SHA-256 on both sides, and the
guards after it. Each step runs in its own ``try``; the result is one JSON object, always
written, on stdout and in $OUT/gpu_check.json (or --out). Exit status: 1 when a transfer moved a
wrong byte, touched a guard band or failed, or a step broke; 2 when only a speed target was
missed (targets are enforced only where torch's baselines were measured); 0 otherwise.

The CI rehearses this script from a copy of the tracked files over the FAKE libcuda of
tests/fake_libcuda (``--quick``). On a GPU machine, with the device tool (image: Python 3.12,
torch, cuda-bindings; no registry), download the other dependencies here as cp312 wheels into
``.whl/`` (gitignored),

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \\
        --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \\
        -d .whl msgspec pyzmq pluggy prometheus-client typer click shellingham rich \\
        markdown-it-py mdurl pygments typing-extensions numpy

then run with carry [".whl"] and the command

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \\
      && PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 python3 scripts/gpu/check_transfer.py

(timeout_s 420 leaves room for the machine's start within the session's device time).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import hashlib
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

MIB = 1 << 20
SIZES = [64 * 1024, MIB, 16 * MIB, 256 * MIB, 1024 * MIB]
QUICK = [64 * 1024, MIB + 3]
GUARD = 4096
GUARD_BYTE = 0xA5
KV = {"layers": 4, "blocks": 512, "block_size": 16, "heads": 8, "head_dim": 128}
TARGETS = {"cuda_ipc_d2d_vs_torch_d2d": 0.9, "tcp_staged_vs_tcp_host": 0.8}


# -- device memory through the driver (works on a GPU and on the fake library alike) --------
class Dev:
    """One device's primary context, through cuda.bindings. ``make_current``: make it the
    thread's current context, as torch.cuda.set_device leaves it; every call here pushes the
    context and pops it after, so it also works from a thread with another one current."""

    def __init__(self, device: int = 0, make_current: bool = True) -> None:
        from cuda.bindings import driver as cu

        self.cu, self.device = cu, device
        self.ok(cu.cuInit(0))
        self.ctx = self.ok(cu.cuDevicePrimaryCtxRetain(self.ok(cu.cuDeviceGet(device))))
        if make_current:
            self.ok(cu.cuCtxSetCurrent(self.ctx))

    @staticmethod
    def ok(res: Any) -> Any:
        err, *rest = res if isinstance(res, tuple) else (res,)
        if int(err) != 0:
            raise RuntimeError(f"driver call failed: {getattr(err, 'name', err)}")
        return rest[0] if len(rest) == 1 else (tuple(rest) or None)

    @contextlib.contextmanager
    def on(self) -> Iterator[None]:
        self.ok(self.cu.cuCtxPushCurrent(self.ctx))
        try:
            yield
        finally:
            self.ok(self.cu.cuCtxPopCurrent())

    def alloc(self, n: int) -> int:
        with self.on():
            return int(self.ok(self.cu.cuMemAlloc(n)))

    def vmm_chunks(self, total: int) -> tuple[int, list[int]]:
        """Enough separately created chunks for ``total`` bytes and one more, mapped at the
        start of a reservation twice as large (torch's expandable segments grow this way);
        returns the granularity and each chunk's address."""
        with self.on():
            return self._vmm_chunks(total)

    def _vmm_chunks(self, total: int) -> tuple[int, list[int]]:
        cu = self.cu
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.requestedHandleTypes = (
            cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        )
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.device
        opt = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        gran = int(self.ok(cu.cuMemGetAllocationGranularity(prop, opt)))
        chunks = -(-total // gran) + 1
        base = int(self.ok(cu.cuMemAddressReserve(2 * chunks * gran, 0, 0, 0)))
        access = cu.CUmemAccessDesc()
        access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = self.device
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        out = []
        for i in range(chunks):
            handle = self.ok(cu.cuMemCreate(gran, prop, 0))
            self.ok(cu.cuMemMap(base + i * gran, gran, 0, handle, 0))
            self.ok(cu.cuMemRelease(handle))  # the mapping holds it
            self.ok(cu.cuMemSetAccess(base + i * gran, gran, [access], 1))
            out.append(base + i * gran)
        return gran, out

    def free(self, addr: int) -> None:
        with self.on():
            self.ok(self.cu.cuMemFree(addr))

    def put(self, addr: int, data: np.ndarray) -> None:
        with self.on():
            self.ok(self.cu.cuMemcpyHtoD(addr, data.ctypes.data, data.nbytes))

    def get(self, addr: int, n: int) -> np.ndarray:
        out = np.empty(n, dtype=np.uint8)
        with self.on():
            self.ok(self.cu.cuMemcpyDtoH(out.ctypes.data, addr, n))
        return out


def pattern(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)


def digest(a: np.ndarray) -> str:
    return hashlib.sha256(memoryview(a)).hexdigest()


class Guarded:
    """``n`` bytes of device ("gpu", "vmm") or host ("host": memfd buffer of the engine) memory
    with GUARD bytes of GUARD_BYTE on each side; ``addr`` is the first byte of the target."""

    def __init__(self, dev: Dev, engine: Any, kind: str, n: int, seed: int) -> None:
        self.dev, self.kind, self.n = dev, kind, n
        total = n + 2 * GUARD
        self.buf = None
        if kind == "host":
            self.buf = engine.allocate_buffer(total)
            base = self.buf.addr
        elif kind == "vmm":  # the target straddles the boundary of the first two chunks
            gran, chunks = dev.vmm_chunks(total)
            base = max(chunks[0], chunks[0] + gran - GUARD - n // 2)
        else:
            base = dev.alloc(total)
        self.base, self.addr = base, base + GUARD
        self._put(base, np.full(total, GUARD_BYTE, dtype=np.uint8))
        self._put(self.addr, pattern(seed, n))
        if self.buf is None:
            engine.register_raw(base, total, location="cuda:0")

    def _put(self, addr: int, data: np.ndarray) -> None:
        if self.buf is not None:
            ctypes.memmove(addr, data.ctypes.data, data.nbytes)
        else:
            self.dev.put(addr, data)

    def _get(self, addr: int, n: int) -> np.ndarray:
        if self.buf is not None:
            return np.frombuffer(ctypes.string_at(addr, n), dtype=np.uint8)
        return self.dev.get(addr, n)

    def sha(self, offset: int = 0, n: int | None = None) -> str:
        return digest(self._get(self.addr + offset, self.n - offset if n is None else n))

    def refill(self, seed: int) -> str:
        data = pattern(seed, self.n)
        self._put(self.addr, data)
        return digest(data)

    def free(self, engine: Any) -> None:
        if self.buf is not None:
            engine.free_buffer(self.buf.addr)
            return
        engine.unregister(self.base)
        if self.kind == "gpu":
            self.dev.free(self.base)  # VMM chunks stay mapped: a few, small, until exit

    def guards_ok(self) -> bool:
        lo, hi = self._get(self.base, GUARD), self._get(self.addr + self.n, GUARD)
        return bool((lo == GUARD_BYTE).all() and (hi == GUARD_BYTE).all())


def start_engine(metadata: str, transports: tuple[str, ...]) -> Any:
    from mooncake_connectors.config import EngineConfig
    from mooncake_connectors.transfer_core import TransferEngine

    cfg = EngineConfig(metadata=metadata, transports=transports, timeout=120)
    return TransferEngine(cfg).start()


# -- the target process ----------------------------------------------------------------------
def target(metadata: str) -> None:
    dev = Dev()
    engine = start_engine(metadata, ("cuda_ipc", "shm", "tcp"))
    keep: dict[int, Guarded] = {}
    kv: dict[str, Any] = {}
    print(json.dumps({"segment": engine.segment_name}), flush=True)
    for line in sys.stdin:
        msg = json.loads(line)
        cmd = msg["cmd"]
        try:
            if cmd == "alloc":
                g = Guarded(dev, engine, msg["kind"], msg["size"], msg["seed"])
                keep[g.addr] = g
                reply: dict[str, Any] = {"addr": g.addr, "sha": g.sha()}
            elif cmd == "check":
                g = keep[msg["addr"]]
                reply = {"sha": g.sha(), "guards_ok": g.guards_ok()}
            elif cmd == "free":
                keep.pop(msg["addr"]).free(engine)
                reply = {}
            elif cmd == "kv":  # torch only: a vLLM-shaped KV cache, one tensor per layer
                import torch

                shape = (2, KV["blocks"], KV["block_size"], KV["heads"], KV["head_dim"])
                layers = {}
                for i in range(KV["layers"]):
                    g_ = torch.Generator(device="cpu").manual_seed(100 + i)
                    layers[f"l{i}"] = torch.randn(shape, generator=g_).to(torch.bfloat16).cuda()
                    engine.register(layers[f"l{i}"])
                kv.update(layers)
                reply = {"ptrs": {k: int(v.data_ptr()) for k, v in layers.items()}}
            elif cmd == "kv_sha":
                import torch

                ids = msg["blocks"]
                parts = [kv[k][:, ids].contiguous() for k in sorted(kv)]
                reply = {"sha": tensor_sha(torch.stack(parts))}
            elif cmd == "quit":
                engine.close()
                print("{}", flush=True)
                return
            else:
                reply = {"error": f"unknown command {cmd}"}
        except Exception as exc:
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), flush=True)


class Target:
    def __init__(self, metadata: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--role", "target", "--metadata", metadata],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.segment = self._read()["segment"]

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"target exited (rc={self.proc.poll()})")
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"target: {reply['error']}")
        return reply

    def call(self, cmd: str, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"cmd": cmd, **args}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.call("quit")
        finally:
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


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


def ordering(torch: Any, engine: Any, run: Run) -> dict[str, Any]:
    """A kernel writes a tensor, the transfer is issued at once (no sync by us): does the peer
    get the kernel's bytes? (The vLLM save path's hazard.)"""
    n = 64 * MIB
    remote = run.tgt.call("alloc", kind="gpu", size=n, seed=7)
    t = torch.zeros(n, dtype=torch.uint8, device="cuda")
    engine.register(t)
    t.fill_(0x3C)  # queued on torch's stream
    engine.write(run.tgt.segment, int(t.data_ptr()), remote["addr"], n, timeout=120)
    want = digest(np.full(n, 0x3C, dtype=np.uint8))
    there = run.tgt.call("check", addr=remote["addr"])
    ok = there["sha"] == want and there["guards_ok"]
    if not ok:
        run.bad.append("ordering: the transfer did not see the kernel's bytes")
    return {"bytes_and_guards_ok": ok}


def tensor_sha(t: Any) -> str:
    import torch

    return digest(t.detach().reshape(-1).view(torch.uint8).cpu().numpy())


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


def step(result: dict[str, Any], bad: list[str], name: str, fn: Callable[[], Any]) -> None:
    try:
        result[name] = fn()
    except Exception as exc:
        bad.append(f"{name}: {type(exc).__name__}: {exc}")
        result.setdefault("tracebacks", {})[name] = traceback.format_exc()


def initiator(args: argparse.Namespace, result: dict[str, Any], bad: list[str]) -> None:
    from mooncake_connectors.transfer_core import doctor
    from mooncake_connectors.transfer_core.metadata.http import MetadataHTTPServer
    from mooncake_connectors.transfer_core.transports import fast

    sizes = QUICK if args.quick else SIZES
    repeat = 1 if args.quick else 3
    import mooncake_connectors

    result["package"] = os.path.dirname(mooncake_connectors.__file__)
    step(result, bad, "doctor", lambda: [f.line() for f in doctor.check_gpus()])
    result["tcp_loops"] = "pure Python" if fast.tcp is None else "compiled (_tcp_fast)"
    torch = torch_cuda()
    result["torch"] = None if torch is None else torch.__version__
    if torch is not None:
        step(result, bad, "baseline", lambda: baselines(torch, sizes, repeat))
    dev = Dev()
    srv = MetadataHTTPServer("127.0.0.1", 0).start()
    tgt: Target | None = None
    try:
        tgt = Target(srv.url)
        run = Run(dev, tgt, sizes, repeat)
        run.bad = bad  # one list: a wrong byte is reported even if a later step breaks
        sweeps = {  # per transport: case -> (local kind, remote kind, largest size)
            "cuda_ipc": {
                "gpu_gpu": ("gpu", "gpu", 1 << 40),
                "gpu_vmm": ("gpu", "vmm", 16 * MIB),
                "vmm_gpu": ("vmm", "gpu", 16 * MIB),
                "host_gpu": ("host", "gpu", 256 * MIB),
                "gpu_memfd_host": ("gpu", "host", 256 * MIB),
            },
            "tcp": {
                "gpu_gpu_staged": ("gpu", "gpu", 256 * MIB),
                "host_host": ("host", "host", 256 * MIB),
            },
        }
        for name, cases in sweeps.items():
            engine = start_engine(srv.url, (name,))
            part: dict[str, Any] = {}
            try:
                for case, (lk, rk, cap) in cases.items():
                    step(part, bad, case, functools.partial(run.sweep, engine, lk, rk, cap))
                if torch is not None:
                    step(part, bad, "ordering", functools.partial(ordering, torch, engine, run))
                    kv = functools.partial(kv_round_trip, torch, engine, run)
                    step(part, bad, "kv_round_trip", kv)
            finally:
                engine.close()
            result[name] = part
    finally:
        if tgt is not None:
            tgt.close()
        srv.stop()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", default="initiator")
    ap.add_argument("--metadata", default="")
    ap.add_argument("--quick", action="store_true", help="two small sizes, one repeat (CI)")
    ap.add_argument("--out", default=os.environ.get("OUT", ""), help="folder for gpu_check.json")
    args = ap.parse_args()
    if args.role == "target":
        target(args.metadata)
        return 0
    t0 = time.monotonic()
    result: dict[str, Any] = {}
    bad: list[str] = []
    missed: list[str] = []
    try:
        step(result, bad, "run", lambda: initiator(args, result, bad))
        result.pop("run", None)
        result["targets"] = targets(result)
        for name, floor in TARGETS.items():
            for n, ratio in result["targets"].get(name, {}).items():
                if ratio < floor:
                    missed.append(f"{name} at {n} bytes: {ratio} < {floor}")
    finally:
        result["failures"], result["missed_targets"] = bad, missed
        result["elapsed_s"] = round(time.monotonic() - t0, 1)
        text = json.dumps(result, indent=1)
        print(text, flush=True)
        if args.out:
            with open(os.path.join(args.out, "gpu_check.json"), "w") as fh:
                fh.write(text)
    return 1 if bad else 2 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
