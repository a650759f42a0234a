"""The target side of the ``tcp`` transport: accept connections, check, serve.

One thread per connection reads requests in order, checks each against the live registered
regions (never trusting an address from the wire), and serves READ/WRITE straight from/into the
registered memory. Malformed frames get a protocol-error answer and the connection is closed;
access violations get an answer and the stream stays usable (a refused WRITE's payload is
drained). Every other connection is unaffected.

A request must arrive whole (header and WRITE payload) within ``frame_timeout`` plus its length
at ``MIN_RATE``, and an answer must be taken up by the peer as fast, else the connection is
closed: per-recv timeouts would let a peer trickling a byte at a time hold a thread forever.
An idle connection (no request started) stays open.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import cast

from ...errors import (
    AccessViolation,
    ConfigError,
    GpuError,
    MooncakeConnectorsError,
    TransferTimeout,
)
from ...netguard import MIN_RATE, AcceptBackoff, SiteLogs, listener_closed
from ...tls import server_context, wrap_server
from ...types import Access
from .. import cuda_driver
from ..memory import Region
from ..transport import TransportContext
from . import staging, wire  # staging: the type of the pool lent by the transport
from .fast import tcp as fast
from .tls_stream import TlsStream

log = logging.getLogger(__name__)

_WAITALL = socket.MSG_WAITALL
TLS_ENDPOINT = "tcp-tls"  # in a descriptor: the tcp endpoint speaks TLS ("mutual" or "server")
_READ = int(Access.READ)
_WRITE = int(Access.WRITE)


def _tick(frame_timeout: float) -> float:
    # how often a blocked recv/send returns to check its deadline
    return max(0.05, min(1.0, frame_timeout / 4))


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class TcpServer:
    """Accepts connections and serves READ/WRITE against the local registered regions.

    ``control`` answers OP_CONTROL messages (payload in, reply out; a MooncakeConnectorsError
    is sent back as a protocol error); with ``data=False`` READ/WRITE are refused, for a
    listener that carries another transport's control exchange only (on its own ``port``)."""

    def __init__(
        self,
        ctx: TransportContext,
        control: Callable[[bytes, str], bytes] | None = None,
        data: bool = True,
        port: int | None = None,
    ) -> None:
        self.ctx = ctx
        self.control = control
        self.data = data
        cfg = ctx.config
        tls = cfg.tls
        if tls is not None and tls.cert is None:
            raise ConfigError("the tcp transport listens: tls_ca needs tls_cert and tls_key too")
        self.tls_ctx = server_context(tls) if tls is not None else None
        self.tls_mutual = tls is not None and tls.mutual
        family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((cfg.host, cfg.port if port is None else port))
        self.sock.listen(128)
        self.port = self.sock.getsockname()[1]
        self.conns: set[socket.socket] = set()
        self.lock = threading.Lock()
        self.closed = False
        self.staging: staging.Staging | None = None  # set by the transport that owns us
        self.noisy = SiteLogs(log)  # what a peer sends: bounded lines, however much it sends
        threading.Thread(target=self._accept_loop, name="mc-tcp-accept", daemon=True).start()

    def _accept_loop(self) -> None:
        backoff = AcceptBackoff(f"tcp transport port {self.port}", log)
        while not self.closed:
            try:
                conn, peer = self.sock.accept()
            except OSError as exc:  # EMFILE and the like pass; only a closed listener ends this
                if self.closed or listener_closed(exc):
                    return
                time.sleep(backoff.failed(exc))
                continue
            backoff.succeeded()
            with self.lock:
                if self.closed:
                    conn.close()
                    return
                self.conns.add(conn)
            try:
                threading.Thread(
                    target=self._serve,
                    args=(conn, f"{peer[0]}:{peer[1]}"),
                    name="mc-tcp-serve",
                    daemon=True,
                ).start()
            except RuntimeError as exc:  # no thread to serve it: shed this one, go on
                with self.lock:
                    self.conns.discard(conn)
                conn.close()
                time.sleep(backoff.failed(OSError(str(exc))))

    def _handshake(self, conn: socket.socket, deadline: float) -> bool:
        # with mutual TLS the initiator's certificate already proved what the token would
        token = None if self.tls_mutual else self.ctx.config.auth_token
        nonce = os.urandom(16)
        conn.settimeout(max(0.001, deadline - time.monotonic()))
        conn.sendall(
            wire.HELLO.pack(wire.MAGIC, wire.VERSION, wire.FLAG_AUTH if token else 0, 0, nonce)
        )
        buf = bytearray(wire.AUTH.size)
        # Magic and version first: an older client's shorter AUTH must get an answer, not a hang.
        wire.recv_until(conn, memoryview(buf)[: wire.AUTH_HEAD.size], deadline)
        magic, version, _ = wire.AUTH_HEAD.unpack_from(buf)
        none = bytes(32)
        if magic != wire.MAGIC or version != wire.VERSION:
            conn.sendall(wire.VERDICT.pack(wire.MAGIC, wire.VERDICT_BAD_VERSION, 0, none))
            self.noisy("version").warning(
                "refused a client speaking version %s (magic %r)", version, magic
            )
            return False
        wire.recv_until(conn, memoryview(buf)[wire.AUTH_HEAD.size :], deadline)
        _, _, _, their_proof, their_nonce = wire.AUTH.unpack(buf)
        if token and not hmac.compare_digest(
            their_proof, wire.initiator_proof(token, nonce, their_nonce)
        ):
            conn.sendall(wire.VERDICT.pack(wire.MAGIC, wire.VERDICT_BAD_TOKEN, 0, none))
            self.noisy("token").warning("refused a client with a wrong token")
            return False
        ours = wire.target_proof(token, nonce, their_nonce)
        conn.sendall(wire.VERDICT.pack(wire.MAGIC, wire.VERDICT_OK, 0, ours))
        conn.settimeout(None)
        return True

    def _serve(self, conn: socket.socket, who: str) -> None:
        local = self.ctx.local
        hdr = bytearray(wire.REQ.size)
        hv = memoryview(hdr)
        scratch: bytearray | None = None
        # The last region served, reused while no register/unregister happened (epoch).
        last: Region | None = None
        last_epoch = -1
        lo = hi = rights = 0
        try:
            _tune(conn)
            # one deadline for the whole handshake, TLS and token alike
            deadline = time.monotonic() + self.ctx.config.connect_timeout
            if self.tls_ctx is not None:
                timeout = self.ctx.config.connect_timeout
                # wrapping detaches the plain socket: close() must find the TLS one to shut down
                plain = conn
                stream = TlsStream(wrap_server(self.tls_ctx, conn, timeout), mutual=self.tls_mutual)
                conn = cast(socket.socket, stream)  # the part of the socket API used here
                with self.lock:
                    self.conns.discard(plain)
                    self.conns.add(conn)
            if not self._handshake(conn, deadline):
                return
            hsize = wire.REQ.size
            frame_timeout = self.ctx.config.frame_timeout
            wire.set_io_tick(conn, _tick(frame_timeout))
            served = (wire.OP_READ, wire.OP_WRITE, wire.OP_PING) if self.data else (wire.OP_PING,)
            resp = wire.RESP
            # The compiled loop serves the requests that stay in the region served last (a
            # plain socket, host memory) and hands anything else back with its header.
            fd = conn.fileno() if fast is not None and type(conn) is socket.socket else -1
            while True:
                if fd >= 0 and last is not None and last_epoch == local.epoch and last.device < 0:
                    assert fast is not None
                    got = fast.serve(
                        fd,
                        lo,
                        hi,
                        rights,
                        local.epoch_addr,
                        last_epoch,
                        frame_timeout,
                        MIN_RATE,
                        wire.MAX_PAYLOAD,
                        hdr,
                    )
                    if got == fast.IDLE:
                        if self.closed:
                            return
                        continue
                    if got != fast.HANDBACK:
                        raise _ended(got)
                    k = hsize  # a request for the code below; its header is in hdr
                else:
                    # Common case in one syscall; recv_until only when the kernel splits it.
                    try:
                        k = conn.recv_into(hv, hsize, _WAITALL)
                    except BlockingIOError:  # idle: nothing of a request arrived in one tick
                        if self.closed:
                            return
                        continue
                deadline = time.monotonic() + frame_timeout
                if k != hsize:
                    wire.recv_until(conn, hv[k:] if k else hv, deadline)
                magic, op, _, _, rid, addr, length = wire.REQ.unpack(hdr)
                if magic == wire.REQ_MAGIC and op == wire.OP_CONTROL and self.control is not None:
                    self._control(conn, rid, length, who, deadline)
                    continue
                if magic != wire.REQ_MAGIC or op not in served:
                    _reply_error(conn, rid, wire.ST_PROTOCOL, "malformed request frame", deadline)
                    self.noisy("malformed").warning("closing %s: malformed request frame", who)
                    return
                if length > wire.MAX_PAYLOAD:
                    _reply_error(
                        conn, rid, wire.ST_PROTOCOL, f"length {length} exceeds limit", deadline
                    )
                    self.noisy("oversized").warning(
                        "closing %s: oversized request (%d bytes)", who, length
                    )
                    return
                deadline += length / MIN_RATE
                if op == wire.OP_PING:
                    _answer(conn, _ok(rid), deadline)
                    continue
                need = _READ if op == wire.OP_READ else _WRITE
                try:
                    if (
                        last is None
                        or local.epoch != last_epoch
                        or addr < lo
                        or addr + length > hi
                        or not need & rights
                    ):
                        last_epoch = local.epoch
                        last = local.check(addr, length, Access(need), who=who)
                        lo, hi, rights = last.addr, last.addr + last.length, int(last.access)
                except AccessViolation as exc:
                    last = None
                    if op == wire.OP_WRITE:  # consume the payload so the stream stays in sync
                        if scratch is None:
                            scratch = bytearray(1 << 20)
                        left = length
                        sv = memoryview(scratch)
                        while left:
                            n = min(left, len(scratch))
                            wire.recv_until(conn, sv[:n], deadline)
                            left -= n
                    _reply_error(conn, rid, wire.ST_ACCESS, exc.message, deadline)
                    continue
                if last.device >= 0:  # GPU memory: staged, never viewed as host memory
                    if not self._serve_device(conn, op, rid, last.device, addr, length, deadline):
                        return
                    continue
                data = last.slice(addr, length)
                if op == wire.OP_READ:
                    head = resp.pack(wire.RESP_MAGIC, wire.ST_OK, 0, 0, rid, length)
                    try:
                        k = conn.sendmsg((head, data))
                    except BlockingIOError:  # the peer reads nothing for a tick
                        k = 0
                    if k != length + len(head):  # interrupted: finish what is left
                        wire.send_until(
                            conn,
                            [head[k:], data] if k < len(head) else [data[k - len(head) :]],
                            deadline,
                        )
                else:
                    try:
                        k = conn.recv_into(data, length, _WAITALL) if length else 0
                    except BlockingIOError:
                        k = 0
                    if k != length:
                        wire.recv_until(conn, data[k:], deadline)
                    _answer(conn, resp.pack(wire.RESP_MAGIC, wire.ST_OK, 0, 0, rid, 0), deadline)
        except TimeoutError as exc:
            self.noisy("timeout").info("closing %s: %s", who, exc)
        except ssl.SSLError as exc:  # a refused certificate, or a client not speaking TLS
            self.noisy("tls").info("closing %s: TLS: %s", who, exc)
        except (OSError, ConnectionError) as exc:
            log.debug("connection from %s ended: %s", who, exc)
        finally:
            with self.lock:
                self.conns.discard(conn)
            conn.close()
            if self.staging is not None and cuda_driver.loaded():
                with contextlib.suppress(GpuError):
                    self.staging.release_thread()

    def _serve_device(
        self,
        conn: socket.socket,
        op: int,
        rid: int,
        device: int,
        addr: int,
        length: int,
        deadline: float,
    ) -> bool:
        """Serve one request on GPU memory through the staging pipe, by the frame's
        ``deadline``; False closes the connection (a failed copy leaves the stream
        mid-payload)."""
        if self.staging is None:
            return False
        try:
            pipe = self.staging.pipe(device)
            if op == wire.OP_READ:
                _answer(
                    conn, wire.RESP.pack(wire.RESP_MAGIC, wire.ST_OK, 0, 0, rid, length), deadline
                )
                pipe.to_network(
                    addr, length, lambda c: wire.send_until(conn, [c], deadline), deadline
                )
            else:
                pipe.from_network(
                    addr, length, lambda c: wire.recv_until(conn, c, deadline), deadline
                )
                _answer(conn, _ok(rid), deadline)
        except (GpuError, TransferTimeout) as exc:
            log.warning("closing a connection: staging GPU memory failed: %s", exc)
            return False
        return True

    def _control(
        self, conn: socket.socket, rid: int, length: int, who: str, deadline: float
    ) -> None:
        if length > wire.MAX_CONTROL:
            _reply_error(conn, rid, wire.ST_PROTOCOL, "control message too long", deadline)
            raise ConnectionError(f"oversized control message ({length} bytes)")
        msg = bytearray(length)
        wire.recv_until(conn, memoryview(msg), deadline)
        assert self.control is not None
        try:
            reply = self.control(bytes(msg), who)
        except MooncakeConnectorsError as exc:
            _reply_error(conn, rid, wire.ST_PROTOCOL, exc.message, deadline)
            return
        head = wire.RESP.pack(wire.RESP_MAGIC, wire.ST_OK, 0, 0, rid, len(reply))
        wire.send_until(conn, [head + reply], deadline)

    def close(self) -> None:
        with self.lock:
            self.closed = True
            conns = list(self.conns)
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)


def _ended(outcome: int) -> Exception:
    """The exception that ends a connection the compiled loop gave up on (as the Python loop
    would have raised it)."""
    assert fast is not None
    if outcome == fast.TIMEOUT:
        return TimeoutError("a request did not arrive whole within its frame timeout")
    if outcome == fast.CLOSED:
        return ConnectionError("the peer closed the connection")
    err = fast.last_errno()
    return OSError(err, os.strerror(err) if err else "socket error")


def _ok(rid: int) -> bytes:
    return wire.RESP.pack(wire.RESP_MAGIC, wire.ST_OK, 0, 0, rid, 0)


def _answer(conn: socket.socket, data: bytes, deadline: float) -> None:
    try:
        k = conn.send(data)
    except BlockingIOError:  # the peer reads nothing for a tick
        k = 0
    if k != len(data):
        wire.send_until(conn, [memoryview(data)[k:]], deadline)


def _reply_error(conn: socket.socket, rid: int, status: int, message: str, deadline: float) -> None:
    data = message.encode()[: wire.MAX_ERROR_MESSAGE]
    wire.send_until(
        conn, [wire.RESP.pack(wire.RESP_MAGIC, status, 0, 0, rid, len(data)) + data], deadline
    )
