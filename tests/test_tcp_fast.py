"""The tcp transport's compiled loops (``_tcp_fast``) and the engine's short way for one request
(``fastpath``): the frames they exchange, where they hand back to Python, and that a request
they cannot take still goes the general way with its errors. The loops themselves are driven
over socket pairs; the engine's path against a target in another process.

The rest of the tcp suites run with the compiled loops when they are built (the default) and
again without them (``MOONCAKE_CONNECTORS_PURE_PYTHON=1``, in scripts/test)."""

from __future__ import annotations

import array
import errno
import fcntl
import hashlib
import os
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from helpers import Peer, pattern, wait_until

from mooncake_connectors.config import EngineConfig
from mooncake_connectors.errors import AccessViolation
from mooncake_connectors.transfer_core import TransferEngine
from mooncake_connectors.transfer_core.metadata.http import MetadataHTTPServer
from mooncake_connectors.transfer_core.transports import fast, wire
from mooncake_connectors.transfer_core.transports.tcp import TcpTransport

KiB = 1 << 10
SIZE = 256 * KiB  # the peer's region, filled with pattern(3, SIZE)
compiled = pytest.mark.skipif(fast.tcp is None, reason="compiled tcp loops not built")


def test_ci_builds_the_compiled_loops() -> None:
    """CI installs with a C compiler: the compiled loops must be there (and used), or every
    other tcp test here would quietly exercise the pure-Python loops only."""
    if not os.environ.get("CI") or os.environ.get(fast.PURE_ENV):
        pytest.skip("only checked in CI runs that do not ask for pure Python")
    assert fast.tcp is not None
    assert TcpTransport.runs_one


# -- spinning before sleeping -----------------------------------------------------------------
def test_spin_budget_comes_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(fast.SPIN_ENV, raising=False)
    assert fast.spin_us() == fast.DEFAULT_SPIN_US
    for text, want in (("0", 0), (" 200 ", 200), (str(fast.MAX_SPIN_US), fast.MAX_SPIN_US)):
        monkeypatch.setenv(fast.SPIN_ENV, text)
        assert fast.spin_us() == want
    for bad in ("abc", "-1", "2.5", str(fast.MAX_SPIN_US + 1)):
        monkeypatch.setenv(fast.SPIN_ENV, bad)
        caplog.clear()
        assert fast.spin_us() == fast.DEFAULT_SPIN_US
        assert fast.SPIN_ENV in caplog.text and repr(bad) in caplog.text


@compiled
def test_the_loader_sets_the_budget_and_set_spin_checks_it() -> None:
    assert fast.tcp is not None
    code = "from mooncake_connectors.transfer_core.transports import fast; print(fast.tcp.spin())"
    env = {**os.environ, fast.SPIN_ENV: "7"}
    env.pop(fast.PURE_ENV, None)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) == pytest.approx(7e-6)
    for bad in (-1e-6, float("nan")):
        with pytest.raises(ValueError, match="spin"):
            fast.tcp.set_spin(bad)


@compiled
def test_wait_readable_spins_until_data_or_the_budget() -> None:
    assert fast.tcp is not None
    a, b = socket.socketpair()
    try:
        t0 = time.monotonic()
        assert fast.tcp.wait_readable(a.fileno(), 0.02) is False  # nothing came: the budget
        assert 0.02 <= time.monotonic() - t0 < 2
        later = threading.Timer(0.05, lambda: b.sendall(b"x"))
        later.start()
        assert fast.tcp.wait_readable(a.fileno(), 5.0) is True  # returns on the byte
        later.join()
        assert a.recv(1) == b"x"
        b.close()
        assert fast.tcp.wait_readable(a.fileno(), 5.0) is True  # a closed peer reads too
    finally:
        a.close()
        b.close()


# -- the compiled loops over a socket pair (each test twice: waits that sleep, waits that spin) --
@pytest.fixture(params=[0.0, 50e-6], ids=["sleeps", "spins"])
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    for s in (a, b):
        wire.set_io_tick(s, 0.05)
    before = fast.tcp.spin() if fast.tcp is not None else 0.0
    if fast.tcp is not None:
        fast.tcp.set_spin(request.param)
    try:
        yield a, b
    finally:
        if fast.tcp is not None:
            fast.tcp.set_spin(before)
        a.close()
        b.close()


def addr_of(buf: Any) -> int:
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


