"""``mooncake-connectors soak --minutes M``: a mixed store and TE workload at a bounded rate with
faults on a schedule, reporting what stayed flat and what was lost.

Processes (all real, on 127.0.0.1): one store master, three store servers, and a transfer
engine target (the fuzz target's TE process). Clients and servers reach the master through a
:class:`~.faultlink.FaultLink`. Every ``fault_every`` seconds the next fault of the cycle:

- ``server``: a store server SIGKILLed and restarted 2 s later;
- ``master``: the master SIGKILLed and restarted on its port (it rebuilds from the servers);
- ``flap``: every connection to the master reset, then a 1.5 s partition, then healed;
- ``lossy``: 10 s of 5 % loss (retransmission-sized stalls) and 20 ± 10 ms delay to the master.

Puts have two replicas, so every value survives one server loss. After each fault the harness
reads back every live acknowledged value (retrying up to ``verify_timeout``): a miss is an
acknowledged put lost, a difference is corrupt bytes; both must be 0. After a server fault, the
values written before it are removed (their second copy is gone; a second loss could take
them). The TE workload writes a pattern into the target's region and reads it back.

Reported: per minute, ops, typed errors and p50/p99 latency of puts, gets and TE round trips;
every ``sample_every`` seconds, RSS and open fds of each process (per role; a restarted process
starts a new series).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import signal
import subprocess
import tempfile
import time
from typing import IO, Any

from ..errors import MooncakeConnectorsError
from .ports import reported
from .procs import CLI, output_of

TIMERS = ["--heartbeat-interval", "0.2", "--server-ttl", "1.5", "--read-lease-ttl", "1.0",
          "--put-lease-ttl", "3.0"]  # fmt: skip
FAULTS = ("server", "flap", "master", "lossy")


def proc_stats(pid: int) -> dict[str, int] | None:
    try:
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        with open(f"/proc/{pid}/status") as fh:
            rss = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None
    return {"rss": rss, "fds": fds}


class Role:
    """One CLI process that the schedule may kill and restart."""

    def __init__(self, name: str, args: list[str]) -> None:
        self.name = name
        self.args = args
        self.log: IO[bytes] = tempfile.TemporaryFile(prefix=f"mc-soak-{name}-")  # noqa: SIM115
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [*CLI, *self.args], stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return round(s[min(len(s) - 1, int(q * len(s)))] * 1000, 2)


class Soak:
    def __init__(self, minutes: float, rate: float, fault_every: float, seed: int) -> None:
        self.minutes = minutes
        self.rate = rate
        self.fault_every = fault_every
        self.rng = random.Random(seed)
        self.acked: dict[str, str] = {}  # live key -> sha256 of its value
        self.lost: list[str] = []
        self.corrupt: list[str] = []
        self.faults: list[dict[str, Any]] = []
        self.minute: dict[int, dict[str, Any]] = {}
        self.samples: list[dict[str, Any]] = []
        self.roles: list[Role] = []
        self.t0 = time.monotonic()

    # -- setup ------------------------------------------------------------------------------
    def start(self) -> None:
        from ..store import ClientConfig, StoreClient
        from .faultlink import FaultLink
        from .fuzz import TargetProcess

        # Port 0: the master binds a port of its own choosing; restarts reuse the one it got.
        self.master = master = Role("master", ["master", "--port", "0", *TIMERS])
        got = reported(lambda: output_of(master.log), "master", 30.0, master.alive)
        port = int(str(got).rsplit(":", 1)[1])
        master.args = ["master", "--port", str(port), *TIMERS]
        self.link = FaultLink(("127.0.0.1", port), seed=self.rng.randrange(1 << 30))
        self.servers = [
            Role(f"server{i}", ["store-server", "--master", self.link.address, "--memory", "48M"])
            for i in range(3)
        ]
        self.roles = [self.master, *self.servers]
        self.client = StoreClient(ClientConfig(master=self.link.address, timeout=10.0)).start()
        deadline = time.monotonic() + 60
        while self.client.stats().get("servers", 0) < 3:
            if time.monotonic() > deadline:
                raise RuntimeError("store servers did not register")
            time.sleep(0.2)
        self.te = TargetProcess("te")
        from .fuzz_frames import TePort

        self.te_port = TePort(self.te.info)

    def close(self) -> None:
        for closer in (self.client.close, self.te_port.close, self.te.close, self.link.close):
            with contextlib.suppress(Exception):
                closer()
        for r in self.roles:
            r.close()

    # -- workload ---------------------------------------------------------------------------
    def _record(self, kind: str, seconds: float | None) -> None:
        m = int((time.monotonic() - self.t0) // 60)
        row = self.minute.setdefault(m, {"lat": {}, "errors": {}})
        if seconds is None:
            row["errors"][kind] = row["errors"].get(kind, 0) + 1
        else:
            row["lat"].setdefault(kind, []).append(seconds)

    def _timed(self, kind: str, fn: Any) -> tuple[bool, Any]:
        t = time.monotonic()
        try:
            out = fn()
        except MooncakeConnectorsError:
            self._record(kind, None)
            return False, None
        self._record(kind, time.monotonic() - t)
        return True, out

    def step(self, i: int) -> None:
        r = self.rng.random()
        if r < 0.45:
            key = f"soak-{i}"
            value = self.rng.randbytes(self.rng.choice([1024, 8192, 65536]))
            if self._timed("put", lambda: self.client.put(key, value, replicas=2))[0]:
                self.acked[key] = hashlib.sha256(value).hexdigest()
        elif r < 0.85 and self.acked:
            key = self.rng.choice(list(self.acked))
            got = self._timed("get", lambda: self.client.get(key))[1]
            if got is not None and hashlib.sha256(got).hexdigest() != self.acked[key]:
                self.corrupt.append(key)
        else:
            self._timed("te", self._te_round_trip)
        if len(self.acked) > 400:  # a bounded working set: the oldest go
            for key in list(self.acked)[:50]:
                with contextlib.suppress(MooncakeConnectorsError):
                    self.client.remove(key)
                del self.acked[key]

    def _te_round_trip(self) -> bool:
        self.te_port.probe()
        return True

    # -- faults -----------------------------------------------------------------------------
    def fault(self, n: int) -> None:
        kind = FAULTS[n % len(FAULTS)]
        at = round(time.monotonic() - self.t0, 1)
        before = list(self.acked)
        if kind == "server":
            victim = self.servers[n // len(FAULTS) % len(self.servers)]
            victim.kill()
            time.sleep(2.0)
            victim.start()
        elif kind == "master":
            self.master.kill()
            self.master.start()
        elif kind == "flap":
            self.link.reset()
            self.link.partition()
            time.sleep(1.5)
            self.link.heal()
        else:
            self.link.shape(delay=0.02, jitter=0.01, loss=0.05)
            deadline = time.monotonic() + 10
            i = 0
            while time.monotonic() < deadline:
                self.step(10**9 + n * 10**5 + i)
                i += 1
                time.sleep(1 / self.rate)
            self.link.shape()
        lost = self.verify()
        self.faults.append({"at_s": at, "fault": kind, "verified_keys": len(self.acked),
                            "lost": lost})  # fmt: skip
        if kind == "server":  # what was written before it now has one copy: retire it
            for key in before:
                with contextlib.suppress(MooncakeConnectorsError):
                    self.client.remove(key)
                self.acked.pop(key, None)

    def verify(self, timeout: float = 30.0) -> int:
        """Read back every live acknowledged value; those still missing at the end are lost."""
        missing = set(self.acked)
        deadline = time.monotonic() + timeout
        while missing and time.monotonic() < deadline:
            keys = sorted(missing)
            try:
                got = self.client.get_batch(keys)
            except MooncakeConnectorsError:
                time.sleep(0.5)
                continue
            for key, value in zip(keys, got, strict=True):
                if value is None:
                    continue
                missing.discard(key)
                if hashlib.sha256(value).hexdigest() != self.acked[key]:
                    self.corrupt.append(key)
            if missing:
                time.sleep(0.5)
        self.lost += sorted(missing)
        for key in missing:
            self.acked.pop(key, None)
        return len(missing)

    def sample(self) -> None:
        row: dict[str, Any] = {"t_s": round(time.monotonic() - self.t0, 1)}
        pids = {r.name: r.proc.pid for r in self.roles if r.proc is not None}
        pids.update(te_target=int(self.te.info["pid"]), harness=os.getpid())
        for name, pid in pids.items():
            st = proc_stats(pid)
            if st is not None:
                row[name] = {**st, "pid": pid}
        self.samples.append(row)

    # -- run --------------------------------------------------------------------------------
    def run(self, sample_every: float = 5.0) -> dict[str, Any]:
        end = self.t0 + self.minutes * 60
        next_fault = self.t0 + self.fault_every
        next_sample = self.t0
        n = i = 0
        while time.monotonic() < end:
            now = time.monotonic()
            if now >= next_sample:
                self.sample()
                next_sample = now + sample_every
            if now >= next_fault and now + 40 < end:
                self.fault(n)
                n += 1
                next_fault = time.monotonic() + self.fault_every
                continue
            self.step(i)
            i += 1
            time.sleep(max(0.0, 1 / self.rate - (time.monotonic() - now)))
        self.verify()
        self.sample()
        return self.report()

    def report(self) -> dict[str, Any]:
        minutes = []
        for m, row in sorted(self.minute.items()):
            out: dict[str, Any] = {"minute": m, "errors": row["errors"]}
            for kind, lat in row["lat"].items():
                out[kind] = {"ops": len(lat), "p50_ms": _pct(lat, 0.5), "p99_ms": _pct(lat, 0.99)}
            minutes.append(out)
        return {
            "bench": "soak",
            "minutes": self.minutes,
            "rate_ops_per_s": self.rate,
            "faults": self.faults,
            "acknowledged_puts_lost": len(self.lost),
            "lost_keys": self.lost[:20],
            "corrupt_reads": len(self.corrupt),
            "per_minute": minutes,
            "processes": self.samples,
            "flat": flatness(self.samples),
        }


def flatness(samples: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Per process incarnation: first and last fds and RSS, and the largest fds seen."""
    out: dict[str, dict[str, int]] = {}
    for row in samples:
        for name, st in row.items():
            if not isinstance(st, dict):
                continue
            key = f"{name}/{st['pid']}"
            cur = out.setdefault(
                key, {"fds_first": st["fds"], "rss_first": st["rss"], "fds_max": st["fds"]}
            )
            cur.update(fds_last=st["fds"], rss_last=st["rss"])
            cur["fds_max"] = max(cur["fds_max"], st["fds"])
            cur["samples"] = cur.get("samples", 0) + 1
    return out


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_soak(
    minutes: float, rate: float = 40.0, fault_every: float = 20.0, seed: int = 0
) -> dict[str, Any]:
    soak = Soak(minutes, rate, fault_every, seed)
    # SIGTERM ends the run like Ctrl-C: the processes it started are stopped, not orphaned.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        soak.start()
        return soak.run()
    finally:
        soak.close()
