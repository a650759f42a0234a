"""``mooncake-connectors bench sglang``: HiCache page batches through our backend and SGLang's own.

Both backends are built by SGLang's ``StorageBackendFactory`` over the same kind of real SGLang
host pool (CPU, ``pin_memory=False``) and used through the calls SGLang's cache controller makes:
``batch_set_v1`` (backup), ``batch_exists`` (hit query), ``batch_get_v1`` (prefetch), one call per
batch of ``pages`` pages. Systems, each as users run it — a master process, a data-owner process
holding the memory, the backend in this process as a pure client:

  ours        HiCacheStore, our ``master`` and ``store-server``, default transports (shm, tcp)
  ours_tcp    the same store, the backend TCP only: data over the tcp transport and control
              messages over loopback TCP, not the abstract unix socket (like Mooncake's here)
  mooncake    SGLang's MooncakeStore on the Mooncake wheel: ``mooncake_master`` and a
              ``MooncakeDistributedStore`` data owner, protocol tcp (the wheel has no shm path)

With ``mooncake_on_ours`` (``--mooncake-on-ours``) the ``mooncake`` system is SGLang's
MooncakeStore, unmodified, on our store instead: the ``mooncake`` alias is installed in this
process before SGLang imports ``mooncake.store``, its client is a pure client of our ``master``
and ``store-server`` (the ones ``ours`` uses), TCP only (data and control), and no wheel process
starts. One process cannot hold the wheel and the alias at once, so what switching that backend
to our store costs is two runs, one in each mode, in one window; ``ours_tcp`` runs in both and is
the yardstick between them (``system_mooncake`` in the JSON says which one ran).

Rounds interleave the systems so machine noise hits all alike; round 0 warms up and is dropped.
Per case, op and system: pages/s, GB/s, p50/p99 of one call (ms). Ratios: ours ÷ mooncake and
ours_tcp ÷ mooncake; against Mooncake's tcp the like-for-like headline is ours_tcp's.
"""

from __future__ import annotations

import logging
import os
import statistics
import subprocess
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch

from ..config import TRANSPORTS_ENV
from ..store.config import parse_size
from .procs import (
    CLI,
    _quiet,
    _stop,
    loadavg,
    machine,
    start_master,
    start_mooncake_store,
)

log = logging.getLogger(__name__)

# name -> (kind, layers, kv heads, head dim or MLA row, page size in tokens)
GEOMETRIES: dict[str, tuple[str, int, int, int, int]] = {
    "small": ("mha", 24, 2, 64, 64),  # Qwen2.5-0.5B-like: 384 KiB per K or V object
    "llama8b": ("mha", 32, 8, 128, 64),  # Llama-3-8B at TP1: 4 MiB per K or V object
    "mla": ("mla", 27, 1, 576, 64),  # DeepSeek-V2-Lite-like MLA: 1.9 MiB per page object
}


def _pool(geometry: str, layout: str, pages: int) -> Any:
    from .sglang_pool import make_cpu_host_pool

    kind, layers, heads, dim, page = GEOMETRIES[geometry]
    pool = make_cpu_host_pool(
        kind,
        layout,
        layers=layers,
        page=page,
        device_tokens=page,
        heads=heads,
        head_dim=dim,
        kv_lora_rank=dim - 64,  # MLA rows: kv_lora_rank + a 64-wide rope part
        rope_dim=64,
        host_to_device_ratio=1.0,
        host_token_capacity=2 * pages * page,  # source pages, then destination pages
    )
    pool.kv_buffer.view(-1).view(torch.uint8).random_(0, 256)
    return pool


def _storage_config(pool: Any, extra: dict[str, Any]) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=type(pool).__name__.startswith("MLA"),
        enable_storage_metrics=False,
        is_page_first_layout=pool.layout == "page_first",
        model_name="bench/model",
        extra_config=extra,
    )


