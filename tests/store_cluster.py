"""Store processes for tests: masters and store servers run as the CLI runs them."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from helpers import free_port, wait_until

from mooncake_connectors.store import ClientConfig, StoreClient

CLI = [sys.executable, "-m", "mooncake_connectors"]
# Short timers so faults show within a test's patience.
FAST = [
    "--heartbeat-interval",
    "0.2",
    "--server-ttl",
    "1.0",
    "--read-lease-ttl",
    "1.0",
    "--put-lease-ttl",
    "2.0",
]


class Proc:
    """A CLI process whose output goes to a temp file (shown when a test fails)."""

    def __init__(self, args: list[str], nofile: int | None = None) -> None:
        # kept open for the process lifetime; closed in close()
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115
            prefix="mc-store-", suffix=".log", delete=False
        )
        self.args = args
        # nofile: the process's descriptor limit, set by prlimit(1) so no code runs in the fork
        limit = ["prlimit", f"--nofile={nofile}:{nofile}", "--"] if nofile else []
        self.proc = subprocess.Popen(
            [*limit, *CLI, *args],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "COLUMNS": "400"},  # one log record per line
        )
        self.pid = self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    def output(self) -> str:
        with open(self.log.name, errors="replace") as fh:
            return fh.read()[-4000:]

    def close(self) -> None:
        self.stop()
        self.log.close()
        with contextlib.suppress(OSError):
            os.unlink(self.log.name)


def listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), 0.2):
            return True
    except OSError:
        return False


def start_master(*extra: str, port: int | None = None) -> tuple[Proc, str]:
    port = port or free_port()
    p = Proc(["master", "--port", str(port), *extra])

    def up() -> bool:
        if not p.alive():
            raise AssertionError(f"master exited:\n{p.output()}")
        return listening(port)

    wait_until(up, 30, "the master to listen")
    return p, f"127.0.0.1:{port}"


def start_server(master: str, memory: str = "32M", *extra: str) -> Proc:
    return Proc(["store-server", "--master", master, "--memory", memory, *extra])


def client(master: str, **kw: Any) -> StoreClient:
    kw.setdefault("timeout", 15.0)
    return StoreClient(ClientConfig(master=master, **kw)).start()


def wait_servers(c: StoreClient, n: int, timeout: float = 30.0) -> None:
    wait_until(lambda: c.stats()["servers"] == n, timeout, f"{n} live store server(s)")


@contextlib.contextmanager
def cluster(
    n_servers: int = 2, memory: str = "32M", master_args: tuple[str, ...] = ()
) -> Iterator[tuple[str, list[Proc], StoreClient, Proc]]:
    """A master and ``n_servers`` store servers (processes) and a client in this process."""
    procs: list[Proc] = []
    c: StoreClient | None = None
    try:
        m, addr = start_master(*master_args)
        procs.append(m)
        servers = [start_server(addr, memory) for _ in range(n_servers)]
        procs.extend(servers)
        c = client(addr)
        try:
            wait_servers(c, n_servers)
        except AssertionError:
            raise AssertionError("\n".join(p.output() for p in procs)) from None
        yield addr, servers, c, m
    finally:
        if c is not None:
            c.close()
        for p in procs:
            p.close()


def eventually(pred: Any, timeout: float, what: str) -> None:
    wait_until(pred, timeout, what, interval=0.05)


def monotonic_ms() -> float:
    return time.monotonic() * 1000


@contextlib.contextmanager
def in_process_store(memory: int = 16 << 20) -> Iterator[tuple[str, Any]]:
    """A master and one store server in this process (a fake at a seam, e.g. the CUDA driver,
    must reach them); yields the master's address and the server."""
    from mooncake_connectors.store.config import MasterConfig, ServerConfig
    from mooncake_connectors.store.master import Master
    from mooncake_connectors.store.server import StoreServer

    master = Master(MasterConfig(port=0, heartbeat_interval=0.2, server_ttl=30.0)).start()
    server = StoreServer(ServerConfig(master=master.address, memory=memory)).start()
    try:
        yield master.address, server
    finally:
        server.close()
        master.close()
