"""Framed request/response over TCP: a one-thread selector server and a blocking channel.

Why not pyzmq: measured on the project's 2-core machine, a pyzmq DEALER/ROUTER round trip
between two Python processes took ~200 µs (the I/O threads add two thread hops per message),
a plain TCP socket ~42 µs. A 4 KiB put is two round trips, so the control plane speaks length-
prefixed msgspec frames (:mod:`.protocol`) on plain sockets: the server is one thread with a
selector (its handler owns all state, no locks), a client blocks on its own socket with a deadline.

With TLS (an ``ssl.SSLContext``) the server wraps each connection and runs its handshake in the
loop, non-blocking, within ``frame_timeout``; it opens no unix socket (that path would skip the
certificates), and with mutual TLS a connection is authenticated by its certificate, so the token
challenge answers "not required" (see :mod:`mooncake_connectors.tls`).
"""

from __future__ import annotations

import collections
import contextlib
import hmac
import itertools
import logging
import os
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec

from ..config import is_loopback
from ..errors import AuthenticationError, ProtocolError
from ..netguard import MIN_RATE, AcceptBackoff, RateLimitedLog, SiteLogs
from ..tls import (
    TlsConfig,
    client_context,
    handshake_error,
    refusal,
    server_context,
    wrap_client,
)
from ..transfer_core.transports.fast import tcp as _fast
from .config import split_hostport
from .protocol import (
    FLAG_NOTIFY,
    FLAG_PUSH,
    HEADER,
    MAGIC,
    PREFIX,
    PROTOCOL_VERSION,
    Auth,
    AuthStart,
    Challenge,
    Code,
    Err,
    Msg,
    Ok,
    auth_mac,
    frame,
    reply_decoder,
    request_decoder,
)

log = logging.getLogger(__name__)
_HDR = PREFIX.size + HEADER.size
_RECV = 65536  # below malloc's mmap threshold: a 1 MiB recv buffer costs an mmap per call
_PRE_AUTH_FRAME = 4096  # the largest frame a connection may send before it authenticated


def unix_name(host: str, port: int) -> str:
    return f"\0mooncake-connectors-store-{host}:{port}"


def _connect_unix(host: str, port: int, timeout: float) -> socket.socket | None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(unix_name(host, port))
    except OSError:
        s.close()
        return None
    return s


