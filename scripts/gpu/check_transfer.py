#!/usr/bin/env python3
"""GPU check of the transfer engine: cuda_ipc and tcp-staged GPU transfers between two processes.

Needs one CUDA GPU and cuda-python's ``cuda.bindings``. Per transport (cuda_ipc, tcp staging):
the size sweeps; the ordering case (C4: the application's GPU work writes a buffer and the
engine moves it at once, following a ``Fence`` on the producer's stream; ``gpucheck.ordering``);
the connectors' own code on CUDA KV in vLLM's layout without vLLM (C5: the PD session's
layer-wise push and pull between the two processes, the store worker's puts and gets against
a store in the target; ``gpucheck.kv_cases``). torch with CUDA adds the baselines, torch's own
kernels as producers (with the PD worker's ``stream_fence``) and the vLLM-shaped KV round trip;
without it the producers are driver-queued work on the legacy stream and the KV caches driver
memory. The package is used from the working tree (PYTHONPATH) and never installed: the
built-in transports and metadata backends are found without entry points. The check's parts
live in ``scripts/gpu/gpucheck/`` (found next to this script, no install either).

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
import functools
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from gpucheck import kv_cases
from gpucheck.devmem import MIB, Dev, start_engine
from gpucheck.ordering import ordering
from gpucheck.sweeps import TARGETS, Run, baselines, kv_round_trip, targets, torch_cuda
from gpucheck.target import Target, target

SIZES = [64 * 1024, MIB, 16 * MIB, 256 * MIB, 1024 * MIB]
QUICK = [64 * 1024, MIB + 3]


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
                order = functools.partial(ordering, dev, engine, run, args.quick, torch)
                step(part, bad, "ordering", order)
                if torch is not None:
                    kv = functools.partial(kv_round_trip, torch, engine, run)
                    step(part, bad, "kv_round_trip", kv)
            finally:
                engine.close()
            pd = functools.partial(
                kv_cases.pd_session, dev, tgt, srv.url, (name,), args.quick, torch, bad
            )
            step(part, bad, "pd_session", pd)
            store = functools.partial(kv_cases.store, dev, tgt, (name,), args.quick, torch, bad)
            step(part, bad, "store", store)
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
