"""Port numbers for the processes the benches start, and who holds one that was taken.

Our own processes bind port 0 and report the port they got (``mooncake-connectors master``
prints it). A foreign engine (vLLM's HTTP server, NIXL's side channel, Mooncake's bootstrap
server) needs its number before it starts: :func:`free_port` reserves one by binding port 0 and
closing, which leaves a window in which any other process may take it. Launchers of foreign
engines therefore watch the engine's log for :data:`ADDRESS_IN_USE` and start it again on fresh
numbers, a bounded number of times, naming the holder (:func:`holders`) when they give up.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ADDRESS_IN_USE = re.compile(r"address already in use|EADDRINUSE", re.IGNORECASE)
_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's "st" column


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (see the module docstring)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def clashes(text: str) -> list[str]:
    """The lines of a process's output that say an address it tried to bind was taken."""
    return [line for line in text.splitlines() if ADDRESS_IN_USE.search(line)]


def _listening_inodes(port: int) -> set[str]:
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            # local_address is HEXIP:HEXPORT, st the state, inode the 10th column
            if len(f) > 9 and f[3] == _LISTEN and int(f[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f[9])
    return inodes


def holders(port: int) -> str:
    """Who listens on TCP ``port`` on this machine, from /proc: e.g. ``pid 812 (python -m x)``;
    a socket of a process we may not inspect shows as ``a process of another user``."""
    inodes = _listening_inodes(port)
    if not inodes:
        return "no process listens on it now"
    found: list[str] = []
    wanted = {f"socket:[{i}]" for i in inodes}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if not any(os.readlink(f"/proc/{pid}/fd/{fd}") in wanted for fd in fds):
                continue
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        found.append(f"pid {pid} ({cmd.strip()[:120]})")
    return ", ".join(found) or "a process of another user"


def describe_clash(ports: Iterable[int], lines: list[str]) -> str:
    """The ports named in ``lines`` (all ``ports`` when none is) and who holds each now."""
    ports = list(ports)
    named = [p for p in ports if any(re.search(rf"\b{p}\b", line) for line in lines)] or ports
    return "; ".join(f"port {p}: {holders(p)}" for p in named)


def reported(read: Callable[[], str], key: str, timeout: float, alive: Callable[[], bool]) -> Any:
    """The value of ``key`` in the first JSON object line of a process's output, as it prints
    it once it is listening (``mooncake-connectors master`` prints its address so); ``read``
    returns the output so far, ``alive`` whether the process still runs."""
    end = time.monotonic() + timeout
    while True:
        for line in read().splitlines():
            line = line.strip()
            if line.startswith("{") and f'"{key}"' in line:
                try:
                    return json.loads(line)[key]
                except (ValueError, KeyError):
                    pass
        if not alive():
            raise RuntimeError(f"exited before reporting its {key}:\n{read()[-4000:]}")
        if time.monotonic() > end:
            raise TimeoutError(f"no {key} reported after {timeout}s:\n{read()[-4000:]}")
        time.sleep(0.05)
