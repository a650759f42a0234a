"""``mooncake-connectors bench store-memory``: the master's resident memory per key.

A real master process (the CLI) gets one 1 TiB segment mounted by this process acting as a store
server (no memory behind it: the master never touches data), then ``keys`` puts committed in
batches over the control plane, then one get of every key (which gives each a read lease). The
master's RSS (``/proc/PID/status``) is read before and after; bytes per key is the difference
divided by the key count. Same host only (it reads the master's /proc entry).
"""

from __future__ import annotations

import os
import platform
import random
import socket
import subprocess
import time
from typing import Any

from ..store.config import MAX_SEGMENT_SIZE
from ..store.protocol import Err, Get, Heartbeat, Hello, Mount, PutEnd, PutStart
from ..store.rpc import Channel
from .procs import CLI


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def run_memory_benchmark(
    keys: int = 1_000_000, key_len: int = 32, value_size: int = 4096, batch: int = 1000
) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [*CLI, "master", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    addr = f"127.0.0.1:{port}"
    try:
        end = time.monotonic() + 30
        while True:
            try:
                ch = Channel(addr, 1.0)
                break
            except OSError:
                if time.monotonic() > end or proc.poll() is not None:
                    raise RuntimeError("master did not start") from None
                time.sleep(0.05)
        # The names first: making 10^6 of them takes seconds on a loaded machine, longer than
        # the master waits for a mounted server's heartbeat (it would unmount the segment and
        # answer every put with "no space").
        rng = random.Random(0)
        hexchars = "0123456789abcdef"
        names = ["".join(rng.choices(hexchars, k=key_len)) for _ in range(keys)]
        me = "memory-bench"
        ch.call(Hello(me), 10)
        reply = ch.call(Mount(me, "bench-segment", 1 << 44, MAX_SEGMENT_SIZE), 10)
        if isinstance(reply, Err):
            raise RuntimeError(reply.message)
        base = _rss(proc.pid)
        t0 = time.perf_counter()
        for i in range(0, keys, batch):
            chunk = names[i : i + batch]
            put_id = i + 1
            r = ch.call(PutStart(put_id, chunk, [value_size] * len(chunk)), 60)
            if isinstance(r, Err):
                raise RuntimeError(r.message)
            codes = getattr(r, "codes", [])
            if any(codes):  # a refused put stores nothing: no figure then
                raise RuntimeError(f"the master refused puts: codes {set(codes)}")
            ch.call(PutEnd(put_id, chunk, []), 60)
            ch.call(Heartbeat(me), 60)  # keep the fake server alive through a long run
            ch.pushes.clear()  # the holdings deltas the master sends its "server"
        put_s = time.perf_counter() - t0
        after_puts = _rss(proc.pid)
        t0 = time.perf_counter()
        for i in range(0, keys, batch):
            ch.call(Get(names[i : i + batch]), 60)
            ch.call(Heartbeat(me), 60)
            ch.pushes.clear()
        get_s = time.perf_counter() - t0
        after_gets = _rss(proc.pid)
        ch.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return {
        "benchmark": "store-memory",
        "keys": keys,
        "key_len": key_len,
        "value_size": value_size,
        "replicas": 1,
        "master_rss_base_bytes": base,
        "master_rss_after_puts_bytes": after_puts,
        "master_rss_after_gets_bytes": after_gets,
        "bytes_per_key_after_puts": round((after_puts - base) / keys, 1),
        "bytes_per_key_with_read_leases": round((after_gets - base) / keys, 1),
        "put_commit_keys_per_s": round(keys / put_s),
        "lookup_keys_per_s": round(keys / get_s),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
    }
