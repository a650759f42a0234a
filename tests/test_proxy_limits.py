"""The PD proxy against hostile clients: its own ``kv_transfer_params`` only, bodies it must
refuse (400) or backends it cannot reach (502) without a traceback, request deadlines, and
descriptor exhaustion. The proxy runs unchanged; the engines are the recording stand-ins of
test_proxy, and the deadline and EMFILE checks run the ``proxy`` command itself."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import select
import socket
import time
from typing import Any

import pytest

aiohttp = pytest.importorskip("aiohttp", reason="the proxy extra is not installed")
from helpers import free_port, http_ok, wait_until  # noqa: E402
from store_cluster import Proc, listening  # noqa: E402
from test_proxy import cluster, run  # noqa: E402

from mooncake_connectors.pd import params as pdp  # noqa: E402

# what a hostile client would like a decode worker to read KV from
EVIL = {
    "do_remote_prefill": True,
    "remote_engine_id": "victim-engine",
    "remote_block_ids": [0, 1, 2, 3],
    "remote_side_channels": ["tcp://10.9.9.9:5555"],
    "remote_prompt_hash": "attacker-chosen",
}
PROXY_LEG = pdp.encode(pdp.PrefillLeg())  # the only kv_transfer_params of a prefill leg


async def complete(url: str, body: Any) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body) as r:
        return r.status, await r.json()


@pytest.mark.parametrize("prefill", ["ok", "down", "bare"])
def test_the_client_never_chooses_the_kv_transfer_params(prefill: str) -> None:
    async def go() -> None:
        async with cluster() as (prefills, decodes, url):
            for p in prefills:
                if prefill == "down":
                    await p.stop()  # connections refused
                p.bare = prefill == "bare"  # 200 without kv_transfer_params
            body = {"model": "m", "prompt": "p", "max_tokens": 4, "kv_transfer_params": EVIL}
            status, out = await complete(url, body)
            assert status == 200 and out["choices"][0]["text"] == "decoded"
            (leg,) = [b for d in decodes for b in d.bodies]
            if prefill == "ok":  # the prefill's answer, and nothing of the client's
                assert leg["kv_transfer_params"] == {"from": "p0"}
            else:  # no transfer: the decode computes the prompt itself
                assert "kv_transfer_params" not in leg, leg
            if prefill != "down":
                (pleg,) = prefills[0].bodies
                assert pleg["kv_transfer_params"] == PROXY_LEG

    run(go())


def test_a_request_being_served_outlives_the_read_deadline() -> None:
    async def go() -> None:
        async with cluster(read_deadline=0.3, idle_timeout=0.6) as (prefills, decodes, url):
            for u in (*prefills, *decodes):
                u.delay = 0.5  # each leg: longer than the deadline, the two longer than idle
            body = {"model": "m", "prompt": "p", "max_tokens": 4, "stream": True}
            async with aiohttp.ClientSession() as s:
                for _ in range(2):  # and on the same connection again
                    async with s.post(url + "/v1/completions", json=body) as r:
                        assert r.status == 200
                        assert (await r.read()).rstrip().endswith(b"data: [DONE]")

    run(go())


def raw_request(port: int, data: bytes, timeout: float = 10.0) -> tuple[int, bytes]:
    """One request over a plain socket (bytes no HTTP client would send); (status, body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        got = b""
        while b"\r\n\r\n" not in got or len(got.split(b"\r\n\r\n", 1)[1]) < _length(got):
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
    head, _, payload = got.partition(b"\r\n\r\n")
    return int(head.split()[1]), payload[: _length(got)]


def _length(got: bytes) -> int:
    for line in got.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 1 << 30


def post(body: bytes) -> bytes:
    head = b"POST /v1/completions HTTP/1.1\r\nHost: p\r\nContent-Type: application/json\r\n"
    return head + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body


BAD_BODIES = {
    "invalid utf-8": b'{"prompt": "\xff\xfe"}',
    "100k deep": b'{"prompt": "p", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "NaN": b'{"prompt": "p", "temperature": NaN}',
    "Infinity": b'{"prompt": "p", "top_p": -Infinity}',
}


def test_bad_bodies_get_400_and_a_dead_decode_502_without_a_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)

    async def go() -> None:
        async with cluster() as (prefills, decodes, url):
            port = int(url.rsplit(":", 1)[1])
            for what, body in BAD_BODIES.items():
                status, out = await _in_thread(raw_request, port, post(body))
                assert status == 400, (what, status, out[:300])
                assert json.loads(out)["error"]["type"] == "invalid_request_error", (what, out)
            # nothing reached an engine
            assert [b for u in (*prefills, *decodes) for b in u.bodies] == []
            for d in decodes:
                await d.stop()
            get = b"GET /v1/models HTTP/1.1\r\nHost: p\r\nConnection: close\r\n\r\n"
            status, raw = await _in_thread(raw_request, port, get)
            assert status == 502, (status, raw[:300])
            assert json.loads(raw)["error"]["type"] == "upstream_error", raw
            status, out = await complete(url, {"model": "m", "prompt": "p"})
            assert status == 502 and out["error"]["type"] == "upstream_error", out

    run(go())
    noisy = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert noisy == [], [r.getMessage() for r in noisy]


