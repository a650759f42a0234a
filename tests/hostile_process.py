"""A hostile local process, for integration tests: it does what an attacker without the right
token could try, and prints what happened as JSON lines.

    hostile_process.py data DESCRIPTOR_HEX TOKEN|-      read, then overwrite, a segment over tcp
    hostile_process.py forge METADATA_URL NAME TOKEN|-  listen as a fake target, publish a forged
                                                        descriptor naming it, then (after a line on
                                                        stdin) report what reached the listener
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import urllib.parse

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

from mooncake_connectors.config import EngineConfig
from mooncake_connectors.errors import MooncakeConnectorsError
from mooncake_connectors.transfer_core import TransferEngine
from mooncake_connectors.transfer_core.descriptor import (
    RegionDesc,
    SegmentDesc,
    decode_segment,
    encode_segment,
)
from mooncake_connectors.transfer_core.metadata.base import SEGMENT_PREFIX
from mooncake_connectors.transfer_core.metadata.http import HttpClient
from mooncake_connectors.transfer_core.metadata.memory import MemoryMetadata
from mooncake_connectors.transfer_core.transports import wire

FORGED_ADDR = 0x7F0000000000
FORGED_SIZE = 1 << 20


def say(**kw: object) -> None:
    print(json.dumps(kw), flush=True)


def outcome(fn: object) -> str:
    try:
        fn()  # type: ignore[operator]
    except MooncakeConnectorsError as exc:
        return type(exc).__name__
    return "ok"


def data(desc_hex: str, token: str | None) -> None:
    """Read the whole segment, then overwrite it, with a stolen descriptor and no right token."""
    desc = decode_segment(bytes.fromhex(desc_hex))
    MemoryMetadata("stolen").publish_segment(desc)
    region = desc.regions[0]
    e = TransferEngine(
        EngineConfig(metadata="memory://stolen", transports=("tcp",), auth_token=token, timeout=5)
    ).start()
    buf = np.full(region.length, 0xEE, dtype=np.uint8)
    e.register(buf)
    read = outcome(lambda: e.read(desc.name, buf.ctypes.data, region.addr, region.length))
    leaked = int(np.count_nonzero(buf != 0xEE))
    write = outcome(lambda: e.write(desc.name, buf.ctypes.data, region.addr, region.length))
    e.close()
    say(read=read, write=write, leaked=leaked)


class Listener:
    """Plays the target's side of the handshake without the token, then counts request bytes."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.handshakes = 0
        self.received = 0
        self.active = 0
        self.cv = threading.Condition()
        threading.Thread(target=self._run, daemon=True).start()

    def settle(self, timeout: float) -> None:
        """Wait (bounded) until every accepted connection was read to its end."""
        with self.cv:
            self.cv.wait_for(lambda: self.active == 0, timeout)

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self.cv:
                self.active += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            self._handshake_then_count(conn)
        finally:
            with self.cv:
                self.active -= 1
                self.cv.notify_all()

    def _handshake_then_count(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(10)
            try:
                hello = wire.HELLO.pack(wire.MAGIC, wire.VERSION, wire.FLAG_AUTH, 0, os.urandom(16))
                conn.sendall(hello)
                wire.recv_exact(conn, memoryview(bytearray(wire.AUTH.size)))
                self.handshakes += 1
                conn.sendall(wire.VERDICT.pack(wire.MAGIC, wire.VERDICT_OK, 0, os.urandom(32)))
                while data := conn.recv(1 << 16):
                    self.received += len(data)
            except (OSError, ConnectionError):
                return


def forge(url: str, name: str, token: str | None) -> None:
    listener = Listener()
    desc = SegmentDesc(
        name=name,
        host_id="another-host",  # keeps the victim off shm: this is about the tcp handshake
        pid=1,
        endpoints={"tcp": f"127.0.0.1:{listener.port}"},
        regions=[RegionDesc(addr=FORGED_ADDR, length=FORGED_SIZE)],
        auth=True,
    )
    client = HttpClient(url, timeout=5, token=token)
    status, _ = client.request("PUT", {"key": SEGMENT_PREFIX + name}, encode_segment(desc))
    client.close()
    say(port=listener.port, put_status=status)
    sys.stdin.readline()  # the victim has finished
    listener.settle(10)
    say(handshakes=listener.handshakes, received=listener.received)


def main() -> None:
    mode, *args = sys.argv[1:]
    token = None if args[-1] == "-" else args[-1]
    if mode == "data":
        data(args[0], token)
    elif mode == "forge":
        forge(urllib.parse.unquote(args[0]), args[1], token)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