def unread(s: socket.socket) -> int:
    """Bytes waiting in ``s``'s receive queue."""
    return int(struct.unpack("i", fcntl.ioctl(s.fileno(), termios.FIONREAD, b"\0" * 4))[0])


def resp(status: int, rid: int, length: int) -> bytes:
    return wire.RESP.pack(wire.RESP_MAGIC, status, 0, 0, rid, length)


@compiled
def test_exchange_read_lands_the_bytes_and_sends_one_request(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    assert fast.tcp is not None
    a, b = pair
    dest = bytearray(1000)
    b.sendall(resp(wire.ST_OK, 7, 1000) + bytes(range(250)) * 4)
    got = fast.tcp.exchange(
        a.fileno(), wire.OP_READ, 7, 0x1000, addr_of(dest), 1000, time.monotonic() + 5
    )
    assert got == 0
    assert dest == bytes(range(250)) * 4
    req = wire.REQ.unpack(b.recv(wire.REQ.size))
    assert req == (wire.REQ_MAGIC, wire.OP_READ, 0, 0, 7, 0x1000, 1000)


@compiled
def test_exchange_write_sends_header_and_payload(pair: tuple[socket.socket, socket.socket]) -> None:
    assert fast.tcp is not None
    a, b = pair
    src = bytearray(os.urandom(3000))
    b.sendall(resp(wire.ST_OK, 9, 0))
    assert (
        fast.tcp.exchange(
            a.fileno(), wire.OP_WRITE, 9, 0x2000, addr_of(src), 3000, time.monotonic() + 5
        )
        == 0
    )
    data = b""
    while len(data) < wire.REQ.size + 3000:
        data += b.recv(65536)
    assert wire.REQ.unpack(data[: wire.REQ.size]) == (
        wire.REQ_MAGIC,
        wire.OP_WRITE,
        0,
        0,
        9,
        0x2000,
        3000,
    )
    assert data[wire.REQ.size :] == src


@compiled
def test_exchange_outcomes(pair: tuple[socket.socket, socket.socket]) -> None:
    assert fast.tcp is not None
    a, b = pair
    dest = bytearray(16)
    far = time.monotonic() + 5

    def read(rid: int, deadline: float = far) -> object:
        assert fast.tcp is not None
        return fast.tcp.exchange(a.fileno(), wire.OP_READ, rid, 0, addr_of(dest), 16, deadline)

    b.sendall(resp(wire.ST_ACCESS, 1, 5) + b"nope!")  # refused, with the peer's message
    assert read(1) == (wire.ST_ACCESS, b"nope!")
    # a message whose second part comes after the exchange took the first
    b.sendall(resp(wire.ST_ACCESS, 2, 40) + b"m" * 10)
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.append(read(2)))
    reader.start()
    wait_until(lambda: unread(a) == 0, 5, "the exchange to take the first part")
    b.sendall(b"n" * 30)
    reader.join(10)
    assert got == [(wire.ST_ACCESS, b"m" * 10 + b"n" * 30)]
    b.recv(1 << 16)
    b.sendall(resp(wire.ST_ACCESS, 3, wire.MAX_ERROR_MESSAGE + 1))  # an oversized message
    assert read(3) == fast.tcp.PROTOCOL
    b.recv(1 << 16)
    b.sendall(resp(wire.ST_OK, 99, 16))  # an answer to another request
    assert read(4) == fast.tcp.PROTOCOL
    b.recv(1 << 16)
    b.sendall(resp(wire.ST_OK, 5, 15))  # a READ answered with the wrong length
    assert read(5) == fast.tcp.PROTOCOL
    b.recv(1 << 16)
    t0 = time.monotonic()
    assert read(6, time.monotonic() + 0.3) == fast.tcp.TIMEOUT  # a silent peer: the deadline
    assert 0.25 < time.monotonic() - t0 < 2
    b.shutdown(socket.SHUT_WR)  # the peer stops answering and says so
    assert read(7) == fast.tcp.CLOSED
    b.close()  # gone: the request itself cannot be sent
    assert read(8) == fast.tcp.BROKEN
    assert fast.tcp.last_errno() == errno.EPIPE


