"""``mooncake-connectors bench store``: the store's put/get paths, ours and Mooncake's, one run.

Each system runs as users run it: a master process, a data-owner process that contributes the
memory (our ``store-server``; for Mooncake a ``MooncakeDistributedStore`` with a global segment),
and the client in this process (a pure client: it contributes no memory). Cases, with the systems
alternating every few calls so machine noise hits both alike:

  put / get / get_into of each size — single calls, a fresh key per op;
  batches (``COUNTxSIZE``): put_batch, get_batch and batch_get_into of COUNT keys per call.

Ours runs twice in the same window by default: ``ours`` with its defaults (same-host shortcuts:
shared memory for data, an abstract unix socket for control) and ``ours-tcp``, TCP only for data
and control, as Mooncake's ``tcp`` works; ``ours-tcp`` is the like-for-like column.

Reported per case and system: ops/s (calls per second; a batch call counts COUNT ops), GB/s,
p50/p99 latency of one call (µs). Ratios are ours ÷ Mooncake (> 1 is better for ours).
"""

from __future__ import annotations

import logging
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from ..errors import ConfigError
from ..store.config import parse_size
from .procs import _quiet as _quiet  # re-exported: benches import them from here too
from .procs import _stop as _stop
from .procs import loadavg, start_master
from .procs import start_mooncake_store as start_mooncake_store

log = logging.getLogger(__name__)


class _System:
    """What the benchmark drives; values are numpy uint8 arrays."""

    name = ""
    procs: list[subprocess.Popen[Any]]

    def put(self, key: str, value: Any) -> None: ...
    def get(self, key: str) -> Any: ...
    def get_into(self, key: str, addr: int, size: int) -> None: ...
    def put_batch(self, keys: list[str], values: list[Any]) -> None: ...
    def get_batch(self, keys: list[str]) -> Any: ...
    def batch_get_into(self, keys: list[str], addrs: list[int], sizes: list[int]) -> None: ...
    def register(self, arr: Any) -> None: ...
    def clear(self) -> None: ...

    def close(self) -> None:
        for p in reversed(self.procs):
            _stop(p)


# name of our system -> its transports (both processes: data and control plane alike)
OUR_VARIANTS: dict[str, tuple[str, ...]] = {"ours": ("shm", "tcp"), "ours-tcp": ("tcp",)}


class _Ours(_System):
    def __init__(self, memory: int, name: str = "ours") -> None:
        from ..store.client import StoreClient
        from ..store.config import ClientConfig

        self.name = name
        transports = OUR_VARIANTS[name]
        self.procs = []
        cli = [sys.executable, "-m", "mooncake_connectors"]
        master = start_master([], self.procs)
        self.procs.append(
            _quiet(
                [
                    *cli,
                    "store-server",
                    "--master",
                    master,
                    "--memory",
                    str(memory),
                    "--transports",
                    ",".join(transports),
                ]
            )
        )
        cfg = ClientConfig(master=master, local_buffer_size=256 << 20, transports=transports)
        self.c = StoreClient(cfg).start()
        end = time.monotonic() + 60
        while self.c.stats().get("servers", 0) < 1:
            if time.monotonic() > end or self.procs[1].poll() is not None:
                raise RuntimeError("our store server did not mount its memory")
            time.sleep(0.05)

    def put(self, key: str, value: Any) -> None:
        self.c.put(key, value)

    def get(self, key: str) -> Any:
        v = self.c.get(key)
        if v is None:
            raise RuntimeError(f"ours: miss on {key}")
        return v

    def get_into(self, key: str, addr: int, size: int) -> None:
        if self.c.get_into(key, addr, size) is None:
            raise RuntimeError(f"ours: miss on {key}")

    def put_batch(self, keys: list[str], values: list[Any]) -> None:
        errs = [e for e in self.c.put_batch(keys, values) if e is not None]
        if errs:
            raise RuntimeError(f"ours: put_batch failed: {errs[0]}")

    def get_batch(self, keys: list[str]) -> Any:
        out = self.c.get_batch(keys)
        if any(v is None for v in out):
            raise RuntimeError("ours: miss in get_batch")
        return out

    def batch_get_into(self, keys: list[str], addrs: list[int], sizes: list[int]) -> None:
        out = self.c.batch_get_into(keys, addrs, sizes)
        if any(not isinstance(v, int) for v in out):
            raise RuntimeError(f"ours: batch_get_into failed: {out}")

    def register(self, arr: Any) -> None:
        self.c.register_buffer(arr)

    def clear(self) -> None:
        self.c.remove_all(force=True)

    def close(self) -> None:
        self.c.close()
        super().close()