def _speaks_tls(host: str, port: int, timeout: float) -> bool:
    """Whether the listener at ``host:port`` answers a TLS ClientHello in TLS (a handshake, or
    an alert such as "certificate required"). A plaintext master answers one with a refusal
    frame, which the TLS layer reads as a wrong version, never as an alert."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # a probe: it learns what the peer speaks, nothing else
    try:
        with socket.create_connection((host, port), timeout) as raw, ctx.wrap_socket(raw):
            return True
    except ssl.SSLError as exc:
        return "ALERT" in str(getattr(exc, "reason", "") or "").upper()
    except OSError:
        return False


class Conn:
    """One accepted connection of a FrameServer."""

    __slots__ = (
        "__weakref__",
        "authed",
        "closed",
        "closing",
        "counted",
        "data",
        "due",
        "handshaking",
        "nonce",
        "opened",
        "peer",
        "rbuf",
        "sock",
        "wbuf",
    )

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self.rbuf = bytearray()
        self.wbuf = bytearray()
        self.closed = False
        self.closing = False  # close once wbuf is flushed
        self.data: Any = None  # what the handler attaches (e.g. the server record)
        self.authed = False
        self.nonce = b""
        self.opened = time.monotonic()
        self.due = 0.0  # when the frame now arriving must be whole (0: none is arriving)
        self.counted = 0  # bytes of rbuf counted against the server's in-flight budget
        self.handshaking = False  # TLS handshake not finished


Handler = Callable[[Conn, Msg, int], "Msg | None"]


class FrameServer:
    """Accepts connections and calls ``handler(conn, request, flags)`` in its one thread.

    ``tick()`` runs between events and returns the seconds until it wants to run again.
    ``on_close(conn)`` runs when a connection goes. ``push(conn, msg)`` (loop thread only) sends
    an unsolicited frame. ``call_soon(fn)`` runs ``fn`` in the loop thread (any thread may call).

    With a ``token``, a connection must first prove it knows the token: ``AuthStart`` is answered
    with a ``Challenge`` (a fresh random nonce), ``Auth`` must carry HMAC-SHA256(token, nonce).
    Anything else first, or a wrong answer, gets an ``UNAUTHORIZED`` error and the connection is
    closed; until then frames over 4 KiB are refused. Without a token the exchange is answered
    "not required", so a client with a token talks to any server.

    Limits against hostile or broken peers: a frame must arrive whole within ``frame_timeout``
    seconds plus its length at ``MIN_RATE`` (and, with a token, authentication must finish
    within ``frame_timeout`` of connecting); bytes of unfinished frames, over all connections,
    stay below ``max_inflight`` (the connection that would pass it is refused); answers a peer
    does not read stay below ``2 * max_frame``. Buffers grow as bytes arrive, never by what a
    frame header declares. Answers and pushes waiting to be written, over all connections, stay
    below ``max_buffered``: past it the connections holding the most unsent bytes (the ones that
    do not read) are closed first. A failed ``accept()`` (EMFILE...) pauses accepting, backing off.
    """

    def __init__(
        self,
        host: str,
        port: int,
        handler: Handler,
        *,
        tick: Callable[[], float] | None = None,
        on_close: Callable[[Conn], None] | None = None,
        max_frame: int = 64 << 20,
        name: str = "mc-store-rpc",
        token: str | None = None,
        frame_timeout: float = 10.0,
        max_inflight: int = 256 << 20,
        max_buffered: int = 256 << 20,
        tls: TlsConfig | None = None,
    ) -> None:
        self.handler = handler
        self.max_buffered = max_buffered
        self.buffered = 0  # bytes of answers and pushes not yet written, all connections
        self.tls = server_context(tls) if tls is not None else None
        self.tls_mutual = tls is not None and tls.mutual
        self.frame_timeout = frame_timeout
        self.max_inflight = max_inflight
        self.inflight = 0  # bytes of unfinished frames held, all connections
        self._backoff = AcceptBackoff(name, log)
        self._resume_at = 0.0  # accepting is paused until then (0: not paused)
        self._next_sweep = 0.0
        self._limit_log = RateLimitedLog(log)
        self._noisy = SiteLogs(log)  # one line per refused peer would let peers flood the log
        self.token = token
        self.tick = tick
        self.on_close = on_close
        self.max_frame = max_frame
        self.name = name
        self._listener = socket.create_server((host, port), backlog=128, reuse_port=False)
        self._listener.setblocking(False)
        self.host = host
        self.port: int = self._listener.getsockname()[1]
        # Loopback peers may use an abstract unix socket named after the TCP address: no TCP
        # stack on the way (measured ~10-20 % less per round trip than loopback TCP here).
        self._unix: socket.socket | None = None
        if is_loopback(host) and self.tls is None:
            try:
                u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                u.bind(unix_name(host, self.port))
                u.listen(128)
                u.setblocking(False)
                self._unix = u
            except OSError as exc:  # taken, or no abstract namespace: TCP only
                log.debug("no unix listener for port %d: %s", self.port, exc)
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._calls: collections.deque[Callable[[], None]] = collections.deque()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.conns: set[Conn] = set()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> FrameServer:
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        if self._unix is not None:
            self._sel.register(self._unix, selectors.EVENT_READ, "unix")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()
        return self

    def call_soon(self, fn: Callable[[], None]) -> None:
        self._calls.append(fn)
        with contextlib.suppress(OSError):  # stopping
            self._wake_w.send(b"x")

    def stop(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    # -- loop -------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                timeout = min(self.tick() if self.tick is not None else 0.5, 0.5)
                now = time.monotonic()
                if now >= self._next_sweep:
                    self._sweep(now)
                if self._resume_at:
                    if now >= self._resume_at:
                        self._listen(True)
                    else:
                        timeout = min(timeout, self._resume_at - now)
                for key, mask in self._sel.select(max(0.0, timeout)):
                    if key.data is None:
                        self._accept(self._listener)
                    elif key.data == "unix":
                        self._accept(self._unix)  # type: ignore[arg-type]
                    elif key.data == "wake":
                        self._drain_wake()
                    else:
                        conn: Conn = key.data
                        if conn.handshaking:
                            self._handshake(conn)
                        elif mask & selectors.EVENT_READ:
                            self._read(conn)
                        if mask & selectors.EVENT_WRITE and not (conn.closed or conn.handshaking):
                            self._flush(conn)
        except Exception:
            log.exception("%s loop crashed", self.name)
            raise
        finally:
            for conn in list(self.conns):
                self._close(conn)
            self._sel.close()
            self._listener.close()
            if self._unix is not None:
                self._unix.close()
            self._wake_r.close()
            self._wake_w.close()

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass
        while self._calls:
            self._calls.popleft()()

    def _listen(self, on: bool) -> None:
        listeners = [(self._listener, None), (self._unix, "unix")]
        for sock, tag in listeners:
            if sock is None:
                continue
            if on:
                self._sel.register(sock, selectors.EVENT_READ, tag)
            else:
                with contextlib.suppress(KeyError, ValueError):
                    self._sel.unregister(sock)
        self._resume_at = 0.0

    def _accept(self, listener: socket.socket) -> None:
        while not self._resume_at:
            try:
                sock, addr = listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:  # EMFILE and the like: keep serving who we have
                # the listener stays readable: selecting it again at once would spin
                delay = self._backoff.failed(exc)
                self._listen(False)
                self._resume_at = time.monotonic() + delay
                return
            self._backoff.succeeded()
            sock.setblocking(False)
            if sock.family != socket.AF_UNIX:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                peer = f"{addr[0]}:{addr[1]}"
            else:
                peer = "unix"
            if self.tls is not None:
                sock = self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
            conn = Conn(sock, peer)
            conn.handshaking = self.tls is not None
            conn.authed = self.tls_mutual  # its certificate is checked before any frame is read
            self.conns.add(conn)
            self._sel.register(sock, selectors.EVENT_READ, conn)

    def _handshake(self, conn: Conn) -> None:
        assert isinstance(conn.sock, ssl.SSLSocket)
        try:
            conn.sock.do_handshake()
        except ssl.SSLWantReadError:
            self._sel.modify(conn.sock, selectors.EVENT_READ, conn)
            return
        except ssl.SSLWantWriteError:
            self._sel.modify(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, conn)
            return
        except OSError as exc:  # a refused certificate, a client that does not speak TLS
            self._limit_log.warning(
                "%s: TLS handshake with %s failed: %s", self.name, conn.peer, exc
            )
            self._close(conn)
            return
        conn.handshaking = False
        self._sel.modify(conn.sock, selectors.EVENT_READ, conn)
        self._read(conn)  # the first frame may have come with the handshake's last flight

    def _read(self, conn: Conn) -> None:
        try:
            data = conn.sock.recv(_RECV)
            # TLS: the selector sees the socket, not what OpenSSL already decrypted
            while self.tls is not None and data and conn.sock.pending():  # type: ignore[attr-defined]
                data += conn.sock.recv(_RECV)
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(conn)
            return
        if conn.closing:  # refused: what else it sends is dropped
            return
        buf = conn.rbuf
        buf += data
        consumed = self._parse(conn)
        if conn.closed:
            return
        self.inflight += len(buf) - conn.counted
        conn.counted = len(buf)
        if not buf:
            conn.due = 0.0
        elif self.inflight > self.max_inflight:
            self._limit_log.warning(
                "%s: unfinished frames hold %d bytes (limit %d)",
                self.name,
                self.inflight,
                self.max_inflight,
            )
            self._refuse(conn, "server busy: too many bytes of unfinished frames")
        elif consumed or not conn.due:  # a frame started in this read
            length = PREFIX.unpack_from(buf, 0)[0] if len(buf) >= PREFIX.size else 0
            conn.due = time.monotonic() + self.frame_timeout + length / MIN_RATE

    def _sweep(self, now: float) -> None:
        """Close connections that are too slow with a frame or with authenticating."""
        self._next_sweep = now + min(0.25, self.frame_timeout / 4)
        auth_by = now - self.frame_timeout
        for conn in list(self.conns):
            if conn.due and now > conn.due:
                if conn.closing:  # a refused peer that does not read its answer
                    self._close(conn)
                else:
                    self._refuse(conn, f"frame not complete within {self.frame_timeout:g}s")
            elif conn.handshaking and conn.opened < auth_by:
                self._close(conn)
            elif self.token is not None and not conn.authed and conn.opened < auth_by:
                self._refuse(conn, f"no authentication within {self.frame_timeout:g}s")

    def _parse(self, conn: Conn) -> int:
        """Dispatch the whole frames in ``conn.rbuf``; returns how many bytes they took."""
        buf = conn.rbuf
        pos: int = 0
        n = len(buf)
        while n - pos >= PREFIX.size and not conn.closing:
            (length,) = PREFIX.unpack_from(buf, pos)
            limit = self.max_frame if conn.authed or self.token is None else _PRE_AUTH_FRAME
            if length > limit or length < HEADER.size:
                self._refuse(conn, f"frame of {length} bytes refused (limit {limit})")
                return pos
            end = pos + PREFIX.size + length
            if end > n:
                break
            magic, version, flags, req_id = HEADER.unpack_from(buf, pos + PREFIX.size)
            body = memoryview(buf)[pos + _HDR : end]
            pos = end
            if magic != MAGIC:
                body.release()
                self._refuse(conn, "not a mooncake-connectors store frame (bad magic)")
                return pos
            self._dispatch(conn, version, flags, req_id, body)
        if pos:
            del buf[:pos]
        return pos

    def _dispatch(self, conn: Conn, version: int, flags: int, req_id: int, body: Any) -> None:
        reply: Msg | None
        try:
            if version != PROTOCOL_VERSION:
                reply = Err(
                    int(Code.PROTOCOL),
                    f"unsupported protocol version {version}; this peer speaks {PROTOCOL_VERSION}",
                )
            else:
                try:
                    msg = request_decoder.decode(body)
                except msgspec.ValidationError as exc:
                    reply = Err(int(Code.INVALID), f"invalid request: {exc}")
                except msgspec.DecodeError as exc:
                    reply = Err(int(Code.PROTOCOL), f"malformed request: {exc}")
                else:
                    if self.token is not None and not conn.authed:
                        reply = self._authenticate(conn, msg)
                    elif isinstance(msg, AuthStart):
                        reply = Challenge(b"", False)
                    elif isinstance(msg, Auth):
                        reply = Ok()
                    else:
                        reply = self.handler(conn, msg, flags)
        except Exception as exc:  # a handler bug must not take the service down
            log.exception("%s: handler failed", self.name)
            reply = Err(int(Code.INTERNAL), f"internal error: {type(exc).__name__}: {exc}")
        finally:
            body.release()
        if reply is not None and not flags & FLAG_NOTIFY:
            self.send(conn, frame(reply, req_id))
        if conn.closing and not conn.wbuf:
            self._close(conn)

    def _authenticate(self, conn: Conn, msg: Msg) -> Msg:
        assert self.token is not None
        if isinstance(msg, AuthStart):
            conn.nonce = os.urandom(16)
            return Challenge(conn.nonce, True)
        if isinstance(msg, Auth) and conn.nonce:
            if hmac.compare_digest(msg.mac, auth_mac(self.token, conn.nonce)):
                conn.authed = True
                conn.nonce = b""
                return Ok()
            why = "wrong token"
        else:
            why = "this port requires a token (--auth-token / MOONCAKE_CONNECTORS_STORE_TOKEN)"
        self._noisy("auth").warning("%s: %s from %s; closing it", self.name, why, conn.peer)
        conn.closing = True  # what else it sent is dropped; closed once the answer is out
        return Err(int(Code.UNAUTHORIZED), why)

    def _refuse(self, conn: Conn, why: str) -> None:
        self._noisy("refused").info("%s: %s from %s; closing it", self.name, why, conn.peer)
        self.send(conn, frame(Err(int(Code.PROTOCOL), why), 0))
        conn.closing = True
        conn.rbuf.clear()
        self.inflight -= conn.counted
        conn.counted = 0
        conn.due = time.monotonic() + self.frame_timeout  # to take up the answer
        if not conn.wbuf:
            self._close(conn)

    def push(self, conn: Conn, msg: Msg) -> None:
        self.send(conn, frame(msg, 0, FLAG_PUSH))

    def send(self, conn: Conn, data: bytes) -> None:
        if conn.closed:
            return
        if conn.wbuf:
            if len(conn.wbuf) > 2 * self.max_frame:  # it does not read its answers
                self._limit_log.warning("%s: %s reads no answers; closing it", self.name, conn.peer)
                self._close(conn)
                return
            self._hold(conn, data)
            return
        try:
            sent = conn.sock.send(data)
        except (BlockingIOError, InterruptedError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
            sent = 0  # TLS: OpenSSL wants these bytes again first, and the flush sends them
        except OSError:
            self._close(conn)
            return
        if sent < len(data):
            self._hold(conn, data[sent:] if sent else data)
            if not conn.closed:
                self._sel.modify(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, conn)

    def _hold(self, conn: Conn, data: bytes) -> None:
        """Keep ``data`` for ``conn`` until it reads; past ``max_buffered`` in all, close those
        holding the most unsent bytes (each alone stays below 2 * max_frame, so without a total
        many non-reading peers could make the master hold gigabytes)."""
        self.buffered += len(data)
        conn.wbuf += data
        while self.buffered > self.max_buffered and self.conns:
            worst = max(self.conns, key=lambda c: len(c.wbuf))
            self._limit_log.warning(
                "%s: %d bytes of answers unread (limit %d); closing %s, which holds %d",
                self.name,
                self.buffered,
                self.max_buffered,
                worst.peer,
                len(worst.wbuf),
            )
            self._close(worst)
            if worst is conn:
                return

    def _flush(self, conn: Conn) -> None:
        try:
            sent = conn.sock.send(conn.wbuf)
        except (BlockingIOError, InterruptedError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
            return
        except OSError:
            self._close(conn)
            return
        del conn.wbuf[:sent]
        self.buffered -= sent
        if not conn.wbuf:
            if conn.closing:
                self._close(conn)
            else:
                self._sel.modify(conn.sock, selectors.EVENT_READ, conn)

    def _close(self, conn: Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        self.conns.discard(conn)
        self.inflight -= conn.counted
        conn.counted = 0
        self.buffered -= len(conn.wbuf)
        conn.wbuf.clear()
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(conn.sock)
        conn.sock.close()
        if self.on_close is not None:
            try:
                self.on_close(conn)
            except Exception:
                log.exception("%s: on_close failed", self.name)


class Channel:
    """A blocking client connection; ``call`` waits for the reply with a deadline.

    Not thread-safe: use one per thread. Frames the peer pushes while a call waits are kept in
    ``pushes``. Raises TimeoutError (deadline), ConnectionError (peer gone) or ProtocolError.
    ``local_ipc``: a loopback peer is reached over its abstract unix socket when it has one;
    False keeps to TCP (a TCP-only setup, e.g. to compare with a system that has no shortcut).
    """

    _ids = itertools.count(1)

    def __init__(
        self,
        address: str,
        timeout: float,
        token: str | None = None,
        tls: TlsConfig | None = None,
        *,
        local_ipc: bool = True,
    ) -> None:
        host, port = split_hostport(address)
        self.address = address
        self._peer = (host, port)
        # The abstract unix socket skips TLS's certificates: a TLS channel always takes TCP.
        local = local_ipc and tls is None and is_loopback(host)
        sock = _connect_unix(host, port, timeout) if local else None
        if sock is None:
            sock = socket.create_connection((host, port), timeout=timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if tls is not None:
                try:
                    sock = wrap_client(client_context(tls), sock, timeout, address)
                except BaseException:
                    sock.close()
                    raise
        self.sock: socket.socket = sock
        self._fd = sock.fileno()
        # nothing received yet over plain TCP: a reset now may be a TLS-only peer refusing us
        self._unheard = tls is None and sock.family != socket.AF_UNIX
        # TLS may hold decrypted bytes the socket no longer shows: no spinning on its fd
        self._spin = _fast.spin() if _fast is not None and tls is None else 0.0
        self.rbuf = bytearray()
        self.pushes: collections.deque[Msg] = collections.deque()
        self.closed = False
        # replies to requests sent with send() and not yet collected with wait()
        self._outstanding: set[int] = set()
        self._replies: dict[int, Msg] = {}
        if token:
            try:
                self._authenticate(token, timeout)
            except BaseException:
                self.close()
                raise

    def _authenticate(self, token: str, timeout: float) -> None:
        reply = self.call(AuthStart(), timeout)
        if not isinstance(reply, Challenge):
            raise ProtocolError(f"{self.address} answered {reply} to AuthStart", peer=self.address)
        if reply.required:
            reply = self.call(Auth(auth_mac(token, reply.nonce)), timeout)
            if not isinstance(reply, Ok):
                raise ProtocolError(f"{self.address} answered {reply} to Auth", peer=self.address)

    def call(self, msg: Msg, timeout: float) -> Msg:
        """``msg``'s reply, within ``timeout`` seconds (replies to requests still in flight
        from ``send`` are kept for their ``wait``)."""
        deadline = time.monotonic() + timeout
        return self.wait(self.send(msg, timeout), deadline)

    @property
    def in_flight(self) -> bool:
        """Requests sent with ``send`` whose replies were not collected."""
        return bool(self._outstanding)

    def send(self, msg: Msg, timeout: float) -> int:
        """Send a request without waiting: several may be in flight; ``wait`` collects each."""
        rid = next(self._ids)
        self._send(frame(msg, rid), timeout)
        self._outstanding.add(rid)
        return rid

    def wait(self, rid: int, deadline: float) -> Msg:
        """The reply to request ``rid`` (from ``send``); TimeoutError at the deadline."""
        try:
            got = self._replies.pop(rid, None)
            while got is None:
                frame_ = self._read_frame(deadline)
                if frame_ is None:
                    raise TimeoutError(f"no reply from {self.address} by the call's deadline")
                r_id, flags, reply = frame_
                if flags & FLAG_PUSH:
                    self.pushes.append(reply)
                elif r_id == rid:
                    got = reply
                elif r_id in self._outstanding:
                    self._replies[r_id] = reply
                elif r_id == 0 and isinstance(reply, Err):
                    raise ProtocolError(reply.message, peer=self.address)
        finally:
            self._outstanding.discard(rid)
        if isinstance(got, Err) and got.code == Code.UNAUTHORIZED:
            self.close()
            raise AuthenticationError(
                f"{self.address} refused us: {got.message}", peer=self.address
            )
        return got

    def notify(self, msg: Msg, timeout: float = 5.0) -> None:
        self._send(frame(msg, next(self._ids), FLAG_NOTIFY), timeout)

    def poll_push(self, timeout: float) -> Msg | None:
        """The next pushed message, waiting at most ``timeout`` seconds."""
        if self.pushes:
            return self.pushes.popleft()
        got = self._read_frame(time.monotonic() + timeout)
        if got is None:
            return None
        _, flags, msg = got
        if flags & FLAG_PUSH:
            return msg
        return None

    def _send(self, data: bytes, timeout: float) -> None:
        if self.closed:
            raise ConnectionError(f"channel to {self.address} is closed")
        self.sock.settimeout(timeout)
        try:
            self.sock.sendall(data)
        except ssl.SSLError as exc:
            assert isinstance(self.sock, ssl.SSLSocket)
            err = refusal(self.sock, exc, self.address)
            self.close()
            raise err from exc
        except OSError as exc:
            self.close()
            raise ConnectionError(f"send to {self.address} failed: {exc}") from exc

    def _read_frame(self, deadline: float) -> tuple[int, int, Msg] | None:
        buf = self.rbuf
        while True:
            if len(buf) >= _HDR:
                (length,) = PREFIX.unpack_from(buf, 0)
                end = PREFIX.size + length
                if len(buf) >= end:
                    magic, version, flags, rid = HEADER.unpack_from(buf, PREFIX.size)
                    if magic != MAGIC or version != PROTOCOL_VERSION:
                        self.close()
                        raise ProtocolError(
                            f"{self.address} answered with a foreign frame (version {version})",
                            peer=self.address,
                        )
                    try:
                        msg = reply_decoder.decode(memoryview(buf)[_HDR:end])
                    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                        self.close()
                        raise ProtocolError(
                            f"undecodable reply from {self.address}: {exc}", peer=self.address
                        ) from exc
                    del buf[:end]
                    return rid, flags, msg
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if self._spin and _fast is not None:  # spin for the reply before sleeping on it
                _fast.wait_readable(self._fd, min(self._spin, left))  # (a wake-up costs more)
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(_RECV)
            except TimeoutError:
                return None
            except ssl.SSLError as exc:  # TLS 1.3: a refused certificate shows on the first read
                self.close()
                raise handshake_error(exc, self.address) from exc
            except OSError as exc:
                self.close()
                self._tls_refusal(exc)
                raise ConnectionError(f"connection to {self.address} failed: {exc}") from exc
            if not data:
                self.close()
                self._tls_refusal(None)
                raise ConnectionError(f"{self.address} closed the connection")
            self._unheard = False
            buf += data

    def _tls_refusal(self, exc: OSError | None) -> None:
        """A TLS-only master drops a plaintext client at its first bytes, which looks like a
        master that went away, and would be retried until the caller's deadline: when our
        first answer is a reset or an end of stream, ask the peer whether it speaks TLS."""
        if not self._unheard:
            return
        self._unheard = False
        host, port = self._peer
        if _speaks_tls(host, port, 2.0):
            raise AuthenticationError(
                f"{self.address} requires TLS and no TLS is configured here "
                "(tls_cert/tls_key/tls_ca, or MOONCAKE_CONNECTORS_TLS_*)",
                peer=self.address,
            ) from exc

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sock.close()
