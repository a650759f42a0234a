"""More scenarios over the real cuda-python and the FAKE libcuda (see scenario.py): completion
waits, host pinning off the data path, read-only and page-sharing host regions, VMM access for
every local device. One per run, one JSON line of facts out.

    python tests/fake_libcuda/scenario_more.py NAME
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import resource
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np
from helpers import pattern
from scenario import MIB, Pair, round_trips, sha

from fake_libcuda import counters, mem
from mooncake_connectors.errors import TransferTimeout
from mooncake_connectors.transfer_core import cuda_driver


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []
        logging.getLogger("mooncake_connectors").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING:
            self.seen.append(record.getMessage())


def waits() -> dict[str, Any]:
    """An event that answers NOT_READY 20 times is waited through without sleeping (the
    thread's voluntary context switches); one that never completes ends the wait at its
    deadline, directly and through a transfer, and leaves no thread behind."""
    out: dict[str, Any] = {}
    drv = cuda_driver.driver()
    stream, event = drv.stream_create(0), drv.event_create(0)
    os.environ["FAKE_CUDA_NOT_READY"] = "20"
    drv.event_record(event, stream)
    before_q, before = counters()["not_ready"], resource.getrusage(resource.RUSAGE_THREAD)
    done = cuda_driver.wait_event(drv, event, time.monotonic() + 30)
    after = resource.getrusage(resource.RUSAGE_THREAD)
    out["short"] = [done, counters()["not_ready"] - before_q, after.ru_nvcsw - before.ru_nvcsw]
    os.environ["FAKE_CUDA_NOT_READY"] = "-1"  # never completes
    drv.event_record(event, stream)
    start = time.monotonic()
    done = cuda_driver.wait_event(drv, event, start + 0.3)
    out["never"] = [done, time.monotonic() - start, threading.active_count()]
    del os.environ["FAKE_CUDA_NOT_READY"]
    drv.event_destroy(event)
    drv.stream_destroy(stream)
    p = Pair(("cuda_ipc",))
    try:
        remote = p.remote("real_cuda", MIB, seed=30)
        local = p.local_gpu(0, MIB)
        os.environ["FAKE_CUDA_NOT_READY"] = "-1"
        start = time.monotonic()
        try:
            p.engine.read(p.seg, local, remote, MIB, timeout=0.5)
            out["transfer"] = "completed"
        except TransferTimeout:
            out["transfer"] = "TransferTimeout"
        out["transfer_s"] = time.monotonic() - start
        del os.environ["FAKE_CUDA_NOT_READY"]
    finally:
        p.close()
    out["threads_after"] = [t.name for t in threading.enumerate() if t.name.startswith("mc-")]
    return out


def pinning() -> dict[str, Any]:
    """Host memory is pinned when registered (here) and when the peer is looked up (its
    buffers): the first transfers make no cuMemHostRegister call."""
    out: dict[str, Any] = {}
    p = Pair(("cuda_ipc",))
    try:
        remote_gpu = p.remote("real_cuda", MIB, seed=20)
        remote_host = p.remote("memfd", MIB, seed=21)
        buf = p.engine.allocate_buffer(MIB)  # local host memory: pinned now
        gpu = p.local_gpu(0, MIB)
        p.engine.peer(p.seg)  # "connect": the peer's host buffer is mapped and pinned now
        before = counters()["host_register"]
        out["host_gpu"] = round_trips(p, buf.addr, remote_gpu, MIB, seed=22)
        out["gpu_host"] = round_trips(p, gpu, remote_host, MIB, seed=23)
        out["registers"] = [before, counters()["host_register"] - before]
        out["unknown_copy"] = counters()["unknown_copy"]
    finally:
        p.close()
    return out


def pin_refused() -> dict[str, Any]:
    """The driver refuses every pin here: registrations are kept, one warning per buffer, and
    the bytes move through tcp staging."""
    seen = Warnings()
    out: dict[str, Any] = {}
    p = Pair(("cuda_ipc", "tcp"))
    try:
        remote_gpu = p.remote("real_cuda", MIB, seed=24)
        remote_host = p.remote("memfd", MIB, seed=25)
        os.environ["FAKE_CUDA_FAIL_HOST_REGISTER"] = "1"
        buf = p.engine.allocate_buffer(MIB)
        gpu = p.local_gpu(0, MIB)  # another publish: no second warning for buf
        p.engine.peer(p.seg)
        assert p.engine.metadata is not None
        desc = p.engine.metadata.lookup_segment(p.engine.segment_name)
        out["registered"] = any(r.addr == buf.addr for r in desc.regions)
        out["host_gpu"] = round_trips(p, buf.addr, remote_gpu, MIB, seed=26)
        out["gpu_host"] = round_trips(p, gpu, remote_host, MIB, seed=27)
        out["gpu_host_again"] = round_trips(p, gpu, remote_host, 4096, seed=28)
    finally:
        os.environ.pop("FAKE_CUDA_FAIL_HOST_REGISTER", None)
        p.close()
    out["pin_warnings"] = [w for w in seen.seen if "pin" in w]
    return out


def host_kinds() -> dict[str, Any]:
    """A read-only mapping registered as a source, and two regions sharing a page, each moved
    to the peer's GPU; the pins are made at registration."""
    seen = Warnings()
    out: dict[str, Any] = {}
    p = Pair(("cuda_ipc",))
    fd = os.memfd_create("ro-weights")
    try:
        remote = p.remote("real_cuda", MIB, seed=31)
        os.write(fd, pattern(32, MIB).tobytes())
        ro = mmap.mmap(fd, MIB, prot=mmap.PROT_READ)  # read-only pages (model weights, say)
        weights = np.frombuffer(ro, dtype=np.uint8)
        p.engine.register(weights)
        addr = int(weights.ctypes.data)
        p.engine.write(p.seg, addr, remote, MIB)
        out["read_only"] = p.digest(remote, MIB) == sha(addr, MIB)
        base = np.zeros(4 * 4096, dtype=np.uint8)  # two regions, one page in common
        start = -int(base.ctypes.data) % 4096
        a, b = base[start + 100 : start + 6000], base[start + 6000 : start + 9000]
        a[:], b[:] = pattern(33, a.size), pattern(34, b.size)
        before = counters()["host_register"]
        p.engine.register(a)
        p.engine.register(b)
        out["shared_page_registers"] = counters()["host_register"] - before
        for arr, off in ((a, 0), (b, 8192)):
            p.engine.write(p.seg, int(arr.ctypes.data), remote + off, arr.size)
        out["shared_page"] = [
            p.digest(remote, a.size) == sha(int(a.ctypes.data), a.size),
            p.digest(remote + 8192, b.size) == sha(int(b.ctypes.data), b.size),
        ]
        out["unknown_copy"] = counters()["unknown_copy"]
        del weights
    finally:
        p.close()
        os.close(fd)
    out["warnings"] = seen.seen
    return out


def vmm_devices() -> dict[str, Any]:
    """The peer's VMM chunk is mapped here on device 0 (its GPU); this process's cuda:1 memory
    copies to and from it on device 1's stream, which needs access of its own."""
    out: dict[str, Any] = {}
    p = Pair(("cuda_ipc",))
    try:
        n = mem.GRANULARITY
        remote = p.remote("real_cuda_vmm", 2 * n, seed=35, chunk=1)
        local1 = p.local_gpu(1, n)
        out["dev1"] = round_trips(p, local1, remote, n, seed=36)
        local0 = p.local_gpu(0, n)
        out["dev0"] = round_trips(p, local0, remote + 4096, n - 4096, seed=37)
        out["unknown_copy"] = counters()["unknown_copy"]
    finally:
        p.close()
    return out


def vmm_refused() -> dict[str, Any]:
    """This process cannot open the peer's VMM export (pidfd_getfd refused, an import the
    driver refuses): the transfer moves through tcp staging instead."""
    out: dict[str, Any] = {}
    p = Pair(("cuda_ipc", "tcp"))
    try:
        n = mem.GRANULARITY
        remote = p.remote("real_cuda_vmm", 2 * n, seed=38, chunk=1)
        local = p.local_gpu(0, n)
        os.environ["FAKE_CUDA_FAIL_IMPORT"] = "1"
        out["vmm"] = round_trips(p, local, remote, n, seed=39)
    finally:
        os.environ.pop("FAKE_CUDA_FAIL_IMPORT", None)
        p.close()
    return out


SCENARIOS: dict[str, Callable[[], dict[str, Any]]] = {
    "waits": waits,
    "pinning": pinning,
    "pin_refused": pin_refused,
    "host_kinds": host_kinds,
    "vmm_devices": vmm_devices,
    "vmm_refused": vmm_refused,
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