class _Mooncake(_System):
    name = "mooncake"

    def __init__(self, memory: int) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.procs: list[subprocess.Popen[Any]] = []
        master, meta = start_mooncake_store(memory, self.procs)
        self.c = MooncakeDistributedStore()
        if self.c.setup("127.0.0.1", meta, 0, 256 << 20, "tcp", "", master) != 0:
            raise RuntimeError("Mooncake client setup failed")

    def put(self, key: str, value: Any) -> None:
        if self.c.put(key, value) != 0:
            raise RuntimeError(f"mooncake: put {key} failed")

    def get(self, key: str) -> Any:
        v = self.c.get(key)
        if not v:
            raise RuntimeError(f"mooncake: miss on {key}")
        return v

    def get_into(self, key: str, addr: int, size: int) -> None:
        if self.c.get_into(key, addr, size) < 0:
            raise RuntimeError(f"mooncake: get_into {key} failed")

    def put_batch(self, keys: list[str], values: list[Any]) -> None:
        if self.c.put_batch(keys, values) != 0:
            raise RuntimeError("mooncake: put_batch failed")

    def get_batch(self, keys: list[str]) -> Any:
        out = self.c.get_batch(keys)
        if any(not v for v in out):
            raise RuntimeError("mooncake: miss in get_batch")
        return out

    def batch_get_into(self, keys: list[str], addrs: list[int], sizes: list[int]) -> None:
        out = self.c.batch_get_into(keys, addrs, sizes)
        if any(v < 0 for v in out):
            raise RuntimeError(f"mooncake: batch_get_into failed: {out}")

    def register(self, arr: Any) -> None:
        if self.c.register_buffer(int(arr.ctypes.data), int(arr.nbytes)) != 0:
            raise RuntimeError("mooncake: register_buffer failed")

    def clear(self) -> None:
        self.c.remove_all(True)

    def close(self) -> None:
        self.c.close()
        owner = self.procs[1]
        if owner.stdin is not None:
            owner.stdin.close()
        super().close()


