"""Several "machines" on one: Linux network namespaces on a private bridge, for multi-host tests.

    with Hosts(["etcd", "master", "s1"]) as hosts:
        hosts.addr("s1")                       # "10.213.N.12"
        hosts.popen("s1", [sys.executable, ...])  # a process on that machine
        hosts.cut("s1")                        # its cable pulled

Each host is a namespace with one veth cable into a bridge in the root namespace (which holds the
``.1`` address, so the test process can reach every host), loopback up, and its own UTS namespace
and host name for the processes started on it: the transfer engine then sees different machines
and speaks tcp between them, not shared memory. Names carry a random tag, the subnet is a free
random 10.213.N.0/24, and :meth:`close` removes everything it made (namespaces, cables, bridge)
even after a failed start. Needs root (CAP_NET_ADMIN) and iproute2's ``ip``.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import tempfile
import uuid
from typing import IO, Any

TIMEOUT = 20.0  # every ip command


def unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None when they can."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if shutil.which("unshare") is None:
        return "util-linux's `unshare` is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN)"
    probe = f"mcprobe{uuid.uuid4().hex[:6]}"
    r = subprocess.run(
        ["ip", "netns", "add", probe], capture_output=True, text=True, timeout=TIMEOUT
    )
    if r.returncode != 0:
        return f"`ip netns add` is not permitted here: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=TIMEOUT)
    return None


def ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *(["-n", ns] if ns else []), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {r.stderr.strip()}")


def _free_subnet() -> int:
    used = subprocess.run(
        ["ip", "-o", "-4", "addr"], capture_output=True, text=True, timeout=TIMEOUT
    ).stdout
    for _ in range(100):
        n = random.randrange(1, 255)
        if f"10.213.{n}." not in used:
            return n
    raise RuntimeError("no free 10.213.N.0/24 subnet")


class Proc:
    """A process on one host; its output goes to a temp file (shown when a test fails)."""

    def __init__(self, argv: list[str], name: str) -> None:
        self.name = name
        self.log: IO[bytes] = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed in close()
            prefix=f"mc-{name}-", suffix=".log", delete=False
        )
        self.proc = subprocess.Popen(
            argv, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def close(self) -> None:
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()
        with contextlib.suppress(OSError):
            os.unlink(self.log.name)

    def output(self) -> str:
        with open(self.log.name, errors="replace") as fh:
            return f"--- {self.name} ---\n{fh.read()[-3000:]}"


class Hosts:
    def __init__(self, names: list[str]) -> None:
        self.tag = uuid.uuid4().hex[:6]
        self.names = list(names)
        self.net = 0
        self.bridge = f"mcs{self.tag}br"
        self._made_ns: list[str] = []
        self._made_bridge = False
        self.procs: list[Proc] = []

    def ns(self, host: str) -> str:
        return f"mcs-{self.tag}-{host}"

    def cable(self, host: str) -> str:
        return f"mcs{self.tag}v{self.names.index(host)}"

    def addr(self, host: str) -> str:
        return f"10.213.{self.net}.{10 + self.names.index(host)}"

    def start(self) -> Hosts:
        try:
            self.net = _free_subnet()
            ip("link", "add", self.bridge, "type", "bridge")
            self._made_bridge = True
            ip("addr", "add", f"10.213.{self.net}.1/24", "dev", self.bridge)
            ip("link", "set", self.bridge, "up")
            for host in self.names:
                ns = self.ns(host)
                ip("netns", "add", ns)
                self._made_ns.append(ns)
                ip(
                    "link",
                    "add",
                    self.cable(host),
                    "type",
                    "veth",
                    "peer",
                    "name",
                    "eth0",
                    "netns",
                    ns,
                )
                ip("link", "set", self.cable(host), "master", self.bridge, "up")
                ip("addr", "add", f"{self.addr(host)}/24", "dev", "eth0", ns=ns)
                ip("link", "set", "eth0", "up", ns=ns)
                ip("link", "set", "lo", "up", ns=ns)
        except BaseException:
            self.close()
            raise
        return self

    def argv(self, host: str, cmd: list[str]) -> list[str]:
        """``cmd`` run on ``host``: in its network namespace, with its own host name."""
        script = f'hostname {self.ns(host)} && exec "$@"'
        return [
            "ip",
            "netns",
            "exec",
            self.ns(host),
            "unshare",
            "--uts",
            "sh",
            "-c",
            script,
            "sh",
            *cmd,
        ]

    def popen(self, host: str, cmd: list[str]) -> Proc:
        p = Proc(self.argv(host, cmd), host)
        self.procs.append(p)
        return p

    def run(self, host: str, cmd: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.argv(host, cmd), capture_output=True, text=True, timeout=timeout, check=False
        )

    def cut(self, host: str) -> None:
        """Pull ``host``'s cable: nothing reaches it, nothing leaves it."""
        ip("link", "set", self.cable(host), "down")

    def outputs(self) -> str:
        return "\n".join(p.output() for p in self.procs)

    def close(self) -> None:
        for p in self.procs:
            with contextlib.suppress(Exception):
                p.close()
        self.procs.clear()
        for host in self.names:
            # Deleting a namespace would destroy its cable too, but only once nothing pins the
            # namespace any more (sockets closing can hold it for a while): delete it now.
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                if self.ns(host) in self._made_ns:
                    ip("link", "del", self.cable(host))
        for ns in self._made_ns:
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                ip("netns", "del", ns)
        self._made_ns.clear()
        if self._made_bridge:
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                ip("link", "del", self.bridge)
            self._made_bridge = False

    def __enter__(self) -> Hosts:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Loopback:
    """One network namespace with only loopback up: a process run in it (:meth:`argv`) may bind
    a wildcard address (``0.0.0.0``), which then reaches nothing but that namespace's own ``lo``.
    The name carries a random tag; :meth:`close` deletes it, also after a failed start."""

    def __init__(self) -> None:
        self.name = f"mcs-{uuid.uuid4().hex[:6]}-lo"
        self._made = False

    def start(self) -> Loopback:
        try:
            ip("netns", "add", self.name)
            self._made = True
            ip("link", "set", "lo", "up", ns=self.name)
        except BaseException:
            self.close()
            raise
        return self

    def argv(self, cmd: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *cmd]

    def links(self) -> list[str]:
        """The namespace's interfaces that are up."""
        r = subprocess.run(
            ["ip", "-n", self.name, "-o", "link", "show", "up"],
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
        return [line.split(":")[1].strip() for line in r.stdout.splitlines() if ":" in line]

    def pids(self) -> list[int]:
        """The processes in the namespace (all started in it by the test)."""
        r = subprocess.run(
            ["ip", "netns", "pids", self.name], capture_output=True, text=True, timeout=TIMEOUT
        )
        return [int(p) for p in r.stdout.split() if p.isdigit()]

    def close(self) -> None:
        """Kill what is left in the namespace (a run killed at its timeout leaves its children
        behind), then delete it."""
        if self._made:
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                for pid in self.pids():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                ip("netns", "del", self.name)
            self._made = False

    def __enter__(self) -> Loopback:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()
