"""What the fuzzer sends to each port: structured frames (our framing, hostile fields) and raw
random or truncated byte streams, from a seeded ``random.Random`` so a failing run replays.

Each port is a :class:`Port`: ``open`` gives a connected socket (after a correct handshake on
some connections, so that hostile frames reach the request parsers, not only the handshake),
``frame`` the next bytes to send, and ``probe`` is a well-behaved client's exchange that must
succeed every time the harness asks. The integration tests drive the same ports with
hypothesis-drawn fields through :meth:`Port.structured`.
"""

from __future__ import annotations

import http.client
import random
import socket
from typing import Any
from urllib.parse import urlsplit

import msgspec

from ..transfer_core.transports import wire

INTS = [0, 1, -1, 7, 255, 4096, 65535, 1 << 31, (1 << 32) - 1, 1 << 40, (1 << 63) - 1, 1 << 63,
        (1 << 64) - 1, -(1 << 63)]  # fmt: skip
TEXT = ["", "a", "k" * 5000, "\u0000", "\ud7ff\ue000", "é/../..", "\U0001f600" * 100, "%00%ff"]


def hostile_int(rng: random.Random) -> int:
    return rng.choice(INTS) if rng.random() < 0.6 else rng.randrange(-(1 << 20), 1 << 40)


def hostile_value(rng: random.Random, depth: int = 0) -> Any:
    r = rng.random()
    if r < 0.35:
        return hostile_int(rng)
    if r < 0.55:
        return rng.choice(TEXT) if rng.random() < 0.7 else rng.randbytes(rng.randrange(64)).hex()
    if r < 0.65:
        return rng.randbytes(rng.choice([0, 1, 16, 32, 64, 65, 300]))
    if r < 0.72:
        return rng.choice([None, True, False, float("nan"), 1e308, -0.0])
    if depth < 2:
        return [hostile_value(rng, depth + 1) for _ in range(rng.randrange(6))]
    return {}


def raw_stream(rng: random.Random) -> bytes:
    return rng.randbytes(rng.choice([1, 3, 8, 31, 64, 500, 4096]))


def truncated(data: bytes, rng: random.Random) -> bytes:
    return data[: rng.randrange(len(data) + 1)] if data else data


def addr_port(text: str) -> tuple[str, int]:
    host, port = text.rsplit(":", 1)
    return host.strip("[]"), int(port)


def drain(sock: socket.socket, limit: int = 1 << 20) -> bytes:
    """Whatever the server has sent so far (without waiting), so it never blocks on us."""
    got = bytearray()
    timeout = sock.gettimeout()
    sock.setblocking(False)  # with a timeout set, Python's recv would wait for data first
    try:
        while len(got) < limit:
            try:
                chunk = sock.recv(65536)
            except OSError:  # nothing yet (BlockingIOError), or the server hung up
                break
            if not chunk:
                break
            got += chunk
    finally:
        sock.settimeout(timeout)
    return bytes(got)


