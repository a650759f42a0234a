#!/usr/bin/env python3
"""GPU check of the transfer engine: cuda_ipc and tcp-staged GPU transfers between two processes.

Needs one CUDA GPU, torch with CUDA, and cuda-python's ``cuda.bindings``; the package itself is
used from the working tree (PYTHONPATH), so nothing of it is installed. Under 6 minutes; the
result is one JSON object on stdout (and in $OUT/gpu_check.json when OUT is set). Exit status 1
when a transfer moved a wrong byte or failed; the speed targets are reported, not enforced.

What it measures, both processes on cuda:0 of one host:
  * baselines of the same run: torch's same-process device-to-device copy, and the pinned
    device-to-host copy (the ceiling of anything staged through host memory);
  * ``cuda_ipc``: GPU -> GPU (READ and WRITE) from 64 KiB to 1 GiB, and host <-> GPU (pinned
    host tensor here, GPU there; GPU here, memfd host buffer there);
  * ``tcp`` with GPU memory on both ends (staged through pinned buffers on both sides), and the
    same sizes with host memory on both ends (the figure staging is held to);
  * a vLLM-shaped KV cache (layers x (K, V) x blocks x block_size x heads x head_dim, bf16):
    blocks read from the other process's KV cache into other block ids of this one, addressed
    by the connectors' own layout code, over cuda_ipc and over tcp;
every transfer is checked by SHA-256 of the bytes on both sides.

How to run it with the device tool (the H200 image has Python 3.12, torch, cuda-bindings; no
registry): download the other dependencies here as cp312 wheels into ``.whl/`` (gitignored),

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl msgspec pyzmq pluggy prometheus-client typer click shellingham rich \
        markdown-it-py mdurl pygments typing-extensions numpy

then run with carry [".whl"] and the command

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \
      && PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 python3 scripts/gpu/check_transfer.py

(timeout_s 420 leaves room for the machine's start within the session's device time).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from typing import Any

MIB = 1 << 20
SIZES = [64 * 1024, MIB, 16 * MIB, 256 * MIB, 1024 * MIB]
TCP_SIZES = [64 * 1024, MIB, 16 * MIB, 256 * MIB]
REPEAT = 3
KV = {"layers": 4, "blocks": 512, "block_size": 16, "heads": 8, "head_dim": 128}


def sha(t: Any) -> str:
    """SHA-256 of a tensor's bytes (copied to host memory for hashing)."""
    import torch

    host = t.detach().reshape(-1).view(torch.uint8).cpu().numpy()
    return hashlib.sha256(memoryview(host)).hexdigest()


def filled(n: int, seed: int, device: str) -> Any:
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).to(device)


# -- the target process ----------------------------------------------------------------------
def target(metadata: str) -> None:
    import torch

    from mooncake_connectors.config import EngineConfig
    from mooncake_connectors.transfer_core import TransferEngine

    engine = TransferEngine(
        EngineConfig(metadata=metadata, transports=("cuda_ipc", "shm", "tcp"), timeout=60)
    ).start()
    keep: dict[int, Any] = {}
    print(json.dumps({"segment": engine.segment_name}), flush=True)
    for line in sys.stdin:
        msg = json.loads(line)
        cmd = msg["cmd"]
        try:
            if cmd == "alloc":
                if msg["kind"] == "gpu":
                    t = filled(msg["size"], msg["seed"], "cuda:0")
                    engine.register(t)
                    addr = int(t.data_ptr())
                else:  # memfd-backed host memory
                    buf = engine.allocate_buffer(msg["size"])
                    buf.array[:] = filled(msg["size"], msg["seed"], "cpu").numpy()
                    t, addr = torch.from_numpy(buf.array), buf.addr
                keep[addr] = t
                reply: dict[str, Any] = {"addr": addr, "sha": sha(t)}
            elif cmd == "sha":
                t = keep[msg["addr"]]
                reply = {"sha": sha(t[msg.get("offset", 0) : msg.get("offset", 0) + msg["n"]])}
            elif cmd == "kv":
                shape = (2, KV["blocks"], KV["block_size"], KV["heads"], KV["head_dim"])
                layers = {}
                for i in range(KV["layers"]):
                    g = torch.Generator(device="cpu").manual_seed(100 + i)
                    layers[f"l{i}"] = torch.randn(shape, generator=g).to(torch.bfloat16).cuda()
                    engine.register(layers[f"l{i}"])
                keep[-1] = layers
                reply = {"ptrs": {k: int(v.data_ptr()) for k, v in layers.items()}}
            elif cmd == "kv_sha":
                layers = keep[-1]
                ids = msg["blocks"]
                parts = [layers[k][:, ids].contiguous() for k in sorted(layers)]
                reply = {"sha": sha(torch.stack(parts))}
            elif cmd == "free":
                engine.unregister(msg["addr"])
                keep.pop(msg["addr"], None)
                reply = {}
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
            [sys.executable, __file__, "--role", "target", "--metadata", metadata],
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
            self.call("quit")
        finally:
            self.proc.wait(30)


