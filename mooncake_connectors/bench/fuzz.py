"""``mooncake-connectors fuzz``: hostile frames at every listening port, each in its own process.

For each target (TE tcp data port and its p2p metadata endpoint, store master, a store server's
load endpoint, the metadata HTTP server, the PD side channel of a real transfer session, the P2P
grant server, the PD proxy) a real process
serves on 127.0.0.1 and the harness sends it ``frames`` frames per port over short-lived
connections (structured frames with hostile fields, truncated frames, raw random bytes), with a
well-behaved client's exchange every ``probe_every`` frames. A port passes when its process is
alive at the end, every probe succeeded, its peak RSS grew by less than ``rss_budget`` (a hostile
length must never be allocated) and, for the TE target, the canary pages around the registered
region are intact.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from typing import IO, Any

from .fuzz_frames import PORTS, Port, drain
from .fuzz_zmq import ZmqPort
from .procs import wait_or_kill

RSS_BUDGET = 256 << 20  # far below any hostile length tried (>= 1 GiB), far above normal growth


class TargetProcess:
    def __init__(self, kind: str, timeout: float = 60.0) -> None:
        # its log, to count tracebacks and warnings after the run (a temp file: never blocks it)
        self.log: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mooncake_connectors.bench.fuzz_target", kind],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            start_new_session=True,
        )
        self.info: dict[str, Any] = self._line(timeout)

    def _line(self, timeout: float) -> dict[str, Any]:
        out: IO[str] | None = self.proc.stdout
        assert out is not None
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(out, selectors.EVENT_READ)
        try:
            if not sel.select(timeout):
                raise TimeoutError(f"fuzz target did not answer within {timeout}s")
        finally:
            sel.close()
        line = out.readline()
        if not line:
            raise RuntimeError(f"fuzz target exited with {self.proc.wait(timeout=10)}")
        result: dict[str, Any] = json.loads(line)
        return result

    def check(self, timeout: float = 30.0) -> dict[str, Any] | None:
        if self.proc.poll() is not None or self.proc.stdin is None:
            return None
        try:
            self.proc.stdin.write("check\n")
            self.proc.stdin.flush()
            return self._line(timeout)
        except (OSError, RuntimeError, TimeoutError):
            return None

    def log_counts(self) -> dict[str, int]:
        """Tracebacks and WARNING lines the target logged so far."""
        self.log.seek(0)
        text = self.log.read().decode("utf-8", "replace")
        lines = text.splitlines()
        return {
            "tracebacks": sum(line.startswith("Traceback (") for line in lines),
            "warnings": sum(line.startswith("WARNING ") for line in lines),
        }

    def close(self) -> None:
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
        wait_or_kill(self.proc)
        self.log.close()


def _send_burst(port: Port, rng: random.Random, budget: int) -> int:
    """One connection: up to ``budget`` frames, then an orderly or abrupt close."""
    frames = [port.frame(rng) for _ in range(min(budget, rng.randrange(1, 48)))]
    return send_frames(port, frames, random.Random(rng.getrandbits(64)))


def send_frames(port: Port, frames: list[bytes], rng: random.Random) -> int:
    """Send ``frames`` on one connection (the frames are drawn first, so what is drawn never
    depends on how the server answered: hypothesis replays it exactly)."""
    if isinstance(port, ZmqPort) and rng.random() < 0.8:
        for f in frames:
            port.send_message(rng, f)
        return len(frames)
    try:
        sock = port.open(rng)
    except OSError:
        return 1  # a refused or reset handshake attempt still counts as hostile input
    sent = 0
    try:
        sock.settimeout(2.0)
        for f in frames:
            sock.sendall(f)
            sent += 1
            drain(sock)
    except OSError:
        pass  # the server hung up on us, as it may
    finally:
        if rng.random() < 0.3:  # RST instead of FIN
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
        sock.close()
    return max(sent, 1)


def fuzz_target(
    kind: str,
    frames: int,
    seed: int = 0,
    probe_every: int = 500,
    rss_budget: int = RSS_BUDGET,
    progress: Callable[[str, int, int], None] | None = None,
) -> list[dict[str, Any]]:
    """Fuzz every port of one target process; one result per port."""
    _, classes = PORTS[kind]
    target = TargetProcess(kind)
    results = []
    try:
        before = target.check() or {}
        for cls in classes:
            port = cls(target.info)
            rng = random.Random(f"{seed}-{cls.name}")
            sent = probes = 0
            failures: list[str] = []
            t0 = time.monotonic()
            try:
                port.probe()
                while sent < frames:
                    sent += _send_burst(port, rng, frames - sent)
                    if sent // probe_every > probes:
                        probes += 1
                        try:
                            port.probe()
                        except Exception as exc:
                            failures.append(f"probe after {sent} frames: {exc!r}")
                            if len(failures) > 5:
                                break
                        if progress is not None:
                            progress(cls.name, sent, frames)
                port.probe()
            except Exception as exc:
                failures.append(f"{exc!r}")
            finally:
                port.close()
            after = target.check()
            grew = (after or {}).get("vmhwm", 0) - before.get("vmhwm", 0)
            ok = (
                after is not None
                and not failures
                and grew < rss_budget
                and after.get("canary_ok", True) is True
            )
            results.append(
                {
                    "port": cls.name,
                    "frames": sent,
                    "seconds": round(time.monotonic() - t0, 2),
                    "probes": probes + 2,
                    "alive": after is not None,
                    "peak_rss_growth_bytes": grew,
                    "fds_before": before.get("fds"),
                    "fds_after": (after or {}).get("fds"),
                    "canary_ok": (after or {}).get("canary_ok"),
                    "region_bytes_changed": (after or {}).get("region_bytes_changed"),
                    # side: Done ids the session keeps, and those it refused
                    "side_state": (after or {}).get("side_state"),
                    "side_dropped_done": (after or {}).get("side_dropped_done"),
                    "failures": failures,
                    "ok": ok,
                }
            )
        counts = target.log_counts()  # for the whole target: its ports share one log
        for r in results:
            r.update(counts)
    finally:
        target.close()
    return results


def run_fuzz(
    frames: int,
    kinds: Iterable[str] | None = None,
    seed: int = 0,
    progress: Callable[[str, int, int], None] | None = None,
) -> dict[str, Any]:
    ports: list[dict[str, Any]] = []
    for kind in kinds or PORTS:
        ports += fuzz_target(kind, frames, seed=seed, progress=progress)
    return {
        "bench": "fuzz",
        "frames_per_port": frames,
        "seed": seed,
        "host_cpus": os.cpu_count(),
        "ports": ports,
        "ok": all(p["ok"] for p in ports),
    }
