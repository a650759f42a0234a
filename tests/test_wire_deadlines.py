"""A peer that sends part of a frame and stops: the receive honours the caller's deadline
instead of starting a new socket timeout for every partial receive (real sockets)."""

from __future__ import annotations

import socket
import struct
import time

import pytest

from mooncake_connectors.transfer_core.transports import wire


def _bounded_pair(seconds: float) -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    tv = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    a.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    return a, b


def test_a_frame_that_stops_half_way_fails_at_the_deadline() -> None:
    a, b = _bounded_pair(0.6)
    deadline = time.monotonic() + 0.6

    def rest() -> None:
        if time.monotonic() >= deadline:
            raise TimeoutError("deadline passed")

    try:
        buf = bytearray(1000)
        # the sender delivers a little at a time, then nothing: every receive returns partial
        # data at its socket timeout; without the deadline check each starts a new one
        for _ in range(3):
            b.send(b"x" * 10)
        t0 = time.monotonic()
        with pytest.raises((TimeoutError, BlockingIOError)):
            wire.recv_exact(a, memoryview(buf), rest)
        assert time.monotonic() - t0 < 0.6 + 0.5
        assert buf[:30] == b"x" * 30
    finally:
        a.close()
        b.close()