class _Stores:
    """The store processes of every system, started once for the whole run."""

    def __init__(
        self, memory: int, with_mooncake: bool, notes: list[str], on_ours: bool = False
    ) -> None:
        self.procs: list[subprocess.Popen[Any]] = []
        cli = CLI
        self.ours = start_master([], self.procs)
        self.procs.append(
            _quiet([*cli, "store-server", "--master", self.ours, "--memory", str(memory)])
        )
        self.mooncake: tuple[str, str] | None = None
        self.store_class = ""  # the class of the mooncake system's client, once one is made
        self.on_ours = on_ours
        if on_ours:
            from ..compat_alias import install_as_mooncake

            install_as_mooncake()  # ConfigError if the wheel was imported first: never mixed
            self.mooncake = (self.ours, "P2PHANDSHAKE")
        elif with_mooncake:
            try:
                self.mooncake = self._start_mooncake(memory)
            except (ImportError, OSError, RuntimeError) as exc:
                notes.append(f"Mooncake could not run here: {exc}")

    def _start_mooncake(self, memory: int) -> tuple[str, str]:
        import mooncake.store  # noqa: F401  (ImportError: wheel missing)

        return start_mooncake_store(memory, self.procs)

    def backend(self, system: str, pool: Any) -> Any:
        from sglang.srt.mem_cache.storage import StorageBackendFactory

        if system == "mooncake":
            assert self.mooncake is not None
            addr, meta = self.mooncake
            extra: dict[str, Any] = {
                "master_server_address": addr,
                "metadata_server": meta,
                "protocol": "tcp",
                "device_name": "",
                "global_segment_size": 0,  # a pure client, like ours
                "local_hostname": "127.0.0.1",
            }
            if not self.on_ours:
                b = StorageBackendFactory.create_backend(
                    "mooncake", _storage_config(pool, extra), pool
                )
            else:  # the facade reads its transports from the environment at setup
                saved = os.environ.get(TRANSPORTS_ENV)
                os.environ[TRANSPORTS_ENV] = "tcp"
                try:
                    b = StorageBackendFactory.create_backend(
                        "mooncake", _storage_config(pool, extra), pool
                    )
                finally:
                    if saved is None:
                        os.environ.pop(TRANSPORTS_ENV, None)
                    else:
                        os.environ[TRANSPORTS_ENV] = saved
            store = type(getattr(b, "store", None))
            self.store_class = f"{store.__module__}.{store.__qualname__}"  # whose client it has
        else:
            extra = {
                "backend_name": "mooncake_connectors",
                "module_path": "mooncake_connectors.adapters.sglang",
                "class_name": "HiCacheStore",
                "interface_v1": 1,
                "master": self.ours,
                "timeout": 30.0,
                "rpc_timeout": 10.0,
                "staging_size": "256M",
            }
            if system == "ours_tcp":
                extra["transports"] = ["tcp"]
            b = StorageBackendFactory.create_backend("dynamic", _storage_config(pool, extra), pool)
        b.register_mem_pool_host(pool)
        return b

    @staticmethod
    def clear(system: str, backend: Any) -> None:
        if system == "mooncake":
            backend.store.remove_all(True)
        else:
            backend.store.remove_all(force=True)

    def close(self) -> None:
        for p in reversed(self.procs):
            if p.stdin is not None:
                p.stdin.close()
            _stop(p)


def run_sglang_benchmark(
    rounds: int = 3,
    cases: str = "small,llama8b,mla",
    pages: int = 16,
    memory: str = "1G",
    with_mooncake: bool = True,
    with_layer_first: bool = True,
    mooncake_on_ours: bool = False,
) -> dict[str, Any]:
    notes: list[str] = []
    mem = parse_size(memory)
    samples: dict[str, dict[str, dict[str, list[tuple[float, list[float], int]]]]] = {}
    stores = _Stores(mem, with_mooncake, notes, on_ours=mooncake_on_ours)
    try:
        for case in [c.strip() for c in cases.split(",") if c.strip()]:
            layouts = ["page_first"] + (["layer_first"] if with_layer_first else [])
            for layout in layouts:
                systems = ["ours", "ours_tcp"]
                if stores.mooncake is not None and layout == "page_first":
                    systems.append("mooncake")  # its MHA path refuses layer_first pools
                label = f"{case} {layout}"
                _run_case(stores, label, case, layout, systems, pages, mem, rounds, samples, notes)
    finally:
        stores.close()
    out = _summarise(samples, rounds, pages, notes)
    out["mooncake_store_class"] = stores.store_class
    out["system_mooncake"] = (
        "SGLang's MooncakeStore on mooncake-connectors (mooncake alias, tcp)"
        if mooncake_on_ours
        else "SGLang's MooncakeStore on the mooncake-transfer-engine wheel (tcp)"
    )
    return out


