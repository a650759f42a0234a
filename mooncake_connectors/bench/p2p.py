"""``mooncake-connectors bench p2p``: time to give S bytes to N fetchers, swarm against naive.

Every run has one publisher process (``p2p publish``) and N fetcher processes on this machine,
each holder's egress capped at ``rate`` bytes/s by its grant token bucket, which models one NIC
per host. *Naive*: every fetcher pulls the whole object from the publisher and serves nothing
(``share=False``), the way N plain downloads from one file server go. *Swarm*: fetchers serve
every verified chunk onward at once, rarest first. The same code moves the bytes in both; only
the sharing differs.

The fetchers start, open their engines, then wait for a go file, so process start-up is not
timed: the time is from "go" to the last fetcher's last verified chunk. Each fetcher keeps
serving until every fetcher is done. The ideal of a binary-tree copy of the whole object is
(1 + log2 N) / N of the naive time; chunked pipelining can go below it, towards 1 / N.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import IO, Any

from .procs import stop_all

_WAIT = 300.0  # deadline of any one wait on a process


def _lines(stream: IO[str], q: queue.Queue[tuple[int, str]], idx: int) -> None:
    for line in stream:
        q.put((idx, line))


def _collect(q: queue.Queue[tuple[int, str]], want: int, key: str) -> dict[int, dict[str, Any]]:
    got: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + _WAIT
    while len(got) < want:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"only {len(got)} of {want} processes reported {key!r}")
        try:
            idx, line = q.get(timeout=left)
        except queue.Empty:
            continue
        if line.startswith("{"):
            msg = json.loads(line)
            if key in msg:
                got[idx] = msg
    return got


def _one(
    mode: str, n: int, src: Path, work: Path, url: str, rate: int, chunk: int, k: int
) -> dict[str, Any]:
    name = f"bench-{mode}-{n}-{uuid.uuid4().hex[:6]}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    exe = [sys.executable, "-m"]
    q: queue.Queue[tuple[int, str]] = queue.Queue()
    procs: list[subprocess.Popen[str]] = []

    def spawn(argv: list[str]) -> None:
        p = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
        )
        assert p.stdout is not None
        threading.Thread(target=_lines, args=(p.stdout, q, len(procs)), daemon=True).start()
        procs.append(p)

    go = work / f"{name}.go"
    try:
        spawn(
            [
                *exe,
                "mooncake_connectors",
                "p2p",
                "publish",
                str(src),
                "--name",
                name,
                "--chunk-size",
                str(chunk),
                "--rate",
                str(rate),
                "--metadata",
                url,
                "--json",
            ]
        )
        pub_pid = _collect(q, 1, "chunks")[0]["pid"]
        for i in range(n):
            spawn(
                [
                    *exe,
                    "mooncake_connectors.bench.p2p",
                    "--metadata",
                    url,
                    "--name",
                    name,
                    "--dest",
                    str(work / f"{name}-{i}"),
                    "--rate",
                    str(rate),
                    "--k",
                    str(k),
                    "--go",
                    str(go),
                    "--publisher",
                    str(pub_pid),
                    *([] if mode == "swarm" else ["--no-share"]),
                ]
            )
        _collect(q, n, "ready")
        t0 = time.time()
        go.touch()
        done = _collect(q, n, "finished")
    finally:
        stop_all(procs, 15)
    for i in range(n):
        shutil.rmtree(work / f"{name}-{i}", ignore_errors=True)
    ends = [d["finished"] for d in done.values()]
    return {
        "seconds": round(max(ends) - t0, 3),
        "first_done_s": round(min(ends) - t0, 3),
        "corrupt": sum(d["corrupt"] for d in done.values()),
        "bytes_from_publisher": sum(d["from_publisher"] for d in done.values()),
    }


def run_p2p_benchmark(
    ns: list[int], size: int, rate: int, chunk: int, k: int = 4, rounds: int = 1
) -> dict[str, Any]:
    """Naive and swarm distribution of ``size`` bytes to each N in ``ns``, interleaved."""
    import numpy as np

    from ..transfer_core.metadata.http import MetadataHTTPServer

    work = Path(tempfile.mkdtemp(prefix="mc-bench-p2p-"))
    server = MetadataHTTPServer("127.0.0.1", 0).start()
    try:
        src = work / "src"
        src.mkdir()
        rng = np.random.default_rng(0)
        half = size // 2
        (src / "model-00001-of-00002.safetensors").write_bytes(rng.bytes(half))
        (src / "model-00002-of-00002.safetensors").write_bytes(rng.bytes(size - half))
        rows = []
        for n in ns:
            runs: dict[str, list[dict[str, Any]]] = {"naive": [], "swarm": []}
            for _ in range(rounds):
                for mode in ("naive", "swarm"):
                    runs[mode].append(_one(mode, n, src, work, server.url, rate, chunk, k))
            naive = min(r["seconds"] for r in runs["naive"])
            swarm = min(r["seconds"] for r in runs["swarm"])
            rows.append(
                {
                    "n": n,
                    "naive_s": naive,
                    "swarm_s": swarm,
                    "ratio": round(swarm / naive, 3),
                    "ideal_tree_ratio": round((1 + math.log2(n)) / n, 3),
                    "naive_runs": runs["naive"],
                    "swarm_runs": runs["swarm"],
                }
            )
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    return {
        "benchmark": "p2p",
        "config": {
            "size": size,
            "rate_bytes_s": rate,
            "chunk": chunk,
            "k": k,
            "rounds": rounds,
            "ns": ns,
            "transports": "engine default (shm, tcp)",
        },
        "host": {
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "results": rows,
    }


def _worker() -> None:
    """One fetcher: open, say ready, wait for the go file, fetch, report, serve until stopped."""
    import signal

    from ..config import EngineConfig
    from ..p2p import P2PStore

    ap = argparse.ArgumentParser()
    for opt in ("--metadata", "--name", "--dest", "--go"):
        ap.add_argument(opt, required=True)
    ap.add_argument("--rate", type=int, required=True)
    ap.add_argument("--publisher", type=int, required=True)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--no-share", action="store_true")
    a = ap.parse_args()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    node = P2PStore(EngineConfig(metadata=a.metadata), rate=a.rate)
    try:
        print(json.dumps({"ready": os.getpid()}), flush=True)
        deadline = time.monotonic() + _WAIT
        while not os.path.exists(a.go):
            if time.monotonic() > deadline or stop.wait(0.005):
                return
        st = node.fetch(a.name, a.dest, k=a.k, share=not a.no_share)
        # Holder names carry their pid: "NAME-HOST-PID-TAG".
        pub = sum(v for h, v in st.from_holder.items() if f"-{a.publisher}-" in h)
        print(
            json.dumps(
                {
                    "finished": time.time(),
                    "corrupt": st.corrupt,
                    "from_publisher": pub,
                    "holders_used": len(st.from_holder),
                }
            ),
            flush=True,
        )
        stop.wait(_WAIT)
    finally:
        node.close()


if __name__ == "__main__":
    _worker()
