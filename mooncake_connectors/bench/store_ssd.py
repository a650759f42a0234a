"""``mooncake-connectors bench store-ssd``: gets served from the SSD tier against gets from memory.

One master (promotion off, so an SSD hit stays one), one ``store-server`` process with
``memory`` bytes and an SSD directory, the client in this process. Per size: put enough values
that most of them are spilled, wait for the spills, then read keys that are on SSD and keys that
are in memory, alternating a few calls at a time so machine noise hits both alike. Which tier
served a read is checked, not assumed: the master's ``ssd_hits`` counter must grow by exactly
the SSD reads and not at all for the memory reads.

Two SSD figures: *warm* (the files were just written and sit in the OS page cache: what a
recently spilled object costs) and *cold* (before each call the files are dropped from the page
cache with ``posix_fadvise(DONTNEED)``, which touches only this benchmark's files, so the read
goes to the device). Reported: ops/s, GB/s, p50/p99 latency of one ``get_into`` (registered
destination) and of one ``get`` (new bytes).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from .procs import CLI, _quiet, _stop, machine, start_master

_CHUNK = 4


def _drop_cache(directory: Path) -> None:
    for p in directory.glob("*.obj"):
        try:
            fd = os.open(p, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _stats(times: list[float], nbytes: int) -> dict[str, float]:
    lat = sorted(times)
    total = sum(times)
    return {
        "ops_s": round(len(times) / total, 1),
        "gb_s": round(len(times) * nbytes / total / 1e9, 3),
        "p50_us": round(lat[len(lat) // 2] * 1e6, 1),
        "p99_us": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e6, 1),
    }


def run_ssd_benchmark(
    sizes: list[int], memory: int, ops: int, ssd_dir: str | None = None
) -> dict[str, Any]:
    import numpy as np

    from ..store.client import StoreClient
    from ..store.config import ClientConfig

    cli = CLI
    base = Path(ssd_dir) if ssd_dir else Path(tempfile.mkdtemp(prefix="mc-ssd-bench-"))
    directory = base / f"ssd-{os.getpid()}"
    procs: list[subprocess.Popen[Any]] = []
    results: dict[str, dict[str, dict[str, float]]] = {}
    try:
        master = start_master(["--promote-hits", "0"], procs)
        ssd_size = 4 * memory
        ssd = ["--ssd-dir", str(directory), "--ssd-size", str(ssd_size)]
        procs.append(
            _quiet([*cli, "store-server", "--master", master, "--memory", str(memory), *ssd])
        )
        c = StoreClient(ClientConfig(master=master, local_buffer_size=64 << 20)).start()
        try:
            end = time.monotonic() + 60
            while c.stats().get("servers", 0) < 1:
                if time.monotonic() > end or procs[1].poll() is not None:
                    raise RuntimeError("the store server did not mount its memory")
                time.sleep(0.05)
            for size in sizes:
                results[_label(size)] = _one_size(c, directory, size, memory, ssd_size, ops, np)
                c.remove_all(force=True)
                deadline = time.monotonic() + 30
                while c.stats()["ssd_used_bytes"] > 0 and time.monotonic() < deadline:
                    time.sleep(0.05)
        finally:
            c.close()
    finally:
        for p in reversed(procs):
            _stop(p)
        shutil.rmtree(directory, ignore_errors=True)
        if not ssd_dir:
            shutil.rmtree(base, ignore_errors=True)
    return {
        "benchmark": "store-ssd",
        "unit": "per call: ops/s, GB/s over the summed call times; latency of one call in µs",
        "memory": memory,
        "ops_per_case": ops,
        "machine": machine(),
        "results": results,
        "notes": [
            "ssd_warm: files in the OS page cache (just spilled); ssd_cold: dropped from the "
            "page cache before every call with posix_fadvise(DONTNEED), so read from the device",
            "promotion off (--promote-hits 0): every SSD read stays an SSD read; the tier of "
            "each read is checked against the master's ssd_hits counter",
        ],
    }


def _label(n: int) -> str:
    for unit, mult in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{unit}"
    return str(n)


def _one_size(
    c: Any, directory: Path, size: int, memory: int, ssd_size: int, ops: int, np: Any
) -> dict[str, dict[str, float]]:
    n = max(8, int((memory + ssd_size // 2) // size))  # ~ memory + half the SSD: most spill
    value = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    keys = [f"ssd-{size}-{i}" for i in range(n)]
    for k in keys:
        c.put(k, value)
    deadline = time.monotonic() + 120
    while c.stats()["spilling"] > 0:
        if time.monotonic() > deadline:
            raise RuntimeError("spills did not finish in 120 s")
        time.sleep(0.05)
    in_memory = max(2, int(0.5 * memory // size))  # the newest keys: safely below the watermark
    mem_keys = keys[-in_memory:]
    disk_keys = keys[: max(2, n // 2)]  # the oldest: spilled first
    dest = np.zeros(size, np.uint8)
    c.register_buffer(dest)
    addr = int(dest.ctypes.data)

    def get_into(k: str) -> None:
        if c.get_into(k, addr, size) != size:
            raise RuntimeError(f"miss on {k}")

    def get(k: str) -> None:
        if c.get(k) is None:
            raise RuntimeError(f"miss on {k}")

    out: dict[str, dict[str, float]] = {}
    for call_name, call in (("get_into", get_into), ("get", get)):
        times: dict[str, list[float]] = {"memory": [], "ssd_warm": [], "ssd_cold": []}
        ssd_reads = 0
        hits0 = c.stats()["ssd_hits"]
        i = 0
        while i < ops:
            for tier, ks in (
                ("memory", mem_keys),
                ("ssd_warm", disk_keys),
                ("ssd_cold", disk_keys),
            ):
                for j in range(i, min(ops, i + _CHUNK)):
                    k = ks[j % len(ks)]
                    if tier == "ssd_cold":
                        _drop_cache(directory)
                    t = time.perf_counter()
                    call(k)
                    times[tier].append(time.perf_counter() - t)
                    ssd_reads += tier != "memory"
            i += _CHUNK
        served = c.stats()["ssd_hits"] - hits0
        if served != ssd_reads:
            raise RuntimeError(
                f"{_label(size)}: {served} reads came from SSD, expected {ssd_reads}: the "
                "memory/SSD split moved (eviction during the run?)"
            )
        for tier, ts in times.items():
            out[f"{call_name}_{tier}"] = _stats(ts, size)
    c.unregister_buffer(addr)
    return out
