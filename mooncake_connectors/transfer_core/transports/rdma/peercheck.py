"""``doctor --peer`` / ``doctor --serve-rdma``: one real RDMA loop between two hosts.

The serving side opens its NICs as the transport does (preflight.open_nics) and listens on TCP.
The checking side opens its own, sends its QP's address (QP number, PSN, GID, LID, active MTU)
and gets the server's back with a freshly registered buffer (address, rkey, length, SHA-256);
both connect their RC QPs through ``Nic.connect`` (the transport's, at the smaller MTU of the
two). Then the checker READs the server's buffer and compares digests, WRITEs its own bytes,
READs them back, has the server hash what landed, and times single small READs (the round
trip). Every socket wait and every completion wait has the session's deadline; the server
serves one session at a time, each bounded the same way. The TCP exchange carries no secret and
the server's buffer is fresh random bytes, dropped after the session: listen on a trusted
address (127.0.0.1 by default).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import socket
import statistics
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from ....errors import ConfigError, MooncakeConnectorsError, TransportBroken
from .preflight import gid_type_name, link_name, mtu_bytes, open_nics
from .transport import RdmaSettings
from .verbs import Nic, QpAddr, Verbs

CHUNK = 64 * 1024  # bytes per work request, the transport's default slice_size
DEPTH = 16  # work requests in flight
MAX_BYTES = 256 << 20  # the most a checker may have the server register
PINGS = 16
_LEN = struct.Struct("!I")
_MAX_FRAME = 64 * 1024
# What an error completion most often means on first contact (ibv_wc_status values).
_STATUS = {
    4: "local protection error (lkey or local access)",
    9: "remote invalid request (a message longer than the peer's path MTU, or bad opcode)",
    10: "remote access error (rkey, bounds or access rights)",
    12: "transport retry exceeded: the peer's NIC never answered (GID or LID unreachable, "
    "RoCE v1 across a routed fabric, a lossless traffic class the fabric drops, or a port down)",
    13: "RNR retry exceeded (the peer's QP is not ready)",
}


class Hello(msgspec.Struct, frozen=True):
    nic: str
    link_layer: int
    qpn: int
    psn: int
    gid: str
    lid: int
    mtu: int
    size: int


class Offer(msgspec.Struct, frozen=True):
    nic: str
    qpn: int
    psn: int
    gid: str
    gid_index: int
    gid_type: str
    lid: int
    mtu: int
    addr: int
    rkey: int
    size: int
    sha: str
    error: str = ""


class Check(msgspec.Struct, frozen=True):
    sha: str


class Verdict(msgspec.Struct, frozen=True):
    ok: bool
    sha: str


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the deadline passed")
    return left


def _send(sock: socket.socket, msg: msgspec.Struct, deadline: float) -> None:
    body = msgspec.msgpack.encode(msg)
    sock.settimeout(_left(deadline))
    sock.sendall(_LEN.pack(len(body)) + body)


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        sock.settimeout(_left(deadline))
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        buf += chunk
    return bytes(buf)


def _recv(sock: socket.socket, kind: type[Any], deadline: float) -> Any:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size, deadline))
    if n > _MAX_FRAME:
        raise ConnectionError(f"a {n}-byte message: not an rdma doctor peer")
    try:
        return msgspec.msgpack.decode(_recv_exact(sock, n, deadline), type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ConnectionError(f"not an rdma doctor peer ({exc})") from None


class _Buffer:
    """``size`` bytes of host memory registered on ``nic`` for remote READ and WRITE."""

    def __init__(self, nic: Nic, size: int, fill: bool) -> None:
        self.raw = ctypes.create_string_buffer(os.urandom(size) if fill else b"", size)
        self.addr = ctypes.addressof(self.raw)
        self.mr = nic.reg_mr(self.addr, size, nic.verbs.REMOTE_ACCESS)
        self.size = size

    def sha(self) -> str:
        return hashlib.sha256(ctypes.string_at(self.addr, self.size)).hexdigest()


def _run(nic: Nic, qp: Any, ops: list[tuple[bool, int, int, int]], lkey: int, rkey: int,
         deadline: float) -> None:  # fmt: skip
    """Post ``ops`` (write?, local addr, remote addr, length), DEPTH at a time, each signaled,
    and wait for all their completions by ``deadline``; TransportBroken on an error one."""
    todo = list(reversed(ops))
    inflight = 0
    depth = max(1, min(DEPTH, nic.max_qp_wr, nic.cq_size))
    while todo or inflight:
        while todo and inflight < depth:
            write, laddr, raddr, n = todo.pop()
            nic.post(qp, len(todo) + 1, write, laddr, n, lkey, raddr, rkey, True)
            inflight += 1
        for c in nic.poll(DEPTH):
            inflight -= 1
            if not c.ok:
                what = _STATUS.get(c.status, "see ibv_wc_status_str")
                raise TransportBroken(
                    f"an RDMA {'WRITE' if ops[0][0] else 'READ'} on {nic.name} completed with "
                    f"status {c.status}: {what}"
                )
        if inflight and time.monotonic() >= deadline:
            raise TransportBroken(f"no completion on {nic.name} by the deadline")


def _chunks(write: bool, laddr: int, raddr: int, size: int) -> list[tuple[bool, int, int, int]]:
    return [(write, laddr + o, raddr + o, min(CHUNK, size - o)) for o in range(0, size, CHUNK)]


@dataclass
class PeerResult:
    local_nic: str
    local_gid: str
    local_gid_index: int
    local_gid_type: str
    local_mtu: int  # bytes, as every size here
    peer: str
    peer_nic: str
    peer_gid: str
    peer_gid_index: int
    peer_gid_type: str
    peer_mtu: int
    mtu: int  # the path MTU both QPs use: the smaller
    link_layer: str
    bytes_verified: int
    rtt_us_min: float
    rtt_us_median: float


def check_peer(
    host: str, port: int, st: RdmaSettings, size: int = 1 << 20, timeout: float = 10.0
) -> PeerResult:
    """The loop to ``host:port`` (a ``doctor --serve-rdma``), done by ``timeout`` seconds;
    ConfigError when no NIC here is usable, TransportBroken when the loop fails."""
    deadline = time.monotonic() + timeout
    size = max(1, min(size, MAX_BYTES))
    opened, skipped = open_nics(Verbs(st.verbs), st)
    if not opened:
        why = "; ".join(f"{s.name}: {s.why}" for s in skipped)
        raise ConfigError(f"no usable RDMA device here: {why}")
    nic, qp, buf = opened[0], None, None
    where = f"{host}:{port}"
    try:
        qp = nic.create_qp(DEPTH)
        psn = int.from_bytes(os.urandom(3), "little")
        buf = _Buffer(nic, 2 * size, fill=True)
        hello = Hello(nic.name, nic.link_layer, int(qp.qp_num), psn, nic.gid, nic.lid, nic.mtu,
                      size)  # fmt: skip
        try:
            sock = socket.create_connection((host, port), timeout=_left(deadline))
        except OSError as exc:
            raise TransportBroken(
                f"rdma doctor peer {where} unreachable: {exc} (is `mooncake-connectors doctor "
                "--serve-rdma` running there, on that address?)"
            ) from None
        with sock:
            try:
                offer, verified, rtts = _loop(sock, nic, qp, psn, buf, hello, deadline)
            except (OSError, TimeoutError, ConnectionError) as exc:
                late = time.monotonic() >= deadline
                raise TransportBroken(
                    f"rdma doctor peer {where}: "
                    f"{f'no answer within {timeout:g}s' if late else 'the exchange failed'}: {exc}"
                ) from None
        return PeerResult(
            nic.name, nic.gid, nic.gid_index, gid_type_name(nic), mtu_bytes(nic.mtu), where,
            offer.nic, offer.gid, offer.gid_index, offer.gid_type, mtu_bytes(offer.mtu),
            mtu_bytes(min(nic.mtu, offer.mtu)), link_name(nic.link_layer), verified,
            round(min(rtts), 1), round(statistics.median(rtts), 1),
        )  # fmt: skip
    finally:
        if qp is not None:
            nic.destroy(qp)
        if buf is not None:
            nic.destroy(buf.mr)
        for n in opened:
            n.close()


def _loop(sock: socket.socket, nic: Nic, qp: Any, psn: int, buf: _Buffer, hello: Hello,
          deadline: float) -> tuple[Offer, int, list[float]]:  # fmt: skip
    size = hello.size
    _send(sock, hello, deadline)
    offer: Offer = _recv(sock, Offer, deadline)
    if offer.error:
        raise TransportBroken(f"the peer refused: {offer.error}")
    if offer.size != size:
        raise TransportBroken(f"the peer offered {offer.size} bytes, not {size}")
    nic.connect(qp, QpAddr(offer.qpn, offer.psn, offer.gid, offer.lid, offer.mtu), psn)
    lkey, src, dst = int(buf.mr.lkey), buf.addr, buf.addr + size
    _run(nic, qp, _chunks(False, dst, offer.addr, size), lkey, offer.rkey, deadline)
    if hashlib.sha256(ctypes.string_at(dst, size)).hexdigest() != offer.sha:
        raise TransportBroken("the bytes READ from the peer differ from what it holds")
    ctypes.memset(dst, 0, size)
    _run(nic, qp, _chunks(True, src, offer.addr, size), lkey, offer.rkey, deadline)
    _run(nic, qp, _chunks(False, dst, offer.addr, size), lkey, offer.rkey, deadline)
    if ctypes.string_at(dst, size) != ctypes.string_at(src, size):
        raise TransportBroken("the bytes READ back differ from the bytes WRITTEN")
    want = hashlib.sha256(ctypes.string_at(src, size)).hexdigest()
    _send(sock, Check(want), deadline)
    verdict: Verdict = _recv(sock, Verdict, deadline)
    if not verdict.ok:
        raise TransportBroken("the peer holds other bytes than the ones WRITTEN to it")
    rtts = []
    for _ in range(PINGS):
        t0 = time.perf_counter()
        _run(nic, qp, [(False, dst, offer.addr, 8)], lkey, offer.rkey, deadline)
        rtts.append((time.perf_counter() - t0) * 1e6)
    return offer, 3 * size, rtts


class PeerServer:
    """The serving side: its NICs opened at construction (ConfigError when none is usable),
    a TCP listener, one session at a time, each bounded by ``timeout`` seconds."""

    def __init__(self, st: RdmaSettings, host: str = "127.0.0.1", port: int = 0,
                 timeout: float = 10.0) -> None:  # fmt: skip
        self.timeout = timeout
        self.nics, self.skipped = open_nics(Verbs(st.verbs), st)
        if not self.nics:
            why = "; ".join(f"{s.name}: {s.why}" for s in self.skipped)
            raise ConfigError(f"no usable RDMA device here: {why}")
        self.sock = socket.create_server((host, port))
        self.sock.settimeout(0.5)
        self.host, self.port = self.sock.getsockname()[:2]
        self.stop = threading.Event()

    def serve(self) -> None:
        """Serve until ``stop`` is set."""
        try:
            while not self.stop.is_set():
                try:
                    conn, _ = self.sock.accept()
                except TimeoutError:
                    continue
                with (
                    conn,
                    contextlib.suppress(
                        OSError, TimeoutError, ConnectionError, MooncakeConnectorsError
                    ),
                ):
                    self._session(conn, time.monotonic() + self.timeout)
        finally:
            self.close()

    def close(self) -> None:
        self.stop.set()
        with contextlib.suppress(OSError):
            self.sock.close()
        for n in self.nics:
            n.close()
        self.nics = []

    def _session(self, conn: socket.socket, deadline: float) -> None:
        hello: Hello = _recv(conn, Hello, deadline)
        same = [n for n in self.nics if n.link_layer == hello.link_layer]
        nic = (same or self.nics)[0]
        if not 1 <= hello.size <= MAX_BYTES:
            _send(conn, _refusal(f"size {hello.size} outside 1..{MAX_BYTES}"), deadline)
            return
        qp: Any = None
        buf: _Buffer | None = None
        try:
            try:
                qp = nic.create_qp(DEPTH)
                buf = _Buffer(nic, hello.size, fill=True)
                psn = int.from_bytes(os.urandom(3), "little")
                peer = QpAddr(hello.qpn, hello.psn, hello.gid, hello.lid, hello.mtu)
                nic.connect(qp, peer, psn)
            except MooncakeConnectorsError as exc:
                _send(conn, _refusal(exc.message), deadline)
                return
            offer = Offer(nic.name, int(qp.qp_num), psn, nic.gid, nic.gid_index,
                          gid_type_name(nic), nic.lid, nic.mtu, buf.addr, int(buf.mr.rkey),
                          buf.size, buf.sha())  # fmt: skip
            _send(conn, offer, deadline)
            check: Check = _recv(conn, Check, deadline)
            sha = buf.sha()
            _send(conn, Verdict(sha == check.sha, sha), deadline)
            # the checker's round-trip READs come after the verdict: wait for it to hang up
            with contextlib.suppress(OSError, TimeoutError, ConnectionError):
                _recv_exact(conn, 1, deadline)
        finally:
            if qp is not None:
                nic.destroy(qp)
            if buf is not None:
                nic.destroy(buf.mr)


def _refusal(why: str) -> Offer:
    return Offer("", 0, 0, "", 0, "", 0, 0, 0, 0, 0, "", error=why)


__all__ = ["PeerResult", "PeerServer", "check_peer"]
