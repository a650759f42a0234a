"""The transfer-engine calls of vLLM's EC connector push, alone: ``bench vllm-ec --pattern``.

vLLM's ``ECMooncakeConnector`` producer hands each encoder output over with its
``MooncakeTransfer`` class (unmodified here): ``acquire_sources`` (registers the source tensor,
``batch_register_memory``), ``write`` (``batch_transfer_sync_write`` into the consumer's reserved
range) and ``release_sources`` (``unregister_memory``). Two processes per system, as in a
deployment: a consumer that registers its receive pool (vLLM's ``register_memory``) and a
producer that pushes fresh tensors into it, one push at a time, timing each push (all three
calls) and checking the bytes of the last push of every size at the consumer. Same systems as
:mod:`.vllm_ec`; the consumer and the producer of a system run with the same environment.

Run as ``python -m mooncake_connectors.bench.vllm_ec_pattern consumer|producer ...`` by
:func:`run_pattern`; they talk over their stdin/stdout, one JSON line each way.
"""

from __future__ import annotations

import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

MARK = "@@ec-pattern "


def _reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def _vllm_transfer() -> Any:
    """vLLM's own ``MooncakeTransfer``, the subject measured: loaded by name, as the harness's
    other vLLM rows do, since no module of this package imports vLLM outside its adapter."""
    module = importlib.import_module("vllm.distributed.ec_transfer.ec_connector.mooncake.transfer")
    return module.MooncakeTransfer("127.0.0.1", "tcp")


def _offsets(sizes: list[int]) -> list[int]:
    """Where each size's pushes land in the consumer's pool (one range per size)."""
    out, at = [], 0
    for n in sizes:
        out.append(at)
        at += n
    return out


def _consumer(pool_bytes: int) -> None:
    import torch

    transfer = _vllm_transfer()
    pool = torch.zeros(pool_bytes, dtype=torch.uint8)
    if transfer.register_memory(pool) != 0:
        raise RuntimeError("register_memory failed")
    _reply({"session": transfer.local_session(), "base": pool.data_ptr()})
    for line in sys.stdin:  # {"check": [offset, nbytes, seed]} or {"stop": true}
        cmd = json.loads(line)
        if cmd.get("stop"):
            break
        offset, nbytes, seed = cmd["check"]
        g = torch.Generator().manual_seed(seed)
        want = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
        _reply({"equal": bool(torch.equal(pool[offset : offset + nbytes], want))})
    transfer.unregister_memory(pool)
    transfer.close()


def _producer(session: str, base: int, sizes: list[int], pushes: int) -> None:
    import torch

    transfer = _vllm_transfer()
    out: dict[str, Any] = {}
    for nbytes, offset in zip(sizes, _offsets(sizes), strict=True):
        times = []
        for i in range(pushes + 1):  # the first is a warm-up
            g = torch.Generator().manual_seed(nbytes + i)
            src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
            t0 = time.perf_counter()
            sources = transfer.acquire_sources([src])
            transfer.write(session, sources, [base + offset], [nbytes])
            transfer.release_sources(sources)
            if i:
                times.append((time.perf_counter() - t0) * 1e6)
        out[str(nbytes)] = {"times_us": times, "seed": nbytes + pushes}
    transfer.close()
    _reply(out)


def _role_main(argv: list[str]) -> None:
    from ..compat_alias import install_from_env

    install_from_env()  # before vLLM's transfer module imports mooncake.engine
    if argv[0] == "consumer":
        _consumer(int(argv[1]))
    else:
        _producer(argv[1], int(argv[2]), [int(x) for x in argv[3].split(",")], int(argv[4]))


def _read(proc: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    """The role's next reply line, within ``timeout`` seconds."""
    import selectors

    assert proc.stdout is not None
    end = time.monotonic() + timeout
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    try:
        while time.monotonic() < end:
            if not sel.select(max(0.0, end - time.monotonic())):
                break
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"role exited with {proc.wait(10)}")
            if line.startswith(MARK):
                out: dict[str, Any] = json.loads(line[len(MARK) :])
                return out
    finally:
        sel.close()
    raise TimeoutError(f"no reply in {timeout}s")


def _start(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "mooncake_connectors.bench.vllm_ec_pattern", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )


def run_pattern(
    systems: list[str], sizes: list[int], pushes: int, timeout: float = 300.0
) -> dict[str, Any]:
    """Each system's consumer and producer; the systems run one after the other."""
    from .vllm_ec import system_env

    results: dict[str, Any] = {}
    for system in systems:
        env = dict(os.environ) | system_env(system)
        consumer = _start(["consumer", str(sum(sizes))], env)
        try:
            hello = _read(consumer, timeout)
            producer = _start(
                [
                    "producer",
                    hello["session"],
                    str(hello["base"]),
                    ",".join(map(str, sizes)),
                    str(pushes),
                ],
                env,
            )
            try:
                pushed = _read(producer, timeout)
            finally:
                producer.kill()
                producer.wait(30)
            rows = {}
            for nbytes, offset in zip(sizes, _offsets(sizes), strict=True):
                got = pushed[str(nbytes)]
                assert consumer.stdin is not None
                check = {"check": [offset, nbytes, got["seed"]]}
                consumer.stdin.write(json.dumps(check) + "\n")
                consumer.stdin.flush()
                if not _read(consumer, timeout)["equal"]:
                    raise RuntimeError(f"{system}: the consumer's bytes differ at {nbytes} B")
                times = sorted(got["times_us"])
                rows[str(nbytes)] = {
                    "p50_us": round(statistics.median(times), 1),
                    "p90_us": round(times[int(0.9 * (len(times) - 1))], 1),
                    "pushes": len(times),
                    "bytes_identical": True,
                }
            results[system] = rows
        finally:
            consumer.kill()
            consumer.wait(30)
    ratios: dict[str, Any] = {}
    if "mooncake" in results:
        for name in ("ours", "ours_tcp"):
            if name in results:
                ratios[f"{name}/mooncake"] = {
                    size: round(
                        results[name][size]["p50_us"] / results["mooncake"][size]["p50_us"], 3
                    )
                    for size in results[name]
                }
    return {"results": results, "ratios": ratios}


if __name__ == "__main__":
    _role_main(sys.argv[1:])
