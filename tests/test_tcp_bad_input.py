"""Malformed, truncated, oversized and unauthorised input to the tcp transport's server."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator

import numpy as np
import pytest

from mooncake_connectors.config import EngineConfig
from mooncake_connectors.errors import AuthenticationError
from mooncake_connectors.transfer_core import TransferEngine
from mooncake_connectors.transfer_core.transports import tcp_server, wire

TOKEN = "s3cret-token"


@pytest.fixture
def target() -> Iterator[tuple[TransferEngine, np.ndarray]]:
    e = TransferEngine(EngineConfig(metadata="memory://bad", transports=("tcp",))).start()
    buf = np.arange(1 << 16, dtype=np.uint8)
    e.register(buf)
    yield e, buf
    e.close()


def connect(
    e: TransferEngine,
    token: str | None = None,
    version: int = wire.VERSION,
    magic: bytes = wire.MAGIC,
) -> tuple[socket.socket, int]:
    host, port = e.segment_name.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=5)
    hello = bytearray(wire.HELLO.size)
    wire.recv_exact(s, memoryview(hello))
    _, _, _, _, nonce = wire.HELLO.unpack(hello)
    ours = bytes(wire.NONCE)
    s.sendall(wire.AUTH.pack(magic, version, 0, wire.initiator_proof(token, nonce, ours), ours))
    verdict = bytearray(wire.VERDICT.size)
    wire.recv_exact(s, memoryview(verdict))
    return s, wire.VERDICT.unpack(verdict)[1]


def response(s: socket.socket) -> tuple[int, int, bytes]:
    hdr = bytearray(wire.RESP.size)
    wire.recv_exact(s, memoryview(hdr))
    magic, status, _, _, rid, length = wire.RESP.unpack(hdr)
    assert magic == wire.RESP_MAGIC
    body = bytearray(length)
    wire.recv_exact(s, memoryview(body))
    return status, rid, bytes(body)


def closed(s: socket.socket) -> bool:
    s.settimeout(5)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def still_serves(e: TransferEngine, buf: np.ndarray) -> None:
    c = TransferEngine(EngineConfig(metadata="memory://bad", transports=("tcp",))).start()
    try:
        dst = np.zeros(256, dtype=np.uint8)
        c.register(dst)
        c.read(e.segment_name, dst.ctypes.data, buf.ctypes.data + 100, 256, timeout=5)
        assert np.array_equal(dst, buf[100:356])
    finally:
        c.close()


def test_wrong_version_is_refused(target: tuple[TransferEngine, np.ndarray]) -> None:
    e, buf = target
    s, verdict = connect(e, version=wire.VERSION + 1)
    assert verdict == wire.VERDICT_BAD_VERSION and closed(s)
    s, verdict = connect(e, magic=b"HTTP")
    assert verdict == wire.VERDICT_BAD_VERSION and closed(s)
    still_serves(e, buf)


def test_garbage_header_gets_protocol_error_then_close(
    target: tuple[TransferEngine, np.ndarray],
) -> None:
    e, buf = target
    s, verdict = connect(e)
    assert verdict == wire.VERDICT_OK
    s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(8))
    status, _, msg = response(s)
    assert status == wire.ST_PROTOCOL and b"malformed" in msg
    assert closed(s)
    still_serves(e, buf)


def test_truncated_frame_then_hangup(target: tuple[TransferEngine, np.ndarray]) -> None:
    e, buf = target
    s, _ = connect(e)
    s.sendall(wire.REQ.pack(wire.REQ_MAGIC, wire.OP_READ, 0, 0, 1, buf.ctypes.data, 10)[:11])
    s.close()
    still_serves(e, buf)


def test_oversized_length_is_refused(target: tuple[TransferEngine, np.ndarray]) -> None:
    e, buf = target
    s, _ = connect(e)
    s.sendall(wire.REQ.pack(wire.REQ_MAGIC, wire.OP_WRITE, 0, 0, 1, buf.ctypes.data, 1 << 40))
    status, _, msg = response(s)
    assert status == wire.ST_PROTOCOL and b"exceeds" in msg
    assert closed(s)
    still_serves(e, buf)


def test_out_of_bounds_is_refused_and_stream_stays_usable(
    target: tuple[TransferEngine, np.ndarray],
) -> None:
    e, buf = target
    s, _ = connect(e)
    base = buf.ctypes.data
    # READ past the end
    s.sendall(wire.REQ.pack(wire.REQ_MAGIC, wire.OP_READ, 0, 0, 1, base + buf.size - 4, 8))
    assert response(s)[:2] == (wire.ST_ACCESS, 1)
    # WRITE to an unregistered address, with its payload: drained, nothing written
    s.sendall(wire.REQ.pack(wire.REQ_MAGIC, wire.OP_WRITE, 0, 0, 2, 4096, 3000) + b"x" * 3000)
    assert response(s)[:2] == (wire.ST_ACCESS, 2)
    # the same connection still answers a valid READ, in order
    s.sendall(wire.REQ.pack(wire.REQ_MAGIC, wire.OP_READ, 0, 0, 3, base + 10, 5))
    assert response(s) == (wire.ST_OK, 3, bytes(buf[10:15]))
    s.close()
    still_serves(e, buf)


def test_token_is_required_and_checked() -> None:
    e = TransferEngine(
        EngineConfig(metadata="memory://auth", transports=("tcp",), auth_token=TOKEN)
    ).start()
    buf = np.ones(4096, dtype=np.uint8)
    e.register(buf)
    try:
        s, verdict = connect(e, token="wrong-token!")
        assert verdict == wire.VERDICT_BAD_TOKEN and closed(s)
        s, verdict = connect(e, token=None)
        assert verdict == wire.VERDICT_BAD_TOKEN and closed(s)
        for token in (None, "wrong-token!"):
            c = TransferEngine(
                EngineConfig(
                    metadata="memory://auth", transports=("tcp",), auth_token=token, timeout=5
                )
            ).start()
            dst = np.zeros(16, dtype=np.uint8)
            c.register(dst)
            with pytest.raises(AuthenticationError):
                c.read(e.segment_name, dst.ctypes.data, buf.ctypes.data, 16)
            c.close()
        c = TransferEngine(
            EngineConfig(metadata="memory://auth", transports=("tcp",), auth_token=TOKEN)
        ).start()
        dst = np.zeros(16, dtype=np.uint8)
        c.register(dst)
        c.read(e.segment_name, dst.ctypes.data, buf.ctypes.data, 16)
        assert (dst == 1).all()
        c.close()
    finally:
        e.close()


def test_a_flood_of_bad_clients_logs_a_bounded_number_of_lines(
    target: tuple[TransferEngine, np.ndarray], caplog: pytest.LogCaptureFixture
) -> None:
    """1,000 hostile connections (a wrong version, then garbage frames) cost a few lines per
    kind, and the next line logged says how many were suppressed (it was one line each)."""
    e, buf = target
    noisy = e.transports[0]._server.noisy  # type: ignore[attr-defined]
    noisy.every = 2.0  # (a short window, so the summary line comes within the test)
    with caplog.at_level(logging.INFO, logger=tcp_server.__name__):
        t0 = time.monotonic()
        for i in range(1000):
            if i % 2:
                s, verdict = connect(e, version=wire.VERSION + 1)
                assert verdict == wire.VERDICT_BAD_VERSION
            else:
                s, verdict = connect(e)
                s.sendall(b"GET / HTTP/1.1\r\n\r\n" + bytes(wire.REQ.size))
                assert response(s)[0] == wire.ST_PROTOCOL
            assert closed(s)
            s.close()
        burst = time.monotonic() - t0 < noisy.every  # all in one window (a fast machine)
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) <= 40, len(lines)  # (was 1,000)
        deadline = time.monotonic() + 30
        while not any("suppressed" in m for m in lines) and time.monotonic() < deadline:
            s, _ = connect(e, version=wire.VERSION + 1)  # one more, after the window
            closed(s)
            s.close()
            lines = [r.getMessage() for r in caplog.records]
            time.sleep(0.1)
    summary = [m for m in lines if "suppressed" in m]
    assert summary, lines
    if burst:
        assert any(int(m.rsplit("suppressed ", 1)[1].split()[0]) >= 400 for m in summary), summary
    still_serves(e, buf)