def _run_case(
    stores: _Stores,
    label: str,
    case: str,
    layout: str,
    systems: list[str],
    pages: int,
    memory: int,
    rounds: int,
    samples: dict[str, dict[str, dict[str, list[tuple[float, list[float], int]]]]],
    notes: list[str],
) -> None:
    pool = _pool(case, layout, pages)
    page = pool.page_size
    src = pool.alloc(pages * page)
    dst = pool.alloc(pages * page)
    probe = torch.zeros(page, dtype=torch.int64)
    page_bytes = sum(pool.get_page_buffer_meta(probe)[1])
    # Calls per round: as many batches as fit in half the store, at most 8, at least 2.
    calls = max(2, min(8, memory // 2 // max(1, pages * page_bytes)))
    backends = {s: stores.backend(s, pool) for s in systems}
    try:
        for rnd in range(rounds + 1):
            for system, backend in backends.items():
                keys = [[uuid.uuid4().hex for _ in range(pages)] for _ in range(calls)]

                what = f"{system} {label}"
                want = [True] * pages
                ops = {
                    "batch_set_v1": _timed(keys, backend.batch_set_v1, src, want, what),
                    "batch_exists": _timed(keys, backend.batch_exists, None, pages, what),
                    "batch_get_v1": _timed(keys, backend.batch_get_v1, dst, want, what),
                }
                if rnd == 0:
                    _check_bytes(pool, src, dst, label, system)
                else:
                    for op, lat in ops.items():
                        samples.setdefault(label, {}).setdefault(op, {}).setdefault(
                            system, []
                        ).append((sum(lat), lat, page_bytes))
                stores.clear(system, backend)
    finally:
        for backend in backends.values():
            backend.close()
        del pool


def _timed(
    batches: list[list[str]], call: Callable[..., Any], indices: Any, want: Any, what: str
) -> list[float]:
    """Seconds of each call of ``call`` (one per batch of keys); a failed call stops the run."""
    lat = []
    for keys in batches:
        t0 = time.perf_counter()
        out = call(keys) if indices is None else call(keys, indices)
        lat.append(time.perf_counter() - t0)
        if out != want:
            raise RuntimeError(f"{what}: {getattr(call, '__name__', call)} failed: {out}")
    return lat


def _check_bytes(pool: Any, src: Any, dst: Any, label: str, system: str) -> None:
    page = pool.page_size
    for i in range(0, len(src), page):
        a = pool.get_data_page(int(src[i]), flat=True).contiguous().view(torch.uint8)
        b = pool.get_data_page(int(dst[i]), flat=True).contiguous().view(torch.uint8)
        if not torch.equal(a, b):
            raise RuntimeError(f"{system} {label}: page {i // page} read back different bytes")
        pool.get_data_page(int(dst[i]), flat=False).zero_()


def _summarise(
    samples: dict[str, dict[str, dict[str, list[tuple[float, list[float], int]]]]],
    rounds: int,
    pages: int,
    notes: list[str],
) -> dict[str, Any]:
    results: dict[str, Any] = {}
    ratios: dict[str, dict[str, float]] = {}
    ratios_tcp: dict[str, dict[str, float]] = {}
    for label, ops in samples.items():
        results[label] = {}
        for op, per in ops.items():
            row: dict[str, dict[str, Any]] = {}
            for system, runs in per.items():
                lat = sorted(x for _, ls, _ in runs for x in ls)
                page_bytes = runs[0][2]
                pps = statistics.median(len(ls) * pages / wall for wall, ls, _ in runs)
                row[system] = {
                    "pages_s": round(pps, 1),
                    "gb_s": round(pps * page_bytes / 1e9, 3) if op != "batch_exists" else None,
                    "p50_ms": round(lat[len(lat) // 2] * 1e3, 2),
                    "p99_ms": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3, 2),
                    "page_bytes": page_bytes,
                }
            results[label][op] = row
            for ours, into in (("ours", ratios), ("ours_tcp", ratios_tcp)):
                if ours in row and "mooncake" in row:
                    into.setdefault(label, {})[op] = round(
                        row[ours]["pages_s"] / row["mooncake"]["pages_s"], 2
                    )
    return {
        "benchmark": "sglang-hicache",
        "unit": "pages/s and GB/s: median of rounds; latency of one call (one batch) in ms",
        "pages_per_call": pages,
        "rounds": rounds,
        "machine": machine(),
        "results": results,
        "ratios_ours_tcp_vs_mooncake": ratios_tcp,
        "ratios_ours_vs_mooncake": ratios,
        "load_average": loadavg(),
        "notes": notes,
    }
