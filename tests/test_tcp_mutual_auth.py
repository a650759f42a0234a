"""The tcp handshake authenticates both ends: an initiator holding a token moves no byte to a
target that cannot prove the same token (a forged descriptor's listener), and peers of the
previous wire version get a clear version error instead of a hang."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from mooncake_connectors.config import EngineConfig
from mooncake_connectors.errors import AuthenticationError, ProtocolError
from mooncake_connectors.transfer_core import TransferEngine
from mooncake_connectors.transfer_core.descriptor import RegionDesc, SegmentDesc
from mooncake_connectors.transfer_core.metadata.memory import MemoryMetadata
from mooncake_connectors.transfer_core.transports import wire

TOKEN = "s3cret-token"
FORGED_ADDR = 0x7F0000000000
SIZE = 1 << 20


class FakeTarget:
    """A listener that plays the target's side of the handshake without the token (as an
    attacker would) and counts every request byte that reaches it afterwards."""

    def __init__(self, *, flags: int, version: int = wire.VERSION, proof: bytes = b"") -> None:
        self.flags = flags
        self.version = version
        self.proof = proof or os.urandom(32)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.received = 0
        self.handshakes = 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.sock.settimeout(10)
        deadline = time.monotonic() + 10
        try:
            while time.monotonic() < deadline and self.handshakes < 8:
                conn, _ = self.sock.accept()
                with conn:
                    self._serve(conn, deadline)
        except OSError:
            pass
        finally:
            self.done.set()

    def _serve(self, conn: socket.socket, deadline: float) -> None:
        conn.settimeout(max(deadline - time.monotonic(), 0.01))
        conn.sendall(wire.HELLO.pack(wire.MAGIC, self.version, self.flags, 0, os.urandom(16)))
        buf = bytearray(wire.AUTH.size)
        try:
            wire.recv_exact(conn, memoryview(buf))
        except (OSError, ConnectionError):
            return
        self.handshakes += 1
        conn.sendall(wire.VERDICT.pack(wire.MAGIC, wire.VERDICT_OK, 0, self.proof))
        while True:  # whatever comes now would be a request (and its payload)
            try:
                data = conn.recv(1 << 16)
            except OSError:
                return
            if not data:
                return
            self.received += len(data)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        self.sock.close()
        self.done.wait(15)


def forge(namespace: str, name: str, port: int) -> None:
    """Publish a descriptor naming the fake listener, as anyone with metadata access could."""
    MemoryMetadata(namespace).publish_segment(
        SegmentDesc(
            name=name,
            host_id="another-host",
            pid=1,
            endpoints={"tcp": f"127.0.0.1:{port}"},
            regions=[RegionDesc(addr=FORGED_ADDR, length=SIZE)],
            auth=True,
        )
    )


@pytest.fixture
def initiator() -> Iterator[tuple[TransferEngine, np.ndarray]]:
    e = TransferEngine(
        EngineConfig(metadata="memory://forged", transports=("tcp",), auth_token=TOKEN, timeout=5)
    ).start()
    buf = np.full(SIZE, 7, dtype=np.uint8)
    e.register(buf)
    yield e, buf
    e.close()


@pytest.mark.parametrize("flags", [wire.FLAG_AUTH, 0], ids=["wrong-proof", "asks-no-token"])
def test_a_target_that_cannot_prove_the_token_gets_no_bytes(
    initiator: tuple[TransferEngine, np.ndarray], flags: int
) -> None:
    e, buf = initiator
    fake = FakeTarget(flags=flags)
    forge("forged", f"evil-{flags}", fake.port)
    try:
        with pytest.raises(AuthenticationError):
            e.write(f"evil-{flags}", buf.ctypes.data, FORGED_ADDR, SIZE)
        with pytest.raises(AuthenticationError):
            e.read(f"evil-{flags}", buf.ctypes.data, FORGED_ADDR, SIZE)
        assert (buf == 7).all()  # nothing of the attacker's landed in our memory
    finally:
        fake.close()
    assert fake.received == 0


def test_a_real_target_without_the_token_gets_no_bytes(
    initiator: tuple[TransferEngine, np.ndarray],
) -> None:
    e, buf = initiator
    other = TransferEngine(EngineConfig(metadata="memory://forged", transports=("tcp",))).start()
    victim = np.full(SIZE, 3, dtype=np.uint8)
    other.register(victim)
    try:
        with pytest.raises(AuthenticationError, match="asks for no token"):
            e.write(other.segment_name, buf.ctypes.data, victim.ctypes.data, SIZE)
        with pytest.raises(AuthenticationError):
            e.read(other.segment_name, buf.ctypes.data, victim.ctypes.data, SIZE)
        assert (victim == 3).all() and (buf == 7).all()
    finally:
        other.close()


def test_both_ends_with_the_token_move_data(
    initiator: tuple[TransferEngine, np.ndarray],
) -> None:
    e, buf = initiator
    other = TransferEngine(
        EngineConfig(metadata="memory://forged", transports=("tcp",), auth_token=TOKEN)
    ).start()
    dst = np.zeros(SIZE, dtype=np.uint8)
    other.register(dst)
    try:
        e.write(other.segment_name, buf.ctypes.data, dst.ctypes.data, SIZE)
        assert (dst == 7).all()
    finally:
        other.close()


def test_a_previous_version_target_is_a_clear_protocol_error(
    initiator: tuple[TransferEngine, np.ndarray],
) -> None:
    e, buf = initiator
    fake = FakeTarget(flags=wire.FLAG_AUTH, version=1)
    forge("forged", "old", fake.port)
    try:
        with pytest.raises(ProtocolError, match="version 1"):
            e.read("old", buf.ctypes.data, FORGED_ADDR, 4096)
    finally:
        fake.close()
    assert fake.handshakes == 0 and fake.received == 0


def test_a_previous_version_initiator_gets_a_version_verdict() -> None:
    e = TransferEngine(
        EngineConfig(metadata="memory://old-client", transports=("tcp",), auth_token=TOKEN)
    ).start()
    try:
        host, port = e.segment_name.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as s:
            hello = bytearray(wire.HELLO.size)
            wire.recv_exact(s, memoryview(hello))
            assert wire.HELLO.unpack(hello)[1] == wire.VERSION
            s.sendall(wire.MAGIC + (1).to_bytes(2, "little") + bytes(34))  # version 1's AUTH
            verdict = bytearray(wire.AUTH_HEAD.size)  # status sits in the common 8-byte head
            wire.recv_exact(s, memoryview(verdict))
            assert wire.AUTH_HEAD.unpack(verdict)[1] == wire.VERDICT_BAD_VERSION
    finally:
        e.close()