class Port:
    name = ""

    def __init__(self, info: dict[str, Any]) -> None:
        self.info = info
        self.token: str = info["token"]

    def address(self) -> tuple[str, int]:
        raise NotImplementedError

    def open(self, rng: random.Random) -> socket.socket:
        return socket.create_connection(self.address(), timeout=2.0)

    def structured(self, rng: random.Random) -> bytes:
        raise NotImplementedError

    def frame(self, rng: random.Random) -> bytes:
        r = rng.random()
        if r < 0.7:
            return self.structured(rng)
        if r < 0.85:
            return truncated(self.structured(rng), rng)
        return raw_stream(rng)

    def probe(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class TePort(Port):
    """The transfer engine's tcp target: handshake, then pipelined READ/WRITE/PING requests."""

    name = "te"

    def __init__(self, info: dict[str, Any]) -> None:
        super().__init__(info)
        from ..config import EngineConfig
        from ..transfer_core import TransferEngine

        self.client = TransferEngine(
            EngineConfig(
                host="127.0.0.1",
                metadata="p2p",
                transports=("tcp",),
                auth_token=self.token,
                timeout=10.0,
            )
        ).start()
        import numpy as np

        self.dst = np.zeros(info["probe_len"], dtype=np.uint8)
        self.client.register(self.dst)
        from .fuzz_target import probe_pattern

        self.expect = probe_pattern(info["probe_len"])

    def address(self) -> tuple[str, int]:
        return addr_port(self.info["te"])

    def open(self, rng: random.Random) -> socket.socket:
        s = super().open(rng)
        if rng.random() < 0.15:
            return s  # hostile bytes in place of the handshake
        w = wire
        hello = bytearray(w.HELLO.size)
        w.recv_exact(s, memoryview(hello))
        nonce = w.HELLO.unpack(hello)[4]
        ours = rng.randbytes(w.NONCE)
        token = self.token if rng.random() < 0.9 else "wrong-" + self.token
        s.sendall(w.AUTH.pack(w.MAGIC, w.VERSION, 0, w.initiator_proof(token, nonce, ours), ours))
        return s

    def structured(self, rng: random.Random) -> bytes:
        w = wire
        base, size = self.info["region"], self.info["region_len"]
        op = rng.choice([w.OP_READ, w.OP_WRITE, w.OP_PING, rng.randrange(256)])
        edge = rng.choice([0, 1, size - 1, size, size + 1, size - 64, -1, -4096, size + 4096])
        addr = (base + edge) % (1 << 64) if rng.random() < 0.7 else hostile_int(rng) % (1 << 64)
        length = rng.choice([0, 1, 64, size, size + 1, w.MAX_PAYLOAD + 1, (1 << 64) - 1])
        if rng.random() < 0.5:
            length = rng.randrange(1, 512)
        magic = w.REQ_MAGIC if rng.random() < 0.9 else rng.randrange(1 << 32)
        head = w.REQ.pack(magic, op, rng.randrange(256), rng.randrange(1 << 16),
                          rng.randrange(1 << 64), addr, length)  # fmt: skip
        if op == w.OP_WRITE and length < 4096:
            # the payload, whole or cut short: the target must never write outside the region
            return head + rng.randbytes(length if rng.random() < 0.8 else rng.randrange(length + 1))
        return head

    def probe(self) -> None:
        self.dst[:] = 0
        self.client.read(
            self.info["segment"], self.dst.ctypes.data, self.info["probe"], self.dst.size,
            timeout=10.0,
        )  # fmt: skip
        if bytes(self.dst) != self.expect:
            raise AssertionError("te probe read wrong bytes")

    def close(self) -> None:
        self.client.close()


class StorePort(Port):
    """The store's frame servers (master, a server's load endpoint): msgpack tagged arrays."""

    name = "master"
    key = "master"
    TAGS = ["hello", "mount", "unmount", "hb", "put", "end", "putr", "get", "exists", "rm",
            "rmall", "report", "spilled", "promoted", "lost", "stats", "auth?", "auth", "load",
            "release", "ok", "err", "zz"]  # fmt: skip

    def address(self) -> tuple[str, int]:
        return addr_port(self.info[self.key])

    def open(self, rng: random.Random) -> socket.socket:
        from ..store.protocol import Auth, AuthStart, Challenge, auth_mac, frame

        s = super().open(rng)
        if rng.random() < 0.2:
            return s
        s.sendall(frame(AuthStart(), 1))
        reply = self._reply(s)
        if isinstance(reply, Challenge) and reply.nonce:
            token = self.token if rng.random() < 0.9 else "wrong-token-123"
            s.sendall(frame(Auth(auth_mac(token, reply.nonce)), 2))
            self._reply(s)
        return s

    def _reply(self, s: socket.socket) -> Any:
        from ..store.protocol import HEADER, PREFIX, reply_decoder

        head = self._exact(s, PREFIX.size)
        (n,) = PREFIX.unpack(head)
        body = self._exact(s, n)
        return reply_decoder.decode(body[HEADER.size :])

    @staticmethod
    def _exact(s: socket.socket, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = s.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("closed during the handshake")
            buf += chunk
        return bytes(buf)

    def structured(self, rng: random.Random) -> bytes:
        from ..store.protocol import HEADER, MAGIC, PREFIX, PROTOCOL_VERSION

        tag = rng.choice(self.TAGS)
        fields = [hostile_value(rng) for _ in range(rng.randrange(8))]
        try:
            body = msgspec.msgpack.encode([tag, *fields])
        except (OverflowError, TypeError):
            body = rng.randbytes(16)
        version = PROTOCOL_VERSION if rng.random() < 0.9 else rng.randrange(256)
        magic = MAGIC if rng.random() < 0.95 else rng.randbytes(2)
        n = HEADER.size + len(body)
        if rng.random() < 0.05:
            n = rng.choice([0, 1, HEADER.size - 1, (1 << 26) + 1, (1 << 32) - 1])
        head = HEADER.pack(magic, version, rng.randrange(256), rng.randrange(1 << 64))
        return PREFIX.pack(n) + head + body

    def probe(self) -> None:
        from ..store.protocol import Err, Exists
        from ..store.rpc import Channel

        ch = Channel(self.info["master"], 10.0, self.token)
        try:
            reply = ch.call(Exists(["fuzz-probe"]), 10.0)
        finally:
            ch.close()
        if isinstance(reply, Err):
            raise AssertionError(f"master probe: {reply}")


class LoadPort(StorePort):
    name = "load"
    key = "load"

    def probe(self) -> None:
        from ..store.protocol import Err, Release
        from ..store.rpc import Channel

        super().probe()  # the master it reports to
        ch = Channel(self.info["load"], 10.0, self.token)
        try:
            reply = ch.call(Release(123456789), 10.0)  # an unknown loan: a clear answer
        finally:
            ch.close()
        if not isinstance(reply, Err) and type(reply).__name__ != "Ok":
            raise AssertionError(f"load probe: {reply}")


class HttpPort(Port):
    """An HTTP listener (metadata server, p2p endpoint, proxy): hostile request lines,
    headers, lengths and bodies."""

    name = "metadata"
    key = "metadata"
    METHODS = ["GET", "PUT", "DELETE", "POST", "HEAD", "OPTIONS", "PATCH", "BREW", "G\x00T", ""]
    PATHS = ["/metadata", "/metadata?key=probe", "/metadata?key=", "/health", "/v1/completions",
             "/v1/chat/completions", "/conductor/stats", "/" + "a" * 9000, "/%ff%00?key=%ff",
             "*", "http://x/y", "/metadata?key=" + "\U0001f600" * 50]  # fmt: skip

    def address(self) -> tuple[str, int]:
        u = urlsplit(self.info[self.key])
        assert u.hostname is not None and u.port is not None
        return u.hostname, u.port

    def structured(self, rng: random.Random) -> bytes:
        method = rng.choice(self.METHODS)
        path = rng.choice(self.PATHS)
        version = rng.choice(["HTTP/1.1", "HTTP/1.0", "HTTP/9.9", "", "HTTP/1.1 x"])
        body = rng.choice([b"", b"{}", b'{"prompt": "x", "max_tokens": 1}', rng.randbytes(200)])
        headers = [f"Host: {self.address()[0]}"]
        clen = rng.choice([str(len(body)), "-1", "1" * 30, "0x10", "", str(1 << 40), "5, 7"])
        headers.append(f"Content-Length: {clen}")
        if rng.random() < 0.3:
            headers.append(f"Authorization: Bearer {rng.choice([self.token, 'x', ''])}")
        if rng.random() < 0.1:
            headers.append("Transfer-Encoding: chunked")
            body = rng.choice([b"ffffffffffff\r\nab", b"zz\r\n", b"0\r\n\r\n"])
        if rng.random() < 0.05:
            headers.append("X-" + "h" * 70000 + ": v")
        if rng.random() < 0.05:
            headers += [f"X-{i}: {i}" for i in range(200)]
        head = f"{method} {path} {version}\r\n" + "\r\n".join(headers) + "\r\n\r\n"
        return head.encode("utf-8", "surrogatepass") + body

    def probe(self) -> None:
        host, port = self.address()
        path = urlsplit(self.info[self.key]).path or "/"
        conn = http.client.HTTPConnection(host, port, timeout=10)
        try:
            conn.request("GET", self.probe_path(path), headers=self.probe_headers())
            r = conn.getresponse()
            r.read()
        finally:
            conn.close()
        if r.status >= 500:
            raise AssertionError(f"{self.name} probe: HTTP {r.status}")

    def probe_path(self, path: str) -> str:
        return f"{path}?key=probe"

    def probe_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}


class P2pPort(HttpPort):
    name = "p2p"
    key = "p2p"


class ProxyPort(HttpPort):
    name = "proxy"
    key = "proxy"

    def probe_path(self, path: str) -> str:
        return "/health"


# The zmq ports build on Port, so they are imported once it exists.
from .fuzz_zmq import GrantPort, SidePort  # noqa: E402

PORTS: dict[str, tuple[str, list[type[Port]]]] = {
    # target process kind -> the ports it serves
    "te": ("te", [TePort, P2pPort]),
    "master": ("master", [StorePort]),
    "load": ("load", [LoadPort]),
    "metadata": ("metadata", [HttpPort]),
    "side": ("side", [SidePort]),
    "grant": ("grant", [GrantPort]),
    "proxy": ("proxy", [ProxyPort]),
}
