"""LMCache chunk put/get through our plugin versus LMCache's own ``mooncakestore`` connector.

    python -m mooncake_connectors.bench.lmcache [--chunks 256K,2M,8M] [--batch 8]
        [--rounds 5] [--calls 4] [--memory 1G] [--modes zero-copy,metadata]
    [--ours-transports shm,tcp] [--no-tcp-only] [--no-alias] [-o out.json]

JSON on stdout. Both systems run as LMCache users run them: the store as processes (ours: a
``master`` and a ``store-server``; Mooncake's wheel: ``mooncake_master`` with its HTTP metadata
server and a data-owner process contributing the memory), and LMCache's own StorageManager in this
process with the system's connector loaded through ``remote_storage_plugins``. A put is what
LMCache's RemoteBackend schedules on its event loop (the wrapped connector's ``batched_put``,
awaited here); a get is ``RemoteBackend.batched_get_blocking``. Each call moves ``batch`` chunks
of real MemoryObjs; every get is checked for misses. Modes: ``zero-copy`` (ours layout raw,
LMCache's connector ``save_chunk_meta: false``, both pass MemoryObj addresses) and ``metadata``
(ours layout framed, LMCache's ``save_chunk_meta: true``, both store a header and copy).
Rounds interleave the two systems so machine noise hits both alike. Mooncake's wheel moves data
over TCP here (``protocol: tcp``); ours uses shared memory for a store server on the same host
unless ``--ours-transports tcp``. Ours also runs TCP only in the same window (``ours-tcp``: data
and control messages over loopback TCP; ``--no-tcp-only`` skips it), and its
``throughput_ratio_tcp`` is the like-for-like figure against Mooncake's tcp.

``lmcache-alias`` (``--no-alias`` skips it): LMCache's same ``mooncakestore`` connector,
unmodified, on our store through the ``mooncake`` alias, TCP only (data and control), in its own
process (the alias cannot share a process with the real ``mooncake`` the wheel's run imports);
its rounds interleave with the others'. ``throughput_ratio_alias`` is it against the wheel: the
same LMCache code, ours underneath vs Mooncake's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import select
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.event_manager import EventManager
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.storage_manager import StorageManager

from ..store.client import StoreClient
from ..store.config import ClientConfig, parse_size
from .procs import CLI, _stop, loadavg, start_master, start_mooncake_store

TOKENS = 256  # LMCache's default chunk_size
HEAD_SIZE = 128
TOKEN_LAYER_BYTES = 2 * HEAD_SIZE * 2  # K and V of one head, bf16
PLUGIN = "mooncake_connectors"


ALIAS = "lmcache-alias"


@dataclass(frozen=True)
class Where:
    """Where the two stores answer."""

    ours: str
    mooncake_master: str
    mooncake_metadata: str


class Stores:
    """Both stores as processes, for the whole run."""

    def __init__(self, memory: int) -> None:
        self.procs: list[subprocess.Popen[Any]] = []
        env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"}

        def quiet(args: list[str]) -> subprocess.Popen[Any]:
            out = subprocess.DEVNULL
            self.procs.append(subprocess.Popen(args, stdout=out, stderr=out, env=env))
            return self.procs[-1]

        try:  # what started is stopped when a later step fails
            self.ours = start_master([], self.procs, env)
            quiet([*CLI, "store-server", "--master", self.ours, "--memory", str(memory)])
            with StoreClient(ClientConfig(master=self.ours)) as probe:
                end = time.monotonic() + 60
                while probe.stats().get("servers", 0) < 1:
                    if time.monotonic() > end or self.procs[-1].poll() is not None:
                        raise RuntimeError("our store server did not mount its memory")
                    time.sleep(0.05)
            self.mooncake_master, self.mooncake_metadata = start_mooncake_store(memory, self.procs)
        except BaseException:
            self.close()
            raise
        self.where = Where(self.ours, self.mooncake_master, self.mooncake_metadata)

    def close(self) -> None:
        for p in reversed(self.procs):
            if p.stdin is not None:
                p.stdin.close()
            _stop(p)


def _config(system: str, mode: str, stores: Where, cpu_gib: float, transports: str) -> Any:
    zero_copy = mode == "zero-copy"
    if system.startswith("ours"):
        if system == "ours-tcp":
            transports = "tcp"
        extra: dict[str, Any] = {
            f"remote_storage_plugin.{PLUGIN}.module_path": "mooncake_connectors.adapters.lmcache",
            f"remote_storage_plugin.{PLUGIN}.class_name": "StoreConnector",
            f"remote_storage_plugin.{PLUGIN}.master": stores.ours,
            f"remote_storage_plugin.{PLUGIN}.layout": "raw" if zero_copy else "framed",
            f"remote_storage_plugin.{PLUGIN}.timeout": 30,
            f"remote_storage_plugin.{PLUGIN}.local_buffer_size": "256M",
            f"remote_storage_plugin.{PLUGIN}.transports": transports,
        }
        plugin = PLUGIN
    else:
        # LMCache 0.5.6 forwards ``master_server_address`` under that name, which Mooncake
        # 0.3.13's dict setup ignores; the ``mooncake_`` prefix passes Mooncake's own key.
        # The alias run: the same keys, our master, Mooncake's P2P handshake (no metadata
        # server); its process has MOONCAKE_CONNECTORS_TRANSPORTS=tcp.
        alias = system == ALIAS
        extra = {
            "local_hostname": "127.0.0.1",
            "metadata_server": "P2PHANDSHAKE" if alias else stores.mooncake_metadata,
            "mooncake_master_server_addr": stores.ours if alias else stores.mooncake_master,
            "global_segment_size": 0,
            "local_buffer_size": 256 << 20,
            "protocol": "tcp",
            "device_name": "",
            "save_chunk_meta": not zero_copy,
            "transfer_timeout": 30,
        }
        plugin = "mooncakestore"
    return LMCacheEngineConfig.from_defaults(
        chunk_size=TOKENS,
        local_cpu=False,
        max_local_cpu_size=cpu_gib,
        remote_serde="naive",
        remote_storage_plugins=[plugin],
        extra_config=extra,
    )


class System:
    """One LMCache StorageManager whose remote backend is one system's connector."""

    def __init__(
        self, name: str, mode: str, stores: Where, layers: int, cpu_gib: float, transports: str
    ):
        self.name = name
        meta = LMCacheMetadata(
            model_name="bench",
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=torch.bfloat16,
            kv_shape=(layers, 2, TOKENS, 1, HEAD_SIZE),
            chunk_size=TOKENS,
        )
        config = _config(name, mode, stores, cpu_gib, transports)
        self.sm = StorageManager(config, meta, EventManager())
        plugin = PLUGIN if name.startswith("ours") else "mooncakestore"
        self.backend = self.sm.storage_backends[f"RemoteBackend-{plugin}"]
        if self.backend.connection is None:
            raise RuntimeError(f"{name}: LMCache could not create the connector")
        self.shape = torch.Size([2, layers, TOKENS, HEAD_SIZE])
        self.seq = 0

    def chunks(self, n: int, fill: np.ndarray[Any, Any]) -> list[Any]:
        objs = []
        for _ in range(n):
            obj = self.sm.allocate(self.shape, torch.bfloat16, MemoryFormat.KV_2LTD)
            if obj is None:
                raise RuntimeError("LMCache's CPU buffer is full")
            obj.byte_array.cast("B")[:] = fill
            objs.append(obj)
        return objs

    def keys(self, n: int) -> list[Any]:
        self.seq += n
        return [CacheEngineKey("bench", 1, 0, self.seq - i, torch.bfloat16) for i in range(n)]

    def put(self, keys: list[Any], objs: list[Any]) -> float:
        for obj in objs:
            obj.ref_count_up()  # the wrapped connector drops one per object when done
        t0 = time.perf_counter()
        fut = asyncio.run_coroutine_threadsafe(
            self.backend.connection.batched_put(keys, objs), self.sm.loop
        )
        fut.result(120)
        return time.perf_counter() - t0

    def get(self, keys: list[Any], fill: np.ndarray[Any, Any], check: bool) -> float:
        t0 = time.perf_counter()
        objs = self.backend.batched_get_blocking(keys)
        took = time.perf_counter() - t0
        try:
            missing = sum(o is None for o in objs)
            if missing:
                raise RuntimeError(f"{self.name}: {missing} of {len(keys)} chunks missing")
            if check and not all(
                np.array_equal(np.frombuffer(o.byte_array, np.uint8), fill) for o in objs
            ):
                raise RuntimeError(f"{self.name}: a chunk came back different")
        finally:
            for o in objs:
                if o is not None:
                    o.ref_count_down()
        return took

    def round(self, calls: int, batch: int, fill: np.ndarray[Any, Any]) -> dict[str, list[float]]:
        """``calls`` put+get pairs of ``batch`` chunks (the first get's bytes checked)."""
        out: dict[str, list[float]] = {"put": [], "get": []}
        for c in range(calls):
            keys, objs = self.keys(batch), self.chunks(batch, fill)
            out["put"].append(self.put(keys, objs))
            for o in objs:
                o.ref_count_down()
            out["get"].append(self.get(keys, fill, check=c == 0))
        return out

    def clear(self) -> None:
        conn = self.backend.connection.getWrappedConnector()
        if self.name.startswith("ours"):
            conn.guard.client().remove_all(force=True)
        else:
            conn.store.remove_all(True)

    def close(self) -> None:
        self.sm.close()


