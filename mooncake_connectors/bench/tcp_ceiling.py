"""The kernel's own loopback TCP ceiling, measured by ``iperf3`` (a C program) when installed.

``bench transfer``'s ``raw_socket`` column is a Python loop: the best a TCP design in Python can
hope for request by request. This is the other bound: how many bytes per second the kernel moves
over loopback TCP on this machine with no Python and no request framing, one stream and two (the
machine's two cores), streaming one cache-hot 1 MiB buffer. A TCP design moving requests between
cold buffers, ours or Mooncake's, gets near it at best (ours measured 0.75-1.16 of it from 1 MiB
up). Every run is bounded in time; a missing or failing ``iperf3`` raises RuntimeError, which
``bench transfer`` turns into a note.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from typing import Any

from .ports import free_port
from .procs import wait_or_kill

IPERF3 = "iperf3"
MAX_LENGTH = 1 << 20  # iperf3's largest TCP write


def available() -> bool:
    return shutil.which(IPERF3) is not None


def loopback_gb_s(streams: int, seconds: int = 1, length: int = 1 << 20) -> float:
    """GB/s (1e9 bytes/s) received by one ``iperf3`` client over 127.0.0.1 with ``streams``
    parallel streams of ``length``-byte writes for ``seconds`` (whole seconds: iperf3 reads
    ``-t 0.5`` as no limit at all; writes of at most 1 MiB); raises RuntimeError on failure."""
    if not 1 <= seconds <= 60:
        raise ValueError(f"iperf3 runs for 1 to 60 whole seconds here, not {seconds}")
    if not 1 <= length <= MAX_LENGTH:
        raise ValueError(f"iperf3 writes 1 byte to {MAX_LENGTH} bytes at a time, not {length}")
    if not 1 <= streams <= 128:
        raise ValueError(f"iperf3 runs 1 to 128 parallel streams, not {streams}")
    port = free_port()
    try:
        server = subprocess.Popen(
            [IPERF3, "-s", "-B", "127.0.0.1", "-p", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    except OSError as exc:
        raise RuntimeError(f"iperf3 could not start: {exc}") from exc
    try:
        # No probe connection first: iperf3's server would take it for a client and then
        # refuse the real one; so the client retries while the server is still starting.
        end = time.monotonic() + 10
        client = [IPERF3, "-c", "127.0.0.1", "-p", str(port), "-J", "-P", str(streams)]
        while True:
            out = subprocess.run(
                [*client, "-t", str(seconds), "-l", str(length)],
                capture_output=True,
                text=True,
                timeout=seconds + 20,
                check=False,
            )
            try:
                report: dict[str, Any] = json.loads(out.stdout or "{}")
            except ValueError:
                report = {"error": (out.stdout + out.stderr).strip()[-300:]}
            error = str(report.get("error") or "")
            if out.returncode and not error:
                error = out.stderr.strip()[-300:] or f"exit status {out.returncode}"
            if "refused" in error and time.monotonic() < end and server.poll() is None:
                time.sleep(0.05)
                continue
            if error:
                raise RuntimeError(f"iperf3 failed: {error}")
            return float(report["end"]["sum_received"]["bits_per_second"]) / 8e9
    except (subprocess.TimeoutExpired, KeyError, TypeError) as exc:
        raise RuntimeError(f"iperf3 gave no rate: {exc}") from exc
    finally:
        if server.poll() is None:
            server.terminate()
        wait_or_kill(server, 5)
