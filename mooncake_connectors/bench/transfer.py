"""``mooncake-connectors bench transfer``: target and initiator in two processes on loopback.

Systems measured in the same run, interleaved round by round (the systems of a size in a new
order each round) so machine noise and order effects hit all alike:
  * ours over each selected transport (sync requests of each size, and one batch);
  * ``memcpy``: numpy copy between two pre-faulted anonymous buffers in one process;
  * ``memcpy_shm``: the same copy out of a memfd (shared memory) buffer, the ceiling a
    cross-process shared-memory copy can reach (shmem pages are 4 KiB where anonymous memory may
    get transparent huge pages);
Every system walks the same way through a span of the largest size (each op touches the next
block), so none is measured on one cache-hot address.
  * ``raw_socket``: a Python request/response loop over one loopback TCP socket with
    ``sendall``/``recv_into`` (the ceiling a TCP design in Python can hope for);
  * ``ours_tcp_one_stream``: the tcp transport with striping off (``stripes`` 1), beside
    ``ours_tcp``, which stripes transfers of 16 MiB and more over two connections;
  * ``ours_tcp_tls`` (``--tls``): the tcp transport over mutual TLS, both ends holding
    certificates from a fresh ``certs init`` CA, against a second target of ours;
  * ``mooncake_tcp``: Mooncake's own TransferEngine (tcp protocol, P2PHANDSHAKE) when its wheel is
    installed;
  * ``iperf3_1_stream`` / ``iperf3_2_streams`` (row ``STREAM``, ``--ceiling``): the kernel's
    loopback TCP rate as ``iperf3`` (a C program, 1 MiB writes) measures it, one second per
    round and stream count, when installed: what no TCP design here can beat by much.
GB/s = bytes moved / wall time, median over rounds. Ratios compare ours with the others.
``initiator_cpu_s_per_gb``: CPU seconds the initiator's process spent per GB moved (its every
thread: Mooncake's workers as ours), what spinning before sleeping costs beside what it saves.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from ..config import TLS_ENV, EngineConfig, tls_from_env
from ..errors import ConfigError
from ..types import TransferOp

log = logging.getLogger(__name__)

_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_Case = tuple[str, str, Callable[[], None], int]  # system, label, one round's work, bytes


def parse_size(text: str) -> int:
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = _UNITS.get(t[-1:], 1)
    digits = t[:-1] if t[-1:] in _UNITS else t
    if not digits.isdigit():
        raise ConfigError(f"bad size {text!r}: use e.g. 64K, 1M, 128M")
    return int(digits) * mult


# ---------------------------------------------------------------------------------------------
# target process
# ---------------------------------------------------------------------------------------------
def _target_main(kind: str, size: int, metadata: str) -> None:
    """Run in the child: expose ``size`` bytes, print one JSON line, serve until stdin closes."""
    import numpy as np

    info: dict[str, Any]
    keep: list[Any] = []
    if kind in ("ours", "ours_tls"):
        from ..transfer_core.engine import TransferEngine

        tls = tls_from_env() if kind == "ours_tls" else None
        cfg = EngineConfig(metadata=metadata).replace(**(tls.fields() if tls else {}))
        eng = TransferEngine(cfg).start()
        buf = eng.allocate_buffer(size)
        buf.array[:] = 7
        info = {"segment": eng.segment_name, "addr": buf.addr}
        keep.append(eng)
    elif kind == "mooncake":
        from mooncake.engine import TransferEngine as MooncakeTE

        te = MooncakeTE()
        rc = te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise SystemExit(f"mooncake initialize failed: {rc}")
        arr = np.ones(size, dtype=np.uint8)
        rc = te.register_memory(arr.ctypes.data, size)
        if rc != 0:
            raise SystemExit(f"mooncake register_memory failed: {rc}")
        info = {"segment": f"127.0.0.1:{te.get_rpc_port()}", "addr": int(arr.ctypes.data)}
        keep += [te, arr]
    elif kind == "raw":
        import threading

        arr = np.ones(size, dtype=np.uint8)
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen(4)

        def serve(conn: socket.socket) -> None:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            mv = memoryview(arr.data)
            hdr = bytearray(17)
            try:
                while True:
                    if conn.recv_into(hdr, 17, socket.MSG_WAITALL) < 17:
                        return
                    n = int.from_bytes(hdr[1:9], "little")
                    o = int.from_bytes(hdr[9:17], "little")
                    if hdr[0] == 0:  # read: send n bytes from offset o
                        conn.sendall(mv[o : o + n])
                    else:  # write: receive n bytes at offset o, ack
                        got = 0
                        while got < n:
                            got += conn.recv_into(mv[o + got : o + n], n - got, socket.MSG_WAITALL)
                        conn.sendall(b"k")
            except OSError:
                return

        def accept() -> None:
            while True:
                c, _ = srv.accept()
                threading.Thread(target=serve, args=(c,), daemon=True).start()

        threading.Thread(target=accept, daemon=True).start()
        info = {"port": srv.getsockname()[1]}
        keep += [arr, srv]
    else:
        raise SystemExit(f"unknown target kind {kind}")
    sys.stdout.write(json.dumps(info) + "\n")
    sys.stdout.flush()
    sys.stdin.read()  # until the parent closes our stdin


class _Target:
    def __init__(
        self, kind: str, size: int, metadata: str, env: dict[str, str] | None = None
    ) -> None:
        code = (
            "import sys; from mooncake_connectors.bench.transfer import _target_main;"
            "_target_main(sys.argv[1], int(sys.argv[2]), sys.argv[3])"
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, kind, str(size), metadata],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.close()
            raise RuntimeError(f"{kind} target failed to start (exit {self.proc.returncode})")
        self.info: dict[str, Any] = json.loads(line)

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


# ---------------------------------------------------------------------------------------------
# measurement
# ---------------------------------------------------------------------------------------------
def _ops_for(size: int) -> int:
    return max(1, min(2000, (96 << 20) // size))


def _offsets(size: int, span: int) -> list[int]:
    """Each op of a round touches the next ``size`` bytes of the span, as real KV transfers
    touch new blocks; repeating one cache-hot address would flatter small sizes."""
    per = max(1, span // size)
    return [(i % per) * size for i in range(_ops_for(size))]


def _rate(fn: Callable[[], None], nbytes: int) -> tuple[float, float]:
    """GB/s, and the CPU seconds this (the initiator's) process spent per GB meanwhile: all
    its threads, Mooncake's workers and ours alike, spinning or copying."""
    c0 = time.process_time()
    t0 = time.perf_counter()
    fn()
    wall = time.perf_counter() - t0
    return nbytes / wall / 1e9, (time.process_time() - c0) / (nbytes / 1e9)


def run_transfer_benchmark(
    transports: list[str],
    rounds: int = 7,
    sizes: str = "64K,1M,16M,128M",
    batch: str = "256x256K",
    with_mooncake: bool = True,
    progress: Callable[[int, int], None] | None = None,
    tls: bool = False,
    ceiling: bool = True,
) -> dict[str, Any]:
    """Run the benchmark; ``progress(done, total)`` is called after each measured case."""
    import numpy as np

    from ..transfer_core.engine import TransferEngine, TransferRequest
    from ..transfer_core.memory import SharedBuffer
    from ..transfer_core.metadata.http import MetadataHTTPServer
    from . import tcp_ceiling

    size_list = [parse_size(s) for s in sizes.split(",") if s.strip()]
    batch_n, batch_sz = 0, 0
    if batch:
        n_s, _, sz_s = batch.lower().partition("x")
        batch_n, batch_sz = int(n_s), parse_size(sz_s)
    span = max([*size_list, batch_n * batch_sz, 1])

    load_start = os.getloadavg()  # GB/s here are wall-clock: other jobs' load shows in them
    meta = MetadataHTTPServer("127.0.0.1", 0).start()
    targets: dict[str, _Target] = {}
    engines: dict[str, TransferEngine] = {}
    local: Any = None
    shm_keep: list[Any] = []
    results: dict[str, dict[str, list[float]]] = {}
    cpu: dict[str, dict[str, list[float]]] = {}
    notes: list[str] = []
    try:
        targets["ours"] = _Target("ours", span, meta.url)
        targets["raw"] = _Target("raw", span, meta.url)
        if with_mooncake:
            try:
                import mooncake.engine  # noqa: F401

                targets["mooncake"] = _Target(
                    "mooncake", span, meta.url, env={"MC_TCP_BIND_ADDRESS": "127.0.0.1"}
                )
            except ImportError:
                notes.append(
                    "mooncake wheel not installed: pip install mooncake-transfer-engine-non-cuda"
                )
        for t in transports:
            engines[t] = TransferEngine(EngineConfig(metadata=meta.url, transports=(t,))).start()
        if "tcp" in transports:  # what striping large transfers over connections buys
            one = EngineConfig(
                metadata=meta.url, transports=("tcp",), transport_settings={"tcp": {"stripes": 1}}
            )
            engines["tcp_one_stream"] = TransferEngine(one).start()
        if tls:
            import tempfile

            from .. import certs

            pki = certs.init(tempfile.mkdtemp(prefix="mc-bench-tls-"), ("target", "initiator"))
            env = {TLS_ENV["cert"]: str(pki["target"]), TLS_ENV["key"]: str(pki["target-key"])}
            env[TLS_ENV["ca"]] = str(pki["ca"])
            targets["ours_tls"] = _Target("ours_tls", span, meta.url, env=env)
            files = {"tls_cert": str(pki["initiator"]), "tls_key": str(pki["initiator-key"])}
            cfg = EngineConfig(metadata=meta.url, transports=("tcp",))
            engines["tcp_tls"] = TransferEngine(cfg.replace(**files, tls_ca=str(pki["ca"]))).start()
        # One local buffer shared by all our engines: a plain numpy array, as an inference engine's
        # own tensors are (Mooncake's side uses one too). The target's buffer is memfd-backed.
        local = np.full(span, 3, dtype=np.uint8)
        local_addr = int(local.ctypes.data)
        for e in engines.values():
            e.register(local)
        mc_local = None
        mc = None
        if "mooncake" in targets:
            from mooncake.engine import TransferEngine as MooncakeTE

            mc = MooncakeTE()
            if mc.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
                raise RuntimeError("mooncake initialize failed")
            mc_local = np.full(span, 3, dtype=np.uint8)
            if mc.register_memory(mc_local.ctypes.data, span) != 0:
                raise RuntimeError("mooncake register_memory failed")
        raw = socket.create_connection(("127.0.0.1", targets["raw"].info["port"]))
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        raw_buf = np.full(span, 3, dtype=np.uint8)
        raw_mv = memoryview(raw_buf.data)
        cp_src = np.full(span, 5, dtype=np.uint8)
        cp_dst = np.full(span, 6, dtype=np.uint8)
        # Shared memory (memfd/shmem) gets 4 KiB pages where anonymous arrays may get huge
        # pages, so copies out of it are slower on the same machine: a second ceiling.
        cp_shm = SharedBuffer(span)
        cp_shm.array[:] = 5
        shm_keep.append(cp_shm)

        def where(t: str) -> tuple[str, int]:
            info = targets["ours_tls" if t == "tcp_tls" else "ours"].info
            return info["segment"], info["addr"]

        def ours_case(e: TransferEngine, op: TransferOp, size: int) -> Callable[[], None]:
            seg, raddr = where(e.config.transports[0] + ("_tls" if e.config.tls else ""))
            reqs = [
                [TransferRequest(op, seg, local_addr + o, raddr + o, size)]
                for o in _offsets(size, span)
            ]

            def run() -> None:
                for r in reqs:
                    e.transfer(r)

            return run

        def ours_batch(e: TransferEngine, op: TransferOp) -> Callable[[], None]:
            seg, raddr = where(e.config.transports[0] + ("_tls" if e.config.tls else ""))
            reqs = [
                TransferRequest(op, seg, local_addr + i * batch_sz, raddr + i * batch_sz, batch_sz)
                for i in range(batch_n)
            ]
            return lambda: e.transfer(reqs)

        def mc_case(op: TransferOp, size: int) -> Callable[[], None]:
            assert mc is not None and mc_local is not None
            tgt = targets["mooncake"].info
            fn = mc.transfer_sync_read if op is TransferOp.READ else mc.transfer_sync_write
            la = int(mc_local.ctypes.data)

            offs = _offsets(size, span)

            def run() -> None:
                for o in offs:
                    if fn(tgt["segment"], la + o, tgt["addr"] + o, size) != 0:
                        raise RuntimeError("mooncake transfer failed")

            return run

        def mc_batch(op: TransferOp) -> Callable[[], None]:
            assert mc is not None and mc_local is not None
            tgt = targets["mooncake"].info
            fn = (
                mc.batch_transfer_sync_read
                if op is TransferOp.READ
                else mc.batch_transfer_sync_write
            )
            la = int(mc_local.ctypes.data)
            locs = [la + i * batch_sz for i in range(batch_n)]
            rems = [tgt["addr"] + i * batch_sz for i in range(batch_n)]
            lens = [batch_sz] * batch_n

            def run() -> None:
                if fn(tgt["segment"], locs, rems, lens) != 0:
                    raise RuntimeError("mooncake batch transfer failed")

            return run

        def raw_case(op: TransferOp, size: int) -> Callable[[], None]:
            code = bytes([0 if op is TransferOp.READ else 1])
            hdrs = [
                (o, code + size.to_bytes(8, "little") + o.to_bytes(8, "little"))
                for o in _offsets(size, span)
            ]
            ack = bytearray(1)

            def run() -> None:
                for o, hdr in hdrs:
                    raw.sendall(hdr)
                    if op is TransferOp.READ:
                        got = 0
                        while got < size:
                            got += raw.recv_into(
                                raw_mv[o + got : o + size], size - got, socket.MSG_WAITALL
                            )
                    else:
                        raw.sendall(raw_mv[o : o + size])
                        raw.recv_into(ack, 1)

            return run

        def memcpy_case(size: int, src: Any) -> Callable[[], None]:
            offs = _offsets(size, span)

            def run() -> None:
                for o in offs:
                    np.copyto(cp_dst[o : o + size], src[o : o + size])

            return run

        cases: list[_Case] = []
        for op in (TransferOp.READ, TransferOp.WRITE):
            for size in size_list:
                label = f"{op.name} {_fmt(size)}"
                nbytes = size * _ops_for(size)
                for t, e in engines.items():
                    cases.append((f"ours_{t}", label, ours_case(e, op, size), nbytes))
                if mc is not None:
                    cases.append(("mooncake_tcp", label, mc_case(op, size), nbytes))
                cases.append(("raw_socket", label, raw_case(op, size), nbytes))
                if op is TransferOp.READ:
                    cases.append(
                        ("memcpy", f"COPY {_fmt(size)}", memcpy_case(size, cp_src), nbytes)
                    )
                    cases.append(
                        (
                            "memcpy_shm",
                            f"COPY {_fmt(size)}",
                            memcpy_case(size, cp_shm.array),
                            nbytes,
                        )
                    )
            if batch_n:
                label = f"{op.name} batch {batch_n}x{_fmt(batch_sz)}"
                for t, e in engines.items():
                    cases.append((f"ours_{t}", label, ours_batch(e, op), batch_n * batch_sz))
                if mc is not None:
                    cases.append(("mooncake_tcp", label, mc_batch(op), batch_n * batch_sz))
        for _, _, fn, _ in cases:  # warm-up: connections, page mappings
            fn()
        if ceiling and not tcp_ceiling.available():
            notes.append("iperf3 not installed (apt-get install iperf3): no STREAM row")
            ceiling = False
        total = rounds * len(cases)
        done = 0
        for rnd in range(rounds):
            if ceiling:  # in the same window as the cases, a second per round and count
                for streams, name in ((1, "iperf3_1_stream"), (2, "iperf3_2_streams")):
                    try:
                        gbs = tcp_ceiling.loopback_gb_s(streams)
                    except RuntimeError as exc:
                        notes.append(f"{name}: {exc}")
                        ceiling = False
                        break
                    results.setdefault("STREAM", {}).setdefault(name, []).append(gbs)
            for group in _shuffled(cases, rnd):
                for system, label, fn, nbytes in group:
                    gbs, cpu_s = _rate(fn, nbytes)
                    results.setdefault(label, {}).setdefault(system, []).append(gbs)
                    cpu.setdefault(label, {}).setdefault(system, []).append(cpu_s)
                    done += 1
                    if progress is not None:
                        progress(done, total)
        raw.close()
        if mc is not None and mc_local is not None:
            mc.unregister_memory(int(mc_local.ctypes.data))
    finally:
        for e in engines.values():
            e.close()
        for b in shm_keep:
            b.close()
        for tgt in targets.values():
            tgt.close()
        meta.stop()

    table: dict[str, dict[str, float]] = {}
    for label, per in results.items():
        table[label] = {k: round(statistics.median(v), 3) for k, v in per.items()}
    ratios: dict[str, dict[str, float]] = {}
    for label, row in table.items():
        r: dict[str, float] = {}
        if row.get("ours_tcp_tls") and row.get("ours_tcp"):
            r["tcp_tls_vs_tcp"] = round(row["ours_tcp_tls"] / row["ours_tcp"], 2)
        if row.get("ours_tcp_one_stream") and row.get("ours_tcp"):
            r["tcp_vs_tcp_one_stream"] = round(row["ours_tcp"] / row["ours_tcp_one_stream"], 2)
        for t in transports:
            ours = row.get(f"ours_{t}")
            if ours is None:
                continue
            for other in ("mooncake_tcp", "raw_socket"):
                if other in row:
                    r[f"{t}_vs_{other}"] = round(ours / row[other], 2)
            copies = table.get(label.replace("READ", "COPY").replace("WRITE", "COPY"), {})
            for bound in ("memcpy", "memcpy_shm"):
                if copies.get(bound):
                    r[f"{t}_vs_{bound}"] = round(ours / copies[bound], 2)
            stream = table.get("STREAM", {})
            if t == "tcp" and stream:
                r["tcp_vs_iperf3_best"] = round(ours / max(stream.values()), 2)
        ratios[label] = r
    return {
        "benchmark": "transfer",
        "unit": "GB/s (1e9 bytes/s), median of rounds",
        "rounds": rounds,
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "loadavg_1_5_15": {"start": load_start, "end": os.getloadavg()},
        },
        "results": table,
        "ratios": ratios,
        # the initiator process's CPU seconds per GB moved (median of rounds); the targets'
        # processes are not counted
        "initiator_cpu_s_per_gb": {
            label: {k: round(statistics.median(v), 4) for k, v in per.items()}
            for label, per in cpu.items()
        },
        "notes": notes,
    }


def _shuffled(cases: list[_Case], rnd: int) -> list[list[_Case]]:
    """The cases in runs of one label, each run's systems in an order drawn anew for round
    ``rnd`` (seeded: runs repeat). Measured in a fixed order, a system ran up to ~10% slower
    when it always followed another one (``ours_tcp`` after ``ours_shm`` against the identical
    ``ours_tcp_one_stream``), so no system keeps one place or one predecessor."""
    groups: list[list[_Case]] = []
    for case in cases:
        if groups and groups[-1][0][1] == case[1]:
            groups[-1].append(case)
        else:
            groups.append([case])
    rng = random.Random(rnd)
    for g in groups:
        rng.shuffle(g)
    return groups


def _fmt(n: int) -> str:
    for unit, mult in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{unit}"
    return str(n)