# -- measurements ----------------------------------------------------------------------------
def gbps(n: int, seconds: float) -> float:
    return round(n / seconds / 1e9, 2)


def best(fn: Any, *args: Any, **kw: Any) -> float:
    """Fastest of REPEAT calls of ``fn(*args, **kw)``, in seconds."""
    times = []
    for _ in range(REPEAT):
        t0 = time.perf_counter()
        fn(*args, **kw)
        times.append(time.perf_counter() - t0)
    return min(times)


def _copy_synced(dst: Any, src: Any) -> None:
    import torch

    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()


def baselines() -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"d2d_same_process": {}, "d2h_pinned": {}}
    for n in SIZES:
        src = torch.empty(n, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        host = torch.empty(n, dtype=torch.uint8, pin_memory=True)

        _copy_synced(dst, src)  # warm up both paths
        _copy_synced(host, src)
        out["d2d_same_process"][str(n)] = gbps(n, best(_copy_synced, dst, src))
        out["d2h_pinned"][str(n)] = gbps(n, best(_copy_synced, host, src))
        del src, dst, host
    torch.cuda.empty_cache()
    return out


def sweep(
    engine: Any, tgt: Target, sizes: list[int], local_kind: str, remote_kind: str, bad: list[str]
) -> dict[str, Any]:
    """READ then WRITE of each size between local memory of ``local_kind`` and the target's
    ``remote_kind``; GB/s of each, every byte checked."""
    import torch

    res: dict[str, Any] = {}
    for i, n in enumerate(sizes):
        remote = tgt.call("alloc", kind=remote_kind, size=n, seed=i)
        if local_kind == "gpu":
            local = torch.zeros(n, dtype=torch.uint8, device="cuda")
            engine.register(local)
            laddr = int(local.data_ptr())
        elif local_kind == "pinned":
            local = torch.zeros(n, dtype=torch.uint8, pin_memory=True)
            engine.register(local)
            laddr = int(local.data_ptr())
        else:  # plain host memory from the engine (memfd)
            buf = engine.allocate_buffer(n)
            local, laddr = torch.from_numpy(buf.array), buf.addr
        seg, raddr = tgt.segment, remote["addr"]
        read_s = best(engine.read, seg, laddr, raddr, n, timeout=120)
        ok_read = sha(local) == remote["sha"]
        local.copy_(filled(n, 1000 + i, str(local.device)))
        want = sha(local)
        write_s = best(engine.write, seg, laddr, raddr, n, timeout=120)
        ok_write = tgt.call("sha", addr=raddr, n=n)["sha"] == want
        if not (ok_read and ok_write):
            bad.append(f"{local_kind}->{remote_kind} {n}: read ok {ok_read}, write ok {ok_write}")
        res[str(n)] = {
            "read_gbps": gbps(n, read_s),
            "write_gbps": gbps(n, write_s),
            "sha_ok": ok_read and ok_write,
        }
        if local_kind == "host":
            engine.free_buffer(laddr)
        else:
            engine.unregister(laddr)
        tgt.call("free", addr=raddr)
        del local
    return res


def kv_round_trip(engine: Any, tgt: Target, bad: list[str]) -> dict[str, Any]:
    """Blocks of the target's KV cache read into other block ids of ours, layer by layer."""
    import torch

    from mooncake_connectors.pd.layout import layer_layouts
    from mooncake_connectors.transfer_core import TransferRequest
    from mooncake_connectors.types import TransferOp

    ptrs = tgt.call("kv")["ptrs"]
    shape = (2, KV["blocks"], KV["block_size"], KV["heads"], KV["head_dim"])
    mine = {k: torch.zeros(shape, dtype=torch.bfloat16, device="cuda") for k in ptrs}
    for t in mine.values():
        engine.register(t)
    src_ids = list(range(40, 40 + 128))
    dst_ids = list(range(300, 300 + 128))
    reqs = []
    for name, t in mine.items():
        ours = layer_layouts(name, t, KV["blocks"])  # K and V planes, as the connectors see them
        delta = ptrs[name] - int(t.data_ptr())  # same shape there: same offsets
        for lay in ours:
            for s, d in zip(src_ids, dst_ids, strict=True):
                reqs.append(
                    TransferRequest(
                        TransferOp.READ,
                        tgt.segment,
                        lay.addr + d * lay.stride,
                        lay.addr + delta + s * lay.stride,
                        lay.block_bytes,
                    )
                )
    nbytes = sum(r.length for r in reqs)
    seconds = best(engine.transfer, reqs, timeout=120)
    got = sha(torch.stack([mine[k][:, dst_ids].contiguous() for k in sorted(mine)]))
    ok = got == tgt.call("kv_sha", blocks=src_ids)["sha"]
    if not ok:
        bad.append("kv round trip: bytes differ")
    for t in mine.values():
        engine.unregister(int(t.data_ptr()))
    return {"requests": len(reqs), "bytes": nbytes, "gbps": gbps(nbytes, seconds), "sha_ok": ok}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", default="initiator")
    ap.add_argument("--metadata", default="")
    args = ap.parse_args()
    if args.role == "target":
        target(args.metadata)
        return 0

    import torch

    from mooncake_connectors.config import EngineConfig
    from mooncake_connectors.transfer_core import TransferEngine, doctor
    from mooncake_connectors.transfer_core.metadata.http import MetadataHTTPServer

    t_start = time.monotonic()
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "doctor": [f.line() for f in doctor.check_gpus()],
    }
    bad: list[str] = []
    srv = MetadataHTTPServer("127.0.0.1", 0).start()
    tgt = Target(srv.url)
    try:
        result["baseline"] = baselines()
        for name in ("cuda_ipc", "tcp"):
            engine = TransferEngine(
                EngineConfig(metadata=srv.url, transports=(name,), timeout=120)
            ).start()
            try:
                part: dict[str, Any] = {}
                if name == "cuda_ipc":
                    part["gpu_gpu"] = sweep(engine, tgt, SIZES, "gpu", "gpu", bad)
                    part["pinned_host_gpu"] = sweep(engine, tgt, SIZES[:4], "pinned", "gpu", bad)
                    part["gpu_memfd_host"] = sweep(engine, tgt, SIZES[:4], "gpu", "host", bad)
                else:
                    part["gpu_gpu_staged"] = sweep(engine, tgt, TCP_SIZES, "gpu", "gpu", bad)
                    part["host_host"] = sweep(engine, tgt, TCP_SIZES, "host", "host", bad)
                part["kv_round_trip"] = kv_round_trip(engine, tgt, bad)
                result[name] = part
            finally:
                engine.close()
            result[f"elapsed_after_{name}_s"] = round(time.monotonic() - t_start, 1)
    except Exception as exc:
        bad.append(f"{type(exc).__name__}: {exc}")
    finally:
        tgt.close()
        srv.stop()
    result["targets"] = targets(result)
    result["failures"] = bad
    text = json.dumps(result, indent=1)
    print(text)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "gpu_check.json"), "w") as fh:
            fh.write(text)
    return 1 if bad else 0


def targets(r: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets, as ratios of this run's own figures (None where not measured)."""
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
    except (KeyError, ZeroDivisionError):
        pass
    return out


if __name__ == "__main__":
    sys.exit(main())
