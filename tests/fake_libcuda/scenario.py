"""Scenarios over the real cuda-python and the FAKE libcuda, one per run, in a process started with
``fake_libcuda.env`` (LD_LIBRARY_PATH is read by the loader at process start). Each prints one
JSON line of facts for the test to check: digests, current contexts, the fake's counters.

    python tests/fake_libcuda/scenario.py NAME
"""

from __future__ import annotations

import contextlib
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

from cuda.bindings import driver as cu
from helpers import Peer, pattern

from fake_libcuda import counters, current_device, mem
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


def contexts() -> dict[str, Any]:
    """Two fake devices. The application's current context (torch's current device) must be the
    same after every engine call as before it, and a device's copies must run in that device's
    context whatever the thread has current."""
    ctx = {d: mem.dev(d).ctx for d in (0, 1)}
    seen: dict[str, Any] = {}
    p = Pair(("cuda_ipc",))
    try:
        remote = p.remote("real_cuda", MIB, seed=1)
        mem.ok(cu.cuCtxSetCurrent(ctx[1]))  # a TP rank 1: torch.cuda.set_device(1)
        local1 = p.local_gpu(1, MIB)
        seen["rank1_register"] = current_device()
        seen["rank1_gpu"] = round_trips(p, local1, remote, MIB, seed=2)
        seen["rank1_after_gpu"] = current_device()
        host = p.engine.allocate_buffer(MIB)
        seen["rank1_host"] = round_trips(p, host.addr, remote, 4096, seed=3)
        seen["rank1_after_host"] = current_device()

        def fresh() -> None:  # a worker thread that never touched CUDA itself
            local0 = p.local_gpu(0, MIB)
            seen["fresh_gpu"] = round_trips(p, local0, remote, MIB, seed=4)
            seen["fresh_after"] = current_device()

        t = threading.Thread(target=fresh)
        t.start()
        t.join(60)
        # This thread moves device 0 memory, then the application switches to device 1: the
        # next device-0 copy must still record its events in device 0's context.
        mem.ok(cu.cuCtxSetCurrent(ctx[0]))
        local0 = p.local_gpu(0, MIB)
        seen["dev0_first"] = round_trips(p, local0, remote, MIB, seed=5)
        mem.ok(cu.cuCtxSetCurrent(ctx[1]))
        seen["dev0_after_switch"] = round_trips(p, local0, remote, MIB, seed=6)
        seen["switch_after"] = current_device()
    finally:
        p.close()
    seen["counters"] = counters()
    return seen


def vmm() -> dict[str, Any]:
    """A VMM region in the second of two chunks of one reservation (torch's expandable segments
    after growing): exported as that chunk, mapped by the peer, bytes right both ways."""
    out: dict[str, Any] = {}
    p = Pair(("cuda_ipc",))
    try:
        n = mem.GRANULARITY
        remote = p.remote("real_cuda_vmm", 2 * n, seed=9, chunk=1)
        local = p.local_gpu(0, n)
        out["vmm"] = round_trips(p, local, remote, n, seed=10)
        out["vmm_offset"] = round_trips(p, local + 7, remote + 4096, 10000, seed=11)
        chunks = mem.vmm_alloc(0, 2 * n)  # and a local VMM region, a peer's cudaMalloc memory
        p.engine.register_raw(chunks[1], n, location="cuda:0")
        dev = p.remote("real_cuda", n, seed=12)
        out["local_vmm"] = round_trips(p, chunks[1], dev, n, seed=13)
        assert p.engine.metadata is not None
        desc = p.engine.metadata.lookup_segment(p.engine.segment_name)
        (mine,) = [r for r in desc.regions if r.addr == chunks[1]]
        out["export"] = [(e.kind, e.alloc_size, e.alloc_offset) for e in mine.cuda_exports]
    finally:
        p.close()
    out["counters"] = counters()
    return out


def unexportable() -> dict[str, Any]:
    """The driver refuses to export one region: it is still registered and reachable through tcp
    staging, one warning says so, and later registrations are unaffected."""
    warnings: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    logging.getLogger("mooncake_connectors").addHandler(Catch())
    out: dict[str, Any] = {}
    p = Pair(("cuda_ipc", "tcp"))
    try:
        n = 256 * 1024
        os.environ["FAKE_CUDA_FAIL_EXPORT"] = "1"
        bad = p.local_gpu(0, n)
        del os.environ["FAKE_CUDA_FAIL_EXPORT"]
        good = p.local_gpu(0, n)
        host = p.engine.allocate_buffer(n)
        assert p.engine.metadata is not None
        desc = p.engine.metadata.lookup_segment(p.engine.segment_name)
        out["exports"] = {
            name: len(r.cuda_exports)
            for r in desc.regions
            for name, addr in (("bad", bad), ("good", good), ("host", host.addr))
            if r.addr == addr
        }
        remote = p.remote("real_cuda", n, seed=14)
        out["good"] = round_trips(p, good, remote, n, seed=15)
        out["bad"] = round_trips(p, bad, remote, n, seed=16)  # as the local end: unaffected
        pulled = p.peer.call("pull", target=p.engine.segment_name, addr=bad, length=n)
        out["peer_reads_bad"] = pulled["sha"] == sha(bad, n)  # the peer's read: tcp staged
        out["warnings"] = warnings
    finally:
        p.close()
    return out


