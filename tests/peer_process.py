"""A TransferEngine in its own process, for cross-process tests (see helpers.Peer)."""

from __future__ import annotations

import hashlib
import json
import os
import resource
import sys
import traceback
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

from helpers import pattern

from mooncake_connectors.config import EngineConfig
from mooncake_connectors.transfer_core import TransferEngine
from mooncake_connectors.transfer_core.memory import view
from mooncake_connectors.types import Access


def main() -> None:
    if os.environ.get("PEER_NOFILE"):
        n = int(os.environ["PEER_NOFILE"])
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))
    engine: TransferEngine | None = None
    keep: dict[int, Any] = {}
    fake: Any = None
    for line in sys.stdin:
        msg = json.loads(line)
        cmd = msg.pop("cmd")
        try:
            if cmd == "start":
                if msg.pop("fake_cuda", False):
                    from fake_cuda import FakeCuda, ensure_cuda_ipc_registered

                    from mooncake_connectors.transfer_core import cuda_driver

                    fake = FakeCuda()
                    cuda_driver.install(fake)
                    ensure_cuda_ipc_registered()
                cfg = EngineConfig(
                    **{k: tuple(v) if k == "transports" else v for k, v in msg.items()}
                )
                engine = TransferEngine(cfg).start()
                reply: dict[str, Any] = {"segment": engine.segment_name, "pid": os.getpid()}
            elif cmd == "alloc":
                assert engine is not None
                kind, size, seed = msg["kind"], msg["size"], msg.get("seed", 0)
                if kind.startswith("real_cuda"):  # through cuda-python over the fake libcuda
                    from fake_libcuda import mem

                    dev = msg.get("device", 0)
                    if kind == "real_cuda_vmm":  # one chunk of a multi-chunk reservation
                        addr = mem.vmm_alloc(dev, size)[msg.get("chunk", 0)]
                        size = mem.GRANULARITY
                    else:
                        addr = mem.alloc(dev, size)
                    mem.fill(addr, pattern(seed, size).tobytes())
                    engine.register_raw(addr, size, location=f"cuda:{dev}")
                elif kind.startswith("cuda"):  # fake device memory (start with fake_cuda)
                    addr = fake.device_alloc(size, vmm=kind == "cuda_vmm")
                    fake.array(addr, size)[:] = pattern(seed, size)
                    access = Access.READ if kind == "cuda_readonly" else Access.READ_WRITE
                    engine.register_raw(addr, size, location="cuda:0", access=access)
                elif kind == "memfd":
                    buf = engine.allocate_buffer(size)
                    buf.array[:] = pattern(seed, size)
                    addr = buf.addr
                else:
                    arr = pattern(seed, size)
                    access = Access.READ if kind == "readonly" else Access.READ_WRITE
                    engine.register(arr, access=access, location=msg.get("location"))
                    addr = int(arr.ctypes.data)
                    keep[addr] = arr
                reply = {"addr": addr}
            elif cmd == "unregister":
                assert engine is not None
                engine.unregister(msg["addr"])
                reply = {}
            elif cmd == "fake_calls":  # what the fake CUDA driver was asked, by call name
                reply = {"calls": {c: fake.calls.count(c) for c in set(fake.calls)}}
            elif cmd == "pull":  # read another segment's bytes into a fresh buffer here
                assert engine is not None
                got = engine.allocate_buffer(msg["length"])
                engine.read(msg["target"], got.addr, msg["addr"], msg["length"])
                reply = {"sha": hashlib.sha256(bytes(got.array)).hexdigest()}
            elif cmd == "fill":  # overwrite local bytes with another seed's pattern
                view(msg["addr"], msg["length"])[:] = pattern(msg["seed"], msg["length"]).tobytes()
                reply = {}
            elif cmd == "digest":
                data = bytes(view(msg["addr"], msg["length"])) if msg["length"] else b""
                reply = {"sha": hashlib.sha256(data).hexdigest()}
            elif cmd == "transfer":  # this engine reads or writes a peer's memory
                assert engine is not None and msg["op"] in ("read", "write")
                getattr(engine, msg["op"])(msg["peer"], msg["local"], msg["remote"], msg["length"])
                reply = {}
            elif cmd == "batch":  # one engine.transfer of many requests (a KV block scatter)
                assert engine is not None and msg["op"] in ("read", "write")
                from mooncake_connectors.transfer_core.engine import TransferRequest
                from mooncake_connectors.types import TransferOp

                op = TransferOp.READ if msg["op"] == "read" else TransferOp.WRITE
                engine.transfer(
                    [TransferRequest(op, msg["peer"], lo, ro, n) for lo, ro, n in msg["blocks"]]
                )
                reply = {}
            elif cmd == "rdma_compiled":  # which data path each rdma NIC runs
                assert engine is not None
                t = next(t for t in engine.transports if t.name == "rdma")
                nics = t.nics  # type: ignore[attr-defined]
                reply = {"compiled": {n: s.nic.compiled for n, s in nics.items()}}
            elif cmd == "rail_stats":  # the rdma transport's rails to a peer
                assert engine is not None
                t = next(t for t in engine.transports if t.name == "rdma")
                reply = {"stats": t.rail_stats(msg["peer"])}  # type: ignore[attr-defined]
            elif cmd == "close_transport":
                assert engine is not None
                for t in engine.transports:
                    if t.name == msg["name"]:
                        t.close()
                reply = {}
            elif cmd == "drop_connections":
                assert engine is not None
                for t in engine.transports:
                    server = getattr(t, "_server", None)
                    if server is not None:
                        for c in list(server.conns):
                            c.shutdown(2)
                reply = {}
            elif cmd == "connections":  # accepted connections open now, per transport
                assert engine is not None
                reply = {
                    t.name: len(t._server.conns)
                    for t in engine.transports
                    if getattr(t, "_server", None) is not None
                }
            elif cmd == "quit":
                if engine is not None:
                    engine.close()
                print(json.dumps({}), flush=True)
                return
            else:
                reply = {"error": f"unknown command {cmd}"}
        except Exception as exc:
            reply = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    _ = np  # numpy imported for pattern()