class AliasSystem:
    """:class:`System` ``lmcache-alias`` in a child process (``--worker``), one JSON line per
    command: the alias switched on there before LMCache imports ``mooncake``."""

    def __init__(self, mode: str, stores: Where, layers: int, cpu_gib: float) -> None:
        self.name = ALIAS
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115  (closed by close())
        env = {
            **os.environ,
            "MOONCAKE_CONNECTORS_AS_MOONCAKE": "1",
            "MOONCAKE_CONNECTORS_TRANSPORTS": "tcp",
        }
        spec = {"mode": mode, "where": asdict(stores), "layers": layers, "cpu_gib": cpu_gib}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", f"{__package__}.lmcache", "--worker", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
        )
        try:
            store = self._call({"cmd": "ready"}, timeout=600)  # imports torch and LMCache
            if not str(store).startswith("mooncake_connectors."):
                raise RuntimeError(f"{ALIAS}: LMCache's connector got {store}, not our facade")
        except BaseException:
            _stop(self.proc)  # not in the caller's list yet: nobody else would stop it
            self.log.close()
            raise

    def _call(self, req: dict[str, Any], timeout: float = 600) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        if not select.select([self.proc.stdout], [], [], timeout)[0]:
            raise RuntimeError(f"{ALIAS} worker: no answer to {req['cmd']} within {timeout}s")
        line = self.proc.stdout.readline()  # one reply line, or EOF when the worker exited
        reply = json.loads(line) if line else {"error": f"exited rc={self.proc.wait(30)}"}
        if "error" in reply:
            self.log.seek(0)
            tail = self.log.read()[-3000:]
            raise RuntimeError(f"{ALIAS} worker: {reply['error']}\n{tail}")
        return reply["ok"]

    def round(self, calls: int, batch: int, fill: np.ndarray[Any, Any]) -> dict[str, list[float]]:
        seed = int(fill.size)  # the worker rebuilds the same fill from the chunk size
        out: dict[str, list[float]] = self._call(
            {"cmd": "round", "calls": calls, "batch": batch, "seed": seed}
        )
        return out

    def clear(self) -> None:
        self._call({"cmd": "clear"})

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self._call({"cmd": "quit"})
        finally:
            _stop(self.proc)
            self.log.close()


