"""Processes the benches start: our master, quiet children, Mooncake's store, the load average."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import platform
import queue
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, Any

from .ports import free_port, reported

# The command line of this package, run by the interpreter running the benchmark.
CLI = [sys.executable, "-m", "mooncake_connectors"]


def output_of(log: IO[bytes]) -> str:
    """What a child wrote so far to ``log`` (a file it shares with us), read without moving
    the file's offset, which the child writes at."""
    fd = log.fileno()
    return os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")


def start_master(
    args: list[str], procs: list[subprocess.Popen[Any]], env: dict[str, str] | None = None
) -> str:
    """Our store master, binding a port of its own choosing (``--port 0``, so no other process
    can take the port between choosing and binding): its address, as it reports it. It is
    appended to ``procs`` as it starts (the caller stops it, also when this raises)."""
    log = tempfile.TemporaryFile(prefix="mc-master-")  # noqa: SIM115 - the child's, closed below
    try:
        proc = subprocess.Popen(
            [*CLI, "master", "--port", "0", *args], stdout=log, stderr=log, env=env
        )
        procs.append(proc)
        return str(reported(lambda: output_of(log), "master", 30.0, lambda: proc.poll() is None))
    finally:
        log.close()  # the child keeps writing to its own descriptor


def _wait_port(port: int, timeout: float, proc: subprocess.Popen[Any]) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


def _quiet(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)


def wait_or_kill(proc: subprocess.Popen[Any], timeout: float = 10.0) -> None:
    """Wait for ``proc`` to exit; one still running after ``timeout`` seconds is killed."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout)


def stop_all(procs: list[subprocess.Popen[Any]], timeout: float = 10.0) -> None:
    """Terminate every live process first (so they shut down side by side), then reap each."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        wait_or_kill(proc, timeout)


def _stop(proc: subprocess.Popen[Any]) -> None:
    stop_all([proc])


_OWNER = """
import os, sys
from mooncake.store import MooncakeDistributedStore
s = MooncakeDistributedStore()
rc = s.setup("127.0.0.1", sys.argv[1], int(sys.argv[2]), 16 << 20, "tcp", "", sys.argv[3])
print("ready" if rc == 0 else f"setup failed {rc}", flush=True)
sys.stdin.read()
"""


def mooncake_master_argv(binary: str, rpc: int, metrics: int, http: int) -> list[str]:
    """``mooncake_master`` on 127.0.0.1 with its HTTP metadata server (at ``/metadata``)."""
    return [
        binary,
        f"--rpc_port={rpc}",
        "--rpc_address=127.0.0.1",
        f"--metrics_port={metrics}",
        "--metrics_host=127.0.0.1",
        "--enable_http_metadata_server=true",
        "--http_metadata_server_host=127.0.0.1",
        f"--http_metadata_server_port={http}",
    ]


def start_mooncake_store(memory: int, procs: list[subprocess.Popen[Any]]) -> tuple[str, str]:
    """Start Mooncake's own store for a side-by-side run: ``mooncake_master`` (from the wheel,
    with its HTTP metadata server) and a data-owner process contributing ``memory`` bytes, all on
    127.0.0.1. The processes are appended to ``procs`` as they start (the caller stops them, also
    when this raises). Returns (master address, metadata URL)."""
    os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"  # Mooncake binds 0.0.0.0 otherwise
    env = dict(os.environ)
    rpc, metrics, http = free_port(), free_port(), free_port()
    binary = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    master_proc = _quiet(mooncake_master_argv(binary, rpc, metrics, http), env)
    procs.append(master_proc)
    _wait_port(rpc, 30, master_proc)
    _wait_port(http, 30, master_proc)
    meta = f"http://127.0.0.1:{http}/metadata"
    master = f"127.0.0.1:{rpc}"
    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER, meta, str(memory), master],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    procs.append(owner)
    assert owner.stdout is not None
    line = owner.stdout.readline().strip()
    if line != "ready":
        raise RuntimeError(f"Mooncake data owner failed: {line or owner.poll()}")
    return master, meta


def machine() -> dict[str, Any]:
    """What a benchmark ran on, for its JSON report."""
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def loadavg() -> list[float]:
    """1/5/15-minute load average when the run ended: how busy the machine was."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


class RoleProc:
    """One role process of a bench (``python -m module CFG``, ``cfg["role"]`` naming it): it
    answers each command line on its stdin with one JSON line on stdout prefixed by ``mark``
    (other output may share stdout; its tail is kept for errors). :meth:`call` sends a command
    and waits (bounded) for its answer; ``{"op": "quit"}`` ends it."""

    def __init__(self, module: str, mark: str, cfg: dict[str, Any], env: dict[str, str]) -> None:
        self.role, self.mark = cfg["role"], mark
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, json.dumps(cfg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(self.mark):
                self.replies.put(json.loads(line[len(self.mark) :]))
            else:
                self.tail.append(line.rstrip())
        self.replies.put(None)  # end of output: the process exited

    def output(self) -> str:
        return "\n".join(self.tail)

    def reply(self, timeout: float) -> dict[str, Any]:
        try:
            got = self.replies.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(
                f"{self.role} gave no answer in {timeout}s; its output:\n{self.output()}"
            ) from None
        if got is None:
            raise RuntimeError(
                f"{self.role} exited ({self.proc.wait(5)}); its output:\n{self.output()}"
            )
        return got

    def call(self, cmd: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"timeout": timeout, **cmd}) + "\n")
        self.proc.stdin.flush()
        got = self.reply(timeout + 30.0)  # the role bounds its own wait by ``timeout``
        if "error" in got:
            raise RuntimeError(f"{self.role} {cmd['op']}: {got['error']}\n{self.output()}")
        return got

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
            except OSError:
                pass
        wait_or_kill(self.proc, 15.0)