def old_driver() -> dict[str, Any]:
    """Run with FAKE_CUDA_HIDE=cuMemRetainAllocationHandle: the bindings raise their own
    FunctionNotFoundError; we must raise GpuError, and a VMM region is then published without
    its export (peers reach it through tcp staging)."""
    from mooncake_connectors.errors import GpuError

    out: dict[str, Any] = {}
    chunks = mem.vmm_alloc(0, MIB)
    try:
        cuda_driver.driver().export(chunks[0])
    except GpuError as exc:
        out["export_error"] = [type(exc).__name__, exc.call]
    p = Pair(("cuda_ipc", "tcp"))
    try:
        n = mem.GRANULARITY
        mem.fill(chunks[0], pattern(17, n).tobytes())
        p.engine.register_raw(chunks[0], n, location="cuda:0")
        pulled = p.peer.call("pull", target=p.engine.segment_name, addr=chunks[0], length=n)
        out["peer_reads"] = pulled["sha"] == sha(chunks[0], n)
    finally:
        p.close()
    return out


def vmm_fds() -> int:
    """Descriptors of this process open on the fake's VMM memory (its handles, our exports)."""
    out = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed since listed
            out += "fakecuda-vmm" in os.readlink(f"/proc/self/fd/{fd}")
    return out


def fd_exports() -> dict[str, Any]:
    """A VMM region's exported descriptor is closed when the region is unregistered, and the
    remaining ones when the engine closes."""
    from mooncake_connectors.config import EngineConfig

    out: dict[str, Any] = {}
    engine = TransferEngine(EngineConfig(metadata="memory", transports=("cuda_ipc",))).start()
    try:
        a, b = mem.vmm_alloc(0, MIB)[0], mem.vmm_alloc(0, MIB)[0]
        base = vmm_fds()
        region = engine.register_raw(a, mem.GRANULARITY, location="cuda:0")
        engine.register_raw(b, mem.GRANULARITY, location="cuda:0")
        out["registered"] = vmm_fds() - base
        engine.unregister(region)
        out["after_unregister"] = vmm_fds() - base
    finally:
        engine.close()
    out["after_close"] = vmm_fds() - base
    return out


def produce(addr: int, data: bytes, stream: Any = None) -> None:
    """The application's kernel: writes ``data`` at ``addr`` from its stream (by default the
    current context's legacy NULL stream, torch's default); the fake lands it only when
    ordered."""
    mem.ok(cu.cuMemcpyHtoDAsync(addr, data, len(data), stream or cu.CUstream(0)))


def ordering() -> dict[str, Any]:
    """A kernel writes a GPU buffer on the application's stream and the engine moves it at once
    (vLLM's layer-wise push): without a fence the copy does not wait (the fake counts it stale
    and the peer gets the old bytes); with ``Fence`` of the buffer's device the copy stream
    waits for it on the GPU, over cuda_ipc and tcp staging, and nobody's current device
    changes, even when the application has another device current by then."""
    out: dict[str, Any] = {}
    n = MIB
    for name in ("cuda_ipc", "tcp"):
        p = Pair((name,))
        try:
            remote = p.remote("real_cuda", n, seed=20)
            mem.ok(cu.cuCtxSetCurrent(mem.dev(0).ctx))  # torch.cuda.set_device(0)
            local = p.local_gpu(0, n)
            before = counters()
            produce(local, pattern(21, n).tobytes())
            p.engine.write(p.seg, local, remote, n)  # no fence: the control
            stale = p.digest(remote, n) != hashlib.sha256(pattern(21, n).tobytes()).hexdigest()
            mem.ok(cu.cuCtxSynchronize())
            mid = counters()
            want = pattern(22, n).tobytes()
            produce(local, want)
            mem.ok(cu.cuCtxSetCurrent(mem.dev(1).ctx))  # the application moved on to device 1
            fence = cuda_driver.Fence(0, 0)  # device 0's legacy stream, not the current one's
            p.engine.write(p.seg, local, remote, n, after=fence)
            got = p.digest(remote, n) == hashlib.sha256(want).hexdigest()
            after = counters()
            # a stream the application made itself (torch.cuda.Stream), by its raw handle
            mem.ok(cu.cuCtxSetCurrent(mem.dev(0).ctx))
            own = mem.ok(cu.cuStreamCreate(1))
            want2 = pattern(23, n).tobytes()
            produce(local, want2, own)
            mem.ok(cu.cuCtxSetCurrent(mem.dev(1).ctx))
            p.engine.write(p.seg, local, remote, n, after=cuda_driver.Fence(0, int(own)))
            got2 = p.digest(remote, n) == hashlib.sha256(want2).hexdigest()
            mem.ok(cu.cuStreamDestroy(own))
            out[name] = {
                "unfenced_stale": [stale, mid["stale"] - before["stale"]],
                "fenced_ok": [got, after["stale"] - mid["stale"], after["waits"] - mid["waits"]],
                "own_stream_ok": [got2, counters()["stale"] - after["stale"]],
                "current_after": current_device(),
            }
        finally:
            p.close()
    out["counters"] = counters()
    return out


SCENARIOS: dict[str, Callable[[], dict[str, Any]]] = {
    "ordering": ordering,
    "fd_exports": fd_exports,
    "old_driver": old_driver,
    "ipc": ipc,
    "contexts": contexts,
    "vmm": vmm,
    "unexportable": unexportable,
}


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