MALFORMED = [  # what aiohttp's own parser refuses, before any handler of ours runs
    b"PATCH http://x/y \r\n\r\n",
    b"POST /v1/completions HTTP/9.9\r\nHost: p\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nContent-Length: 111111111111111111111111111111\r\n\r\n",
    b"GET / HTTP/1.1\r\nBad Header\r\n\r\n",
]


def test_malformed_requests_get_400_and_a_few_lines_without_a_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # aiohttp logs each parser refusal at ERROR with its traceback (a fuzz run: 552 of them)
    caplog.set_level(logging.WARNING)

    async def go() -> None:
        async with cluster() as (_, _, url):
            port = int(url.rsplit(":", 1)[1])
            for i in range(60):
                status, _ = await _in_thread(raw_request, port, MALFORMED[i % len(MALFORMED)])
                assert status == 400, (i, status)

    run(go())
    noisy = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert noisy == [], [r.getMessage() for r in noisy[:3]]
    refused = [r for r in caplog.records if "malformed request" in r.getMessage()]
    assert 1 <= len(refused) <= 10, len(refused)  # 5 per 10 s, then a count


async def _in_thread(fn: Any, *args: Any) -> Any:
    return await asyncio.to_thread(fn, *args)


# -- the proxy command: deadlines and descriptor exhaustion ------------------------------------
def start_proxy(*extra: str, nofile: int | None = None) -> tuple[Proc, int]:
    port = free_port()
    dead = "http://127.0.0.1:9"  # the engines are not needed for /health
    p = Proc(["proxy", "--prefill", dead, "--decode", dead, "--port", str(port), *extra], nofile)
    wait_until(lambda: listening(port) or not p.alive(), 60, "the proxy to listen")
    assert p.alive(), p.output()
    return p, port


def closed_at(s: socket.socket, deadline: float, trickle: bytes = b"") -> float | None:
    """When the proxy closed ``s`` (monotonic), sending ``trickle`` a byte every 0.2 s."""
    sent = 0
    while time.monotonic() < deadline:
        if sent < len(trickle):
            try:
                s.send(trickle[sent : sent + 1])
            except OSError:
                return time.monotonic()
            sent += 1
        ready, _, _ = select.select([s], [], [], 0.2)
        if ready:
            try:
                if s.recv(65536) == b"":
                    return time.monotonic()
            except ConnectionResetError:
                return time.monotonic()
    return None


def test_slow_short_and_idle_clients_are_cut_within_their_deadlines() -> None:
    p, port = start_proxy("--read-deadline", "2", "--idle-timeout", "4")
    try:
        slow = b"GET /health HTTP/1.1\r\nHost: p\r\nX-Padding: " + b"a" * 200 + b"\r\n\r\n"
        short = post(b'{"prompt": "p"}' + b" " * 100)[:-50]  # 50 bytes under its Content-Length
        for name, first, trickle, limit in (
            ("slowloris", slow[:1], slow[1:], 2),
            ("short body", short, b"", 2),
            ("idle", b"", b"", 4),
        ):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                t0 = time.monotonic()
                s.sendall(first)
                at = closed_at(s, t0 + limit + 8, trickle)  # generous: a loaded 2-core machine
                assert at is not None, f"{name}: still open {limit + 8} s later; {p.output()}"
                assert at - t0 >= limit - 0.5, f"{name}: cut after {at - t0:.2f} s"
            assert http_ok(f"http://127.0.0.1:{port}/health"), p.output()  # others are served
    finally:
        p.close()


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_out_of_descriptors_the_proxy_backs_off_and_serves_again() -> None:
    nofile = 64
    p, port = start_proxy(nofile=nofile)
    flood: list[socket.socket] = []
    try:
        for _ in range(nofile + 40):  # the rest wait in the backlog while accept() fails
            flood.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        fds = f"/proc/{p.pid}/fd"
        wait_until(lambda: len(os.listdir(fds)) >= nofile - 1, 20, "the proxy to run out of fds")
        window = 2.0
        cpu0, t0 = cpu_seconds(p.pid), time.monotonic()
        while time.monotonic() - t0 < window:  # watch a failing accept() for a while
            time.sleep(0.1)
        busy = (cpu_seconds(p.pid) - cpu0) / (time.monotonic() - t0)
        out = p.output()
        lines = out.count("accept failed") + out.count("out of system resource")
        assert busy < 0.2, f"the proxy spins at EMFILE: {busy:.0%} of a core; {out[-1500:]}"
        assert lines <= 3, f"{lines} accept-failure log lines"
        for s in flood:
            s.close()
        flood.clear()
        wait_until(lambda: http_ok(f"http://127.0.0.1:{port}/health"), 20, "service again")
        assert p.alive(), p.output()
    finally:
        for s in flood:
            s.close()
        p.close()