def _fill(chunk_bytes: int) -> np.ndarray[Any, Any]:
    return np.random.default_rng(chunk_bytes).integers(0, 256, chunk_bytes, np.uint8)


def worker(spec_json: str) -> None:
    """The ``lmcache-alias`` system's process: commands on stdin, one JSON reply line each."""
    from ..compat_alias import install_from_env

    if not install_from_env():
        raise SystemExit("the worker needs MOONCAKE_CONNECTORS_AS_MOONCAKE=1")
    spec = json.loads(spec_json)
    system: System | None = None
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if system is None:
                system = System(
                    ALIAS, spec["mode"], Where(**spec["where"]), spec["layers"], spec["cpu_gib"], ""
                )
            if req["cmd"] == "quit":
                reply: dict[str, Any] = {"ok": True}
            elif req["cmd"] == "ready":
                reply = {
                    "ok": type(system.backend.connection.getWrappedConnector().store).__module__
                }
            elif req["cmd"] == "round":
                reply = {"ok": system.round(req["calls"], req["batch"], _fill(req["seed"]))}
            elif req["cmd"] == "clear":
                system.clear()
                reply = {"ok": True}
            else:
                reply = {"error": f"unknown command {req['cmd']!r}"}
        except Exception as exc:  # reported to the parent, which stops the run
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), flush=True)
        if req["cmd"] == "quit" or "error" in reply:
            break
    if system is not None:
        system.close()


def _summary(lat: list[float], chunk_bytes: int, batch: int) -> dict[str, float]:
    total = sum(lat)
    ordered = sorted(lat)
    return {
        "calls": len(lat),
        "chunks_per_s": round(len(lat) * batch / total, 1),
        "gb_per_s": round(len(lat) * batch * chunk_bytes / total / 1e9, 3),
        "p50_ms": round(statistics.median(lat) * 1e3, 3),
        "p99_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e3, 3),
    }


