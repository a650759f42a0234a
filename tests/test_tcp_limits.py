"""The tcp transport's target against resource exhaustion and slow clients: it accepts again
after EMFILE, and closes a connection whose handshake or request trickles in, while a
well-behaved client is served throughout."""

from __future__ import annotations

import hashlib
import os
import select
import socket
import time
from collections.abc import Iterator

import numpy as np
import pytest
from helpers import Peer, wait_until

from mooncake_connectors.config import EngineConfig
from mooncake_connectors.transfer_core import TransferEngine
from mooncake_connectors.transfer_core.metadata.http import MetadataHTTPServer
from mooncake_connectors.transfer_core.transports import wire

FRAME_TIMEOUT = 0.5


@pytest.fixture
def target() -> Iterator[tuple[TransferEngine, np.ndarray]]:
    cfg = EngineConfig(
        metadata="memory://limits",
        transports=("tcp",),
        frame_timeout=FRAME_TIMEOUT,
        connect_timeout=1.0,
    )
    e = TransferEngine(cfg).start()
    buf = np.arange(1 << 16, dtype=np.uint8)
    e.register(buf)
    yield e, buf
    e.close()


def address(e: TransferEngine) -> tuple[str, int]:
    host, port = e.segment_name.rsplit(":", 1)
    return host, int(port)


def handshake(s: socket.socket) -> None:
    hello = bytearray(wire.HELLO.size)
    wire.recv_exact(s, memoryview(hello))
    nonce = wire.HELLO.unpack(hello)[4]
    ours = bytes(wire.NONCE)
    s.sendall(
        wire.AUTH.pack(wire.MAGIC, wire.VERSION, 0, wire.initiator_proof(None, nonce, ours), ours)
    )
    verdict = bytearray(wire.VERDICT.size)
    wire.recv_exact(s, memoryview(verdict))
    assert wire.VERDICT.unpack(verdict)[1] == wire.VERDICT_OK


def trickle(s: socket.socket, data: bytes, gap: float) -> int:
    """Send ``data`` a byte every ``gap`` seconds until the peer closes; returns the bytes sent
    by then (len(data) when it never closed)."""
    for i in range(len(data)):
        ready, _, _ = select.select([s], [], [], gap)
        if ready:
            try:
                if s.recv(65536) == b"":
                    return i
            except ConnectionResetError:
                return i
            continue  # an answer (an error frame): the close follows
        try:
            s.send(data[i : i + 1])
        except (BrokenPipeError, ConnectionResetError):
            return i
    return len(data)


def served(e: TransferEngine, buf: np.ndarray) -> None:
    c = TransferEngine(EngineConfig(metadata="memory://limits", transports=("tcp",))).start()
    try:
        dst = np.zeros(256, dtype=np.uint8)
        c.register(dst)
        c.read(e.segment_name, dst.ctypes.data, buf.ctypes.data + 100, 256, timeout=5)
        assert np.array_equal(dst, buf[100:356])
    finally:
        c.close()


def test_slow_request_header_is_closed_within_the_frame_deadline(
    target: tuple[TransferEngine, np.ndarray],
) -> None:
    e, buf = target
    s = socket.create_connection(address(e), timeout=5)
    try:
        handshake(s)
        req = wire.REQ.pack(wire.REQ_MAGIC, wire.OP_READ, 0, 0, 1, buf.ctypes.data, 16)
        sent = trickle(s, req, gap=0.1)  # all of it would take 3.2 s
        assert sent < len(req), "a request trickling in was never cut off"
        served(e, buf)
    finally:
        s.close()


def test_slow_write_payload_is_closed_within_the_frame_deadline(
    target: tuple[TransferEngine, np.ndarray],
) -> None:
    e, buf = target
    s = socket.create_connection(address(e), timeout=5)
    try:
        handshake(s)
        s.sendall(wire.REQ.pack(wire.REQ_MAGIC, wire.OP_WRITE, 0, 0, 1, buf.ctypes.data, 64))
        sent = trickle(s, bytes(64), gap=0.1)
        assert sent < 64, "a payload trickling in was never cut off"
        served(e, buf)
    finally:
        s.close()


def test_slow_handshake_is_closed_within_the_connect_timeout(
    target: tuple[TransferEngine, np.ndarray],
) -> None:
    e, buf = target
    s = socket.create_connection(address(e), timeout=5)
    try:
        hello = bytearray(wire.HELLO.size)
        wire.recv_exact(s, memoryview(hello))
        nonce, ours = wire.HELLO.unpack(hello)[4], bytes(wire.NONCE)
        auth = wire.AUTH.pack(
            wire.MAGIC, wire.VERSION, 0, wire.initiator_proof(None, nonce, ours), ours
        )
        sent = trickle(s, auth, gap=0.1)  # 4 s in all; connect_timeout is 1 s
        assert sent < len(auth), "a handshake trickling in was never cut off"
        served(e, buf)
    finally:
        s.close()


def test_target_accepts_again_after_running_out_of_descriptors(
    meta_server: MetadataHTTPServer,
) -> None:
    peer = Peer(nofile=64, metadata=meta_server.url, transports=["tcp"])
    flood: list[socket.socket] = []
    c = TransferEngine(EngineConfig(metadata=meta_server.url, transports=("tcp",))).start()
    try:
        remote = peer.call("alloc", kind="numpy", size=4096, seed=3)["addr"]
        host, port = peer.segment.rsplit(":", 1)
        # more connections than the peer has descriptors: its accept() fails with EMFILE
        for _ in range(100):
            flood.append(socket.create_connection((host, int(port)), timeout=5))
        wait_until(
            lambda: len(os.listdir(f"/proc/{peer.pid}/fd")) >= 64,
            10,
            "the peer to run out of descriptors",
        )
        for s in flood:
            s.close()
        flood.clear()
        dst = np.zeros(4096, dtype=np.uint8)
        c.register(dst)
        deadline = time.monotonic() + 20
        while True:  # the peer's own handshake deadline frees its descriptors in time
            try:
                c.read(peer.segment, dst.ctypes.data, remote, 4096, timeout=3)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
        digest = peer.call("digest", addr=remote, length=4096)["sha"]
        assert hashlib.sha256(dst.tobytes()).hexdigest() == digest
    finally:
        for s in flood:
            s.close()
        c.close()
        peer.close()