# -- the compiled serve loop over a socket pair ---------------------------------------------
class Served:
    """A region of 64 KiB of this process and its 8-byte generation, as the serve loop sees them."""

    def __init__(self) -> None:
        self.mem = bytearray(os.urandom(64 * KiB))
        self.lo = addr_of(self.mem)
        self.gen = array.array("Q", [5])
        self.hdr = bytearray(wire.REQ.size)

    def serve(self, fd: int, rights: int = 3, frame_timeout: float = 5.0) -> int:
        assert fast.tcp is not None
        return fast.tcp.serve(
            fd,
            self.lo,
            self.lo + len(self.mem),
            rights,
            self.gen.buffer_info()[0],
            5,
            frame_timeout,
            float(1 << 20),
            wire.MAX_PAYLOAD,
            self.hdr,
        )


def req(op: int, rid: int, addr: int, length: int, magic: int = wire.REQ_MAGIC) -> bytes:
    return wire.REQ.pack(magic, op, 0, 0, rid, addr, length)


def read_exact(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        out += s.recv(n - len(out))
    return out


@compiled
def test_serve_answers_requests_inside_the_region(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    r = Served()
    payload = os.urandom(1000)
    b.sendall(
        req(wire.OP_READ, 1, r.lo + 100, 500) + req(wire.OP_WRITE, 2, r.lo + 4096, 1000) + payload
    )
    assert fast.tcp is not None
    assert r.serve(a.fileno()) == fast.tcp.IDLE  # both served, then nothing more arrived
    assert read_exact(b, wire.RESP.size + 500) == resp(wire.ST_OK, 1, 500) + bytes(r.mem[100:600])
    assert read_exact(b, wire.RESP.size) == resp(wire.ST_OK, 2, 0)
    assert bytes(r.mem[4096:5096]) == payload


@compiled
@pytest.mark.parametrize(
    "why",
    [
        "outside",
        "straddles",
        "empty",
        "too_long",
        "bad_magic",
        "ping",
        "write_to_read_only",
        "new_generation",
    ],
)
def test_serve_hands_back_what_it_may_not_serve(
    pair: tuple[socket.socket, socket.socket], why: str
) -> None:
    assert fast.tcp is not None
    a, b = pair
    r = Served()
    before = bytes(r.mem)
    end = r.lo + len(r.mem)
    frame = {
        "outside": req(wire.OP_READ, 4, end, 16),
        "straddles": req(wire.OP_WRITE, 4, end - 8, 16),
        "empty": req(wire.OP_READ, 4, r.lo, 0),
        "too_long": req(wire.OP_READ, 4, r.lo, wire.MAX_PAYLOAD + 1),
        "bad_magic": req(wire.OP_READ, 4, r.lo, 16, magic=0x12345678),
        "ping": req(wire.OP_PING, 4, 0, 0),
        "write_to_read_only": req(wire.OP_WRITE, 4, r.lo, 16),
        "new_generation": req(wire.OP_READ, 4, r.lo, 16),
    }[why]
    if why == "new_generation":
        r.gen[0] = 6  # a registration changed: every request goes back to Python's checks
    first = b"" if why == "new_generation" else req(wire.OP_READ, 3, r.lo, 8)
    b.sendall(first + frame + b"\xee" * 16)
    assert r.serve(a.fileno(), rights=1 if why == "write_to_read_only" else 3) == fast.tcp.HANDBACK
    assert bytes(r.hdr) == frame
    if why != "new_generation":  # the first request was served before it
        assert read_exact(b, wire.RESP.size + 8) == resp(wire.ST_OK, 3, 8) + before[:8]
    assert bytes(r.mem) == before  # nothing written
    a.setblocking(False)
    assert a.recv(64) == b"\xee" * 16  # a WRITE's payload is left for Python to consume


@compiled
def test_serve_ends_on_a_stalled_or_closed_peer(pair: tuple[socket.socket, socket.socket]) -> None:
    assert fast.tcp is not None
    a, b = pair
    r = Served()
    b.sendall(req(wire.OP_WRITE, 1, r.lo, 4096) + b"x" * 100)  # then nothing more
    t0 = time.monotonic()
    assert r.serve(a.fileno(), frame_timeout=0.2) == fast.tcp.TIMEOUT
    assert time.monotonic() - t0 < 2
    b.sendall(req(wire.OP_READ, 2, r.lo, 8)[:10])  # half a header, then the peer goes
    b.close()
    assert r.serve(a.fileno()) == fast.tcp.CLOSED


# -- the engine's short way, against a target in another process ----------------------------
@pytest.fixture
def peer(meta_server: MetadataHTTPServer) -> Iterator[tuple[Peer, int]]:
    p = Peer(metadata=meta_server.url, transports=["tcp"])
    try:
        yield p, p.call("alloc", kind="numpy", size=SIZE, seed=3)["addr"]
    finally:
        p.close()


def sha(data: object) -> str:
    return hashlib.sha256(bytes(data)).hexdigest()  # type: ignore[call-overload]


def counting_plans(e: TransferEngine) -> list[int]:
    calls: list[int] = []
    plan = e._plan

    def counted(*args: Any, **kw: Any) -> Any:
        calls.append(1)
        return plan(*args, **kw)

    e._plan = counted  # type: ignore[method-assign]
    return calls


def test_one_request_at_a_time_takes_the_short_way(
    meta_server: MetadataHTTPServer, peer: tuple[Peer, int]
) -> None:
    p, remote = peer
    e = TransferEngine(EngineConfig(metadata=meta_server.url, transports=("tcp",))).start()
    try:
        local = np.zeros(SIZE, dtype=np.uint8)
        e.register(local)
        la = int(local.ctypes.data)
        plans = counting_plans(e)
        for off in range(0, SIZE, 16 * KiB):
            e.read(p.segment, la + off, remote + off, 16 * KiB)
        assert sha(local) == sha(pattern(3, SIZE))
        local[:] = pattern(4, SIZE)
        for off in range(0, SIZE, 16 * KiB):
            e.write(p.segment, la + off, remote + off, 16 * KiB)
        assert p.call("digest", addr=remote, length=SIZE)["sha"] == sha(pattern(4, SIZE))
        # of these 32 requests the first looks the peer up and the second keeps its route; with
        # the compiled loops the other 30 take the short way and plan nothing
        assert len(plans) == (2 if TcpTransport.runs_one else 32)
    finally:
        e.close()


def test_short_way_yields_to_changes(
    meta_server: MetadataHTTPServer, peer: tuple[Peer, int]
) -> None:
    p, remote = peer
    e = TransferEngine(EngineConfig(metadata=meta_server.url, transports=("tcp",))).start()
    try:
        a = np.zeros(64 * KiB, dtype=np.uint8)
        e.register(a)
        e.read(p.segment, int(a.ctypes.data), remote, 4 * KiB)  # the route is kept
        plans = counting_plans(e)
        b = np.zeros(64 * KiB, dtype=np.uint8)
        e.register(b)  # a local registration changed: the next request plans again
        e.read(p.segment, int(b.ctypes.data), remote + 4 * KiB, 4 * KiB)
        assert len(plans) == 1
        assert bytes(b[: 4 * KiB]) == bytes(pattern(3, SIZE)[4 * KiB : 8 * KiB])
        # outside the remote region the short way does not try
        with pytest.raises(AccessViolation):
            e.read(p.segment, int(b.ctypes.data), remote + SIZE - 1 * KiB, 4 * KiB)
        # the target unregisters the region: a WRITE the engine still thinks allowed is refused
        # by the target (its serve loop sees the generation change) and lands nowhere
        before = p.call("digest", addr=remote, length=SIZE)["sha"]
        p.call("unregister", addr=remote)
        b[:] = 0xAB
        with pytest.raises(AccessViolation):
            e.write(p.segment, int(b.ctypes.data), remote, 4 * KiB)
        assert p.call("digest", addr=remote, length=SIZE)["sha"] == before
    finally:
        e.close()


def test_a_read_only_region_is_read_the_short_way_and_never_written(
    meta_server: MetadataHTTPServer, peer: tuple[Peer, int]
) -> None:
    p, _ = peer
    ro = p.call("alloc", kind="readonly", size=64 * KiB, seed=5)["addr"]
    e = TransferEngine(EngineConfig(metadata=meta_server.url, transports=("tcp",))).start()
    try:
        local = np.zeros(64 * KiB, dtype=np.uint8)
        e.register(local)
        e.read(p.segment, int(local.ctypes.data), ro, 4 * KiB)
        assert bytes(local[: 4 * KiB]) == bytes(pattern(5, 64 * KiB)[: 4 * KiB])
        with pytest.raises(AccessViolation):
            e.write(p.segment, int(local.ctypes.data), ro, 4 * KiB)
        e.read(
            p.segment, int(local.ctypes.data), ro + 4 * KiB, 4 * KiB
        )  # the connection still serves
        assert bytes(local[: 4 * KiB]) == bytes(pattern(5, 64 * KiB)[4 * KiB : 8 * KiB])
    finally:
        e.close()
