"""The transfer-engine calls of vLLM's EC connector push, alone: ``bench vllm-ec --pattern``.

vLLM's ``ECMooncakeConnector`` producer hands each encoder output over with its
``MooncakeTransfer`` class (unmodified here): ``acquire_sources`` (registers the source tensor,
``batch_register_memory``), ``write`` (``batch_transfer_sync_write`` into the consumer's reserved
range) and ``release_sources`` (``unregister_memory``). Two processes per system, as in a
deployment: a consumer that registers its receive pool (vLLM's ``register_memory``) and a
producer that pushes fresh tensors into it, one push at a time, timing each push (all three
calls) and checking the bytes of the last push of every size at the consumer. Same systems as
:mod:`.vllm_ec`; the consumer and the producer of a system run with the same environment.

Each role is ``python -m mooncake_connectors.bench.vllm_ec_pattern CFG``, driven by
:func:`run_pattern` through :class:`.procs.RoleProc`.
"""

from __future__ import annotations

import importlib
import json
import os
import statistics
import sys
import time
from typing import Any

from .procs import RoleProc

MARK = "@@ec-pattern "
MODULE = "mooncake_connectors.bench.vllm_ec_pattern"


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


def _pattern(nbytes: int, seed: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


class _Consumer:
    """Registers its receive pool as vLLM's consumer does; ``check`` compares a range."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        import torch

        self.transfer = _vllm_transfer()
        self.pool = torch.zeros(int(cfg["pool_bytes"]), dtype=torch.uint8)
        if self.transfer.register_memory(self.pool) != 0:
            raise RuntimeError("register_memory failed")
        self.ready = {"session": self.transfer.local_session(), "base": self.pool.data_ptr()}

    def check(self, cmd: dict[str, Any]) -> dict[str, Any]:
        offset, nbytes = int(cmd["offset"]), int(cmd["nbytes"])
        want = _pattern(nbytes, int(cmd["seed"]))
        return {"equal": bool(self.pool[offset : offset + nbytes].equal(want))}

    def close(self) -> None:
        self.transfer.unregister_memory(self.pool)
        self.transfer.close()


class _Producer:
    """Pushes fresh tensors one at a time with vLLM's three calls, timing each push."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.transfer = _vllm_transfer()
        self.ready = {"pid": os.getpid()}

    def push(self, cmd: dict[str, Any]) -> dict[str, Any]:
        sizes, pushes = [int(x) for x in cmd["sizes"]], int(cmd["pushes"])
        session, base = str(cmd["session"]), int(cmd["base"])
        out: dict[str, Any] = {}
        for nbytes, offset in zip(sizes, _offsets(sizes), strict=True):
            times = []
            for i in range(pushes + 1):  # the first is a warm-up
                src = _pattern(nbytes, nbytes + i)
                t0 = time.perf_counter()
                sources = self.transfer.acquire_sources([src])
                self.transfer.write(session, sources, [base + offset], [nbytes])
                self.transfer.release_sources(sources)
                if i:
                    times.append((time.perf_counter() - t0) * 1e6)
            out[str(nbytes)] = {"times_us": times, "seed": nbytes + pushes}
        return out

    def close(self) -> None:
        self.transfer.close()


def _role_main(cfg: dict[str, Any]) -> None:
    """The role protocol of :class:`.procs.RoleProc`: a ready line, one answer per command."""
    from ..compat_alias import install_from_env

    install_from_env()  # before vLLM's transfer module imports mooncake.engine
    role = (_Consumer if cfg["role"] == "consumer" else _Producer)(cfg)
    _reply(role.ready)
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            role.close()
            _reply({"bye": True})
            break
        try:
            _reply(getattr(role, cmd["op"])(cmd))
        except Exception as exc:  # reported to the driver
            _reply({"error": f"{type(exc).__name__}: {exc}"})


def run_pattern(
    systems: list[str], sizes: list[int], pushes: int, timeout: float = 300.0
) -> dict[str, Any]:
    """Each system's consumer and producer; the systems run one after the other."""
    from .vllm_ec import system_env

    results: dict[str, Any] = {}
    for system in systems:
        env = dict(os.environ) | system_env(system)
        consumer = RoleProc(MODULE, MARK, {"role": "consumer", "pool_bytes": sum(sizes)}, env)
        producer: RoleProc | None = None
        try:
            hello = consumer.reply(timeout)
            producer = RoleProc(MODULE, MARK, {"role": "producer"}, env)
            producer.reply(timeout)
            pushed = producer.call(
                {"op": "push", "sizes": sizes, "pushes": pushes} | hello, timeout
            )
            rows = {}
            for nbytes, offset in zip(sizes, _offsets(sizes), strict=True):
                got = pushed[str(nbytes)]
                check = {"op": "check", "offset": offset, "nbytes": nbytes, "seed": got["seed"]}
                if not consumer.call(check, timeout)["equal"]:
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
            for role in (producer, consumer):
                if role is not None:
                    role.stop()
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
    _role_main(json.loads(sys.argv[1]))
