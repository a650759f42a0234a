"""Scenarios over the real cuda-python and the FAKE libcuda, one per run, in a process started with
``fake_libcuda.env`` (LD_LIBRARY_PATH is read by the loader at process start). Each prints one
JSON line of facts for the test to check: digests, current contexts, the fake's counters.

    python tests/fake_libcuda/scenario.py NAME
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from helpers import Peer, pattern

from fake_libcuda import counters, mem
from mooncake_connectors.config import EngineConfig
from mooncake_connectors.transfer_core import TransferEngine, cuda_driver
from mooncake_connectors.transfer_core.memory import view
from mooncake_connectors.transfer_core.metadata.http import MetadataHTTPServer
from mooncake_connectors.transfer_core.transport import TRANSPORTS

MIB = 1 << 20
STAGING = {"tcp": {"staging_chunk": 64 * 1024, "staging_buffers": 3}}


def sha(addr: int, n: int) -> str:
    return hashlib.sha256(bytes(view(addr, n))).hexdigest()


class Pair:
    """This process (initiator) and a Peer (target), both on the real wrapper over the fake."""

    def __init__(self, transports: tuple[str, ...]) -> None:
        if "cuda_ipc" not in TRANSPORTS.names():  # an install whose entry points predate it
            from mooncake_connectors.transfer_core.transports.cuda_ipc import CudaIpcTransport

            TRANSPORTS.register("cuda_ipc", CudaIpcTransport)
        self.srv = MetadataHTTPServer("127.0.0.1", 0).start()
        settings = STAGING if "tcp" in transports else {}
        cfg: dict[str, Any] = {"metadata": self.srv.url, "transport_settings": settings}
        self.peer = Peer(transports=list(transports), **cfg)
        self.engine = TransferEngine(EngineConfig(transports=transports, timeout=20, **cfg)).start()
        self.seg = self.peer.segment

    def remote(self, kind: str, size: int, seed: int, **kw: Any) -> int:
        return int(self.peer.call("alloc", kind=kind, size=size, seed=seed, **kw)["addr"])

    def digest(self, addr: int, n: int) -> str:
        return str(self.peer.call("digest", addr=addr, length=n)["sha"])

    def local_gpu(self, device: int, size: int) -> int:
        addr = mem.alloc(device, size)
        self.engine.register_raw(addr, size, location=f"cuda:{device}")
        return addr

    def close(self) -> None:
        self.engine.close()
        self.peer.close()
        self.srv.stop()


def round_trips(p: Pair, local: int, remote: int, n: int, seed: int) -> list[bool]:
    """Read the peer's bytes, then write new ones back: does each side match after each?"""
    p.engine.read(p.seg, local, remote, n)
    first = sha(local, n) == p.digest(remote, n)
    mem.fill(local, pattern(seed, n).tobytes())
    p.engine.write(p.seg, local, remote, n)
    return [first, p.digest(remote, n) == sha(local, n)]


def ipc() -> dict[str, Any]:
    """cuda_ipc GPU<->GPU and host<->GPU, then tcp-staged GPU<->GPU, between two processes."""
    out: dict[str, Any] = {"driver": type(cuda_driver.driver()).__name__}
    p = Pair(("cuda_ipc",))
    try:
        remote = p.remote("real_cuda", MIB, seed=3)
        local = p.local_gpu(0, MIB)
        out["gpu_gpu"] = round_trips(p, local, remote, MIB, seed=4)
        buf = p.engine.allocate_buffer(MIB)  # host memory here, GPU memory there
        out["host_gpu"] = round_trips(p, buf.addr, remote + 5, MIB - 5, seed=5)
        fresh = threading.Thread(
            target=lambda: out.update(thread=round_trips(p, local, remote, 4096, 6))
        )
        fresh.start()
        fresh.join(60)
    finally:
        p.close()
    t = Pair(("tcp",))
    try:
        remote = t.remote("real_cuda", MIB, seed=7)
        local = t.local_gpu(0, MIB)
        out["tcp_gpu_gpu"] = round_trips(t, local, remote, MIB, seed=8)
    finally:
        t.close()
    out["counters"] = counters()
    return out


SCENARIOS: dict[str, Callable[[], dict[str, Any]]] = {"ipc": ipc}


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    mem.init()
    try:
        result = SCENARIOS[sys.argv[1]]()
    except Exception as exc:
        result = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