def run(
    chunks: list[int],
    batch: int,
    rounds: int,
    calls: int,
    memory: int,
    modes: list[str],
    transports: str = "shm,tcp",
    tcp_only: bool = True,
    alias: bool = True,
) -> dict[str, Any]:
    stores = Stores(memory)
    cases = []
    try:
        for chunk_bytes in chunks:
            layers = chunk_bytes // (TOKENS * TOKEN_LAYER_BYTES)
            if layers < 1 or layers * TOKENS * TOKEN_LAYER_BYTES != chunk_bytes:
                raise SystemExit(f"chunk size {chunk_bytes} is not a multiple of 128 KiB")
            cpu_gib = max(0.1, 2.5 * batch * chunk_bytes / 2**30)
            fill = _fill(chunk_bytes)
            for mode in modes:
                systems: list[System | AliasSystem] = []
                lat: dict[tuple[str, str], list[float]] = {}
                try:
                    for n in ("ours", *(("ours-tcp",) if tcp_only else ()), "lmcache"):
                        systems.append(System(n, mode, stores.where, layers, cpu_gib, transports))
                    if alias:
                        systems.append(AliasSystem(mode, stores.where, layers, cpu_gib))
                    for r in range(rounds + 1):  # round 0 warms up
                        for s in systems:
                            took = s.round(calls, batch, fill)
                            if r:
                                for op in ("put", "get"):
                                    lat.setdefault((s.name, op), []).extend(took[op])
                            s.clear()
                finally:
                    for s in systems:
                        s.close()
                for op in ("put", "get"):
                    ours = _summary(lat[("ours", op)], chunk_bytes, batch)
                    theirs = _summary(lat[("lmcache", op)], chunk_bytes, batch)
                    cases.append(
                        {
                            "chunk_bytes": chunk_bytes,
                            "batch": batch,
                            "mode": mode,
                            "op": op,
                            "ours": ours,
                            "lmcache_mooncakestore": theirs,
                            "throughput_ratio": round(ours["gb_per_s"] / theirs["gb_per_s"], 2),
                        }
                    )
                    if (ALIAS, op) in lat:
                        via = _summary(lat[(ALIAS, op)], chunk_bytes, batch)
                        cases[-1]["lmcache_mooncakestore_alias_tcp"] = via
                        cases[-1]["throughput_ratio_alias"] = round(
                            via["gb_per_s"] / theirs["gb_per_s"], 2
                        )
                    if ("ours-tcp", op) in lat:
                        tcp = _summary(lat[("ours-tcp", op)], chunk_bytes, batch)
                        cases[-1]["ours_tcp"] = tcp
                        cases[-1]["throughput_ratio_tcp"] = round(
                            tcp["gb_per_s"] / theirs["gb_per_s"], 2
                        )
    finally:
        stores.close()
    return {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "settings": {
            "chunk_tokens": TOKENS,
            "rounds": rounds,
            "calls_per_round": calls,
            "ours_transports": transports,
            "mooncake_protocol": "tcp",
            "alias_transports": "tcp" if alias else None,
        },
        "load_average": loadavg(),
        "cases": cases,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--chunks", default="256K,2M,8M", help="chunk sizes, multiples of 128K")
    ap.add_argument("--batch", type=int, default=8, help="chunks per call")
    ap.add_argument("--rounds", type=int, default=5, help="measured rounds (+1 warm-up)")
    ap.add_argument("--calls", type=int, default=4, help="put+get calls per round and system")
    ap.add_argument("--memory", default="1G", help="memory of each store's data owner")
    ap.add_argument("--modes", default="zero-copy,metadata")
    ap.add_argument(
        "--ours-transports",
        default="shm,tcp",
        help="our client's transports (tcp alone matches Mooncake's tcp protocol)",
    )
    ap.add_argument(
        "--no-tcp-only",
        dest="tcp_only",
        action="store_false",
        help="skip the TCP-only run of ours (by default it runs in the same window)",
    )
    ap.add_argument(
        "--no-alias",
        dest="alias",
        action="store_false",
        help="skip LMCache's mooncakestore connector on our store through the mooncake alias",
    )
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # the alias system's child process
    ap.add_argument("-o", "--output", help="also write the JSON here")
    a = ap.parse_args(argv)
    if a.worker:
        return worker(a.worker)
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if not set(modes) <= {"zero-copy", "metadata"} or a.batch < 1 or a.rounds < 1:
        raise SystemExit("modes: zero-copy and/or metadata; batch and rounds >= 1")
    result = run(
        [parse_size(c) for c in a.chunks.split(",") if c.strip()],
        a.batch,
        a.rounds,
        a.calls,
        parse_size(a.memory),
        modes,
        a.ours_transports,
        a.tcp_only,
        a.alias,
    )
    text = json.dumps(result, indent=2)
    if a.output:
        with open(a.output, "w") as fh:
            fh.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