def _parse_batches(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        if item.strip():
            n, _, sz = item.strip().lower().partition("x")
            if not n.isdigit() or not sz:
                raise ConfigError(f"bad batch {item!r}: use COUNTxSIZE, e.g. 64x4K")
            out.append((int(n), parse_size(sz)))
    return out


def _fmt(n: int) -> str:
    for unit, mult in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{unit}"
    return str(n)


Call = Callable[[], Any]
_CHUNK = 8  # calls per turn when the systems alternate


def _single_calls(sysm: _System, keys: list[str], v: Any, dest: Any) -> dict[str, list[Call]]:
    addr, size = int(dest.ctypes.data), len(v)

    def put(k: str) -> Call:
        return lambda: sysm.put(k, v)

    def get(k: str) -> Call:
        return lambda: sysm.get(k)

    def get_into(k: str) -> Call:
        return lambda: sysm.get_into(k, addr, size)

    return {
        "put": [put(k) for k in keys],
        "get": [get(k) for k in keys],
        "get_into": [get_into(k) for k in keys],
    }


def _batch_calls(
    sysm: _System, groups: list[list[str]], v: Any, dest: Any
) -> dict[str, list[Call]]:
    size = len(v)
    count = len(groups[0])
    addrs = [int(dest.ctypes.data) + i * size for i in range(count)]
    values = [v] * count
    sizes = [size] * count

    def put(g: list[str]) -> Call:
        return lambda: sysm.put_batch(g, values)

    def get(g: list[str]) -> Call:
        return lambda: sysm.get_batch(g)

    def get_into(g: list[str]) -> Call:
        return lambda: sysm.batch_get_into(g, addrs, sizes)

    return {
        "put_batch": [put(g) for g in groups],
        "get_batch": [get(g) for g in groups],
        "batch_get_into": [get_into(g) for g in groups],
    }


def _ops_for(size: int, scale: float) -> int:
    return max(8, int(min(1000, (48 << 20) // size) * scale))


def run_store_benchmark(
    rounds: int = 3,
    sizes: str = "4K,256K,4M",
    batches: str = "64x4K,16x4M",
    memory: str = "1G",
    scale: float = 1.0,
    with_mooncake: bool = True,
    ours: tuple[str, ...] = ("ours", "ours-tcp"),
) -> dict[str, Any]:
    import numpy as np

    for name in ours:
        if name not in OUR_VARIANTS:
            raise ConfigError(f"unknown variant {name!r} of ours; known: {sorted(OUR_VARIANTS)}")

    size_list = [parse_size(s) for s in sizes.split(",") if s.strip()]
    batch_list = _parse_batches(batches)
    mem = parse_size(memory)
    notes: list[str] = []
    systems: list[_System] = []
    samples: dict[str, dict[str, list[tuple[float, list[float], int, int]]]] = {}
    try:
        systems.extend(_Ours(mem, name) for name in ours)
        if with_mooncake:
            try:
                import mooncake.store  # noqa: F401

                systems.append(_Mooncake(mem))
            except ImportError:
                notes.append(
                    "Mooncake wheel not installed: pip install mooncake-transfer-engine-non-cuda"
                )
            except RuntimeError as exc:
                notes.append(f"Mooncake store could not run here: {exc}")
        biggest = max([*size_list, *(n * s for n, s in batch_list), 1])
        dest = np.zeros(biggest, dtype=np.uint8)
        for sysm in systems:
            sysm.register(dest)
        rng = np.random.default_rng(0)
        values = {s: rng.integers(0, 256, size=s, dtype=np.uint8) for s in size_list}
        for _, s in batch_list:
            values.setdefault(s, rng.integers(0, 256, size=s, dtype=np.uint8))

        def measure(
            label: str, calls: dict[str, list[Callable[[], Any]]], nbytes: int, per_call: int
        ) -> None:
            """Run each system's calls in alternating chunks (noise hits both alike)."""
            wall = dict.fromkeys(calls, 0.0)
            lat: dict[str, list[float]] = {name: [] for name in calls}
            n = len(next(iter(calls.values())))
            for c0 in range(0, n, _CHUNK):
                for name, fns in calls.items():
                    t0 = time.perf_counter()
                    for fn in fns[c0 : c0 + _CHUNK]:
                        a = time.perf_counter()
                        fn()
                        lat[name].append(time.perf_counter() - a)
                    wall[name] += time.perf_counter() - t0
            for name in calls:
                samples.setdefault(label, {}).setdefault(name, []).append(
                    (wall[name], lat[name], nbytes, per_call * n)
                )

        for rnd in range(rounds + 1):  # round 0 warms up (connections, mappings); not kept
            tag = "" if rnd else "warmup "
            for size in size_list:
                n = _ops_for(size, scale)
                keys = [f"r{rnd}-s{size}-{i}" for i in range(n)]
                per = {m.name: _single_calls(m, keys, values[size], dest) for m in systems}
                for op in ("put", "get", "get_into"):
                    calls = {name: ops[op] for name, ops in per.items()}
                    measure(f"{tag}{op} {_fmt(size)}", calls, n * size, 1)
                for sysm in systems:
                    sysm.clear()
            for count, size in batch_list:
                calls_n = max(4, _ops_for(count * size, scale))
                label = f"{count}x{_fmt(size)}"
                groups = [
                    [f"r{rnd}-b{label}-{c}-{i}" for i in range(count)] for c in range(calls_n)
                ]
                per = {m.name: _batch_calls(m, groups, values[size], dest) for m in systems}
                for op in ("put_batch", "get_batch", "batch_get_into"):
                    calls = {name: ops[op] for name, ops in per.items()}
                    measure(f"{tag}{op} {label}", calls, calls_n * count * size, count)
                for sysm in systems:
                    sysm.clear()
    finally:
        for sysm in systems:
            try:
                sysm.close()
            except Exception as exc:  # report, keep closing the others
                notes.append(f"closing {sysm.name}: {exc}")
    return _summarise(samples, rounds, notes)


def _summarise(
    samples: dict[str, dict[str, list[tuple[float, list[float], int, int]]]],
    rounds: int,
    notes: list[str],
) -> dict[str, Any]:
    results: dict[str, dict[str, dict[str, float]]] = {}
    for label, per in samples.items():
        if label.startswith("warmup"):
            continue
        row = {}
        for name, runs in per.items():
            lat = sorted(x for _, ls, _, _ in runs for x in ls)
            row[name] = {
                "ops_s": round(statistics.median(ops / wall for wall, _, _, ops in runs), 1),
                "gb_s": round(statistics.median(nb / wall / 1e9 for wall, _, nb, _ in runs), 3),
                "p50_us": round(lat[len(lat) // 2] * 1e6, 1),
                "p99_us": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e6, 1),
            }
        results[label] = row
    ratios = {
        name: {
            label: round(row[name]["ops_s"] / row["mooncake"]["ops_s"], 2)
            for label, row in results.items()
            if name in row and "mooncake" in row
        }
        for name in OUR_VARIANTS
    }
    return {
        "benchmark": "store",
        "unit": "ops/s and GB/s: median of rounds; latency of one call in µs over all rounds",
        "rounds": rounds,
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "results": results,
        "systems": {
            name: ",".join(OUR_VARIANTS.get(name, ("tcp",)))
            for name in sorted({n for row in results.values() for n in row})
        },
        # Mooncake's tcp has no same-host shortcut: ours-tcp is the like-for-like headline.
        "ratios_ours_tcp_vs_mooncake": ratios["ours-tcp"],
        "ratios_ours_vs_mooncake": ratios["ours"],
        "load_average": loadavg(),
        "notes": notes,
    }
