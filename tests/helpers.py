"""Test helpers shared by tests/ and integration_tests/: a real etcd, a peer process."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from mooncake_connectors.bench.ports import free_port as free_port  # the tests' too

PEER_SCRIPT = Path(__file__).with_name("peer_process.py")


def wait_until(pred: Any, timeout: float, what: str, interval: float = 0.02) -> None:
    """Poll ``pred`` until true, failing the test after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def http_ok(url: str) -> bool:
    """True when ``url`` answers 200 within half a second."""
    try:
        with urllib.request.urlopen(url, timeout=0.5) as r:
            return bool(r.status == 200)
    except OSError:
        return False


class EtcdServer:
    """A throwaway single-node etcd on loopback with a temp data dir."""

    def __init__(self) -> None:
        binary = shutil.which("etcd")
        if binary is None:
            if os.environ.get("CI"):
                raise RuntimeError("etcd binary missing in CI: .ci/run installs etcd-server")
            pytest.skip("etcd binary not installed (apt-get install etcd-server)")
        self.binary = binary
        self.dir = tempfile.mkdtemp(prefix="mc-etcd-")
        self.client_port = free_port()
        self.peer_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"etcd://127.0.0.1:{self.client_port}"

    def start(self) -> EtcdServer:
        c = f"http://127.0.0.1:{self.client_port}"
        p = f"http://127.0.0.1:{self.peer_port}"
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--name",
                "t",
                "--data-dir",
                self.dir,
                "--listen-client-urls",
                c,
                "--advertise-client-urls",
                c,
                "--listen-peer-urls",
                p,
                "--initial-advertise-peer-urls",
                p,
                "--initial-cluster",
                f"t={p}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_until(lambda: http_ok(f"{c}/health"), 20, "etcd to become healthy")
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
            self.proc = None

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class Peer:
    """Another process running a TransferEngine, driven by JSON lines on stdin/stdout."""

    def __init__(
        self, nofile: int | None = None, env: dict[str, str] | None = None, **start: Any
    ) -> None:
        """``nofile``: the peer's descriptor limit (set by the peer itself, after its imports).
        ``env``: the peer's environment (default: this process's)."""
        if nofile:
            env = {**(env or os.environ), "PEER_NOFILE": str(nofile)}
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER_SCRIPT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        # ``start`` may hold the engine's own ``timeout``: it goes to the engine, not to this
        # wait (a process that imports the transports can take seconds to answer under load)
        self.info = self._request("start", 60.0, start)
        self.segment: str = self.info["segment"]
        self.pid: int = self.proc.pid

    def call(self, cmd: str, timeout: float = 30.0, **args: Any) -> dict[str, Any]:
        """Send ``cmd`` with ``args``; wait up to ``timeout`` seconds for the answer."""
        return self._request(cmd, timeout, args)

    def _request(self, cmd: str, timeout: float, args: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"cmd": cmd, **args}) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise AssertionError(f"peer did not answer {cmd!r} within {timeout}s")
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"peer exited during {cmd!r} (rc={self.proc.poll()})")
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise AssertionError(f"peer failed {cmd!r}: {reply['error']}")
        return reply

    def signal(self, sig: int) -> None:
        """Send ``sig``; for SIGSTOP/SIGCONT also wait until the process is (no longer) stopped,
        since delivery is asynchronous: the target stops only when it next runs."""
        os.kill(self.proc.pid, sig)
        if sig in (signal.SIGSTOP, signal.SIGCONT):
            want_stopped = sig == signal.SIGSTOP
            wait_until(lambda: self.stopped() == want_stopped, 10, f"peer to handle signal {sig}")

    def stopped(self) -> bool:
        with open(f"/proc/{self.proc.pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "T"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
                self.call("quit", timeout=10)
            except (AssertionError, OSError, BrokenPipeError):
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def pattern(seed: int, size: int) -> Any:
    import numpy as np

    return np.random.default_rng(seed).integers(0, 256, size=size, dtype=np.uint8)
