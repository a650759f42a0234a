"""The ``tcp`` transport: framed, pipelined, several lanes (connections) per peer.

Initiator (this module): each lane has a sender thread (coalesces queued requests into one
``sendmsg``) and a receiver thread (reads responses in order and ``recv_into``s READ data straight
into the destination memory). A caller that waits anyway drives a pooled *direct* connection from
its own thread instead. A broken lane fails its slices with TransportBroken so the engine can move
them elsewhere. Target: ``tcp_server.TcpServer``.
"""

from __future__ import annotations

import collections
import contextlib
import hmac
import itertools
import logging
import os
import queue
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import cast

from ...errors import (
    AuthenticationError,
    ConfigError,
    MooncakeConnectorsError,
    ProtocolError,
    TransferTimeout,
    TransportBroken,
    TransportClosed,
)
from ...plugins import hookimpl
from ...tls import client_context, handshake_error, wrap_client
from ...types import LocationKind, TransferOp
from .. import cuda_driver
from ..descriptor import RegionDesc, SegmentDesc
from ..transport import Slice, Transport, TransportContext, TransportSettings, load_settings
from . import wire
from .staging import Staging
from .tcp_server import TLS_ENDPOINT, TcpServer, _tune
from .tcp_staged import StagedTcp
from .tls_stream import TlsStream

log = logging.getLogger(__name__)

_WAITALL = socket.MSG_WAITALL
_RESP_SIZE = wire.RESP.size
_REQ = wire.REQ
_REQ_SIZE = wire.REQ.size
_COALESCE = 64  # most requests one sendmsg carries
_INLINE_PAYLOAD = 256 * 1024  # WRITE bytes an async submit may send from the caller's thread
_DIRECT_CHUNK = 512  # requests sent before their answers are read, on a direct connection
_DIRECT_POOL = 8  # idle direct connections kept per peer
_HOST_OR_GPU = (LocationKind.CPU, LocationKind.CUDA)


def split_hostport(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ProtocolError(f"bad tcp endpoint {addr!r}; expected HOST:PORT")
    return host.strip("[]"), int(port)


def open_connection(
    ctx: TransportContext, peer: str, addr: str, path: str, deadline: float | None = None
) -> socket.socket:
    """Connect and run the handshake; the socket comes back blocking, without a timeout.

    With a request's ``deadline`` the setup gets what is left of it when that is less than
    ``connect_timeout``, and running out is TransferTimeout (a stopped peer's kernel still
    accepts connections: only its handshake never comes)."""
    cfg = ctx.config
    host, port = split_hostport(addr)
    limit = cfg.connect_timeout
    if deadline is not None:
        limit = min(limit, deadline - time.monotonic())
        if limit <= 0:
            raise TransferTimeout("deadline passed before connecting", peer=peer, path=path)
    try:
        sock = socket.create_connection((host, port), timeout=limit)
    except OSError as exc:
        raise _setup_error("cannot connect", exc, deadline, peer, path) from exc
    certified = False  # the target proved membership with a CA-signed certificate
    try:
        _tune(sock)
        tls = cfg.tls
        if tls is not None:
            stream = TlsStream(
                wrap_client(client_context(tls), sock, limit, peer, path), mutual=tls.mutual
            )
            stream.settimeout(limit)
            certified = tls.mutual
            sock = cast(socket.socket, stream)  # the part of the socket API the transport uses
        hello = bytearray(wire.HELLO.size)
        wire.recv_exact(sock, memoryview(hello))
        magic, version, flags, _, nonce = wire.HELLO.unpack(hello)
        if magic != wire.MAGIC:
            raise ProtocolError(
                "peer is not a mooncake-connectors tcp endpoint", peer=peer, path=path
            )
        if version != wire.VERSION:
            raise ProtocolError(
                f"peer speaks protocol version {version}, we speak {wire.VERSION}",
                peer=peer,
                path=path,
            )
        token = cfg.auth_token
        asked = bool(flags & wire.FLAG_AUTH)
        if asked != bool(token) and not (certified and not asked):
            # A target that asks for no token cannot prove it holds ours: it may be anyone who
            # published a descriptor, so nothing is sent to it (unless its certificate proved it).
            why = "requires a token and none is configured" if not token else "asks for no token"
            raise AuthenticationError(f"peer {why}", peer=peer, path=path)
        token = token if asked else None
        ours = os.urandom(wire.NONCE)
        proof = wire.initiator_proof(token, nonce, ours)
        sock.sendall(wire.AUTH.pack(wire.MAGIC, wire.VERSION, 0, proof, ours))
        verdict = bytearray(wire.VERDICT.size)
        wire.recv_exact(sock, memoryview(verdict))
        _, status, _, theirs = wire.VERDICT.unpack(verdict)
        if status == wire.VERDICT_BAD_TOKEN:
            raise AuthenticationError("peer rejected our token", peer=peer, path=path)
        if status != wire.VERDICT_OK:
            raise ProtocolError(
                f"peer refused the connection (status {status})", peer=peer, path=path
            )
        if not hmac.compare_digest(theirs, wire.target_proof(token, nonce, ours)):
            raise AuthenticationError("peer failed to prove the token", peer=peer, path=path)
        sock.settimeout(None)
    except ssl.SSLError as exc:  # TLS 1.3: a refused certificate is an alert on the first read
        sock.close()
        raise handshake_error(exc, peer, path) from exc
    except OSError as exc:
        sock.close()
        raise _setup_error("handshake failed", exc, deadline, peer, path) from exc
    except BaseException:
        sock.close()
        raise
    return sock


def _tls_refused(peer: SegmentDesc) -> AuthenticationError:
    return AuthenticationError(
        "peer requires TLS and no TLS is configured here (tls_cert/tls_key/tls_ca)",
        peer=peer.name,
    )


def _setup_error(
    what: str, exc: OSError, deadline: float | None, peer: str, path: str
) -> MooncakeConnectorsError:
    late = deadline is not None and time.monotonic() > deadline - 0.01  # (timers round)
    if late and isinstance(exc, TimeoutError):
        return TransferTimeout(f"{what}: the request's deadline passed", peer=peer, path=path)
    return TransportBroken(f"{what}: {exc}", peer=peer, path=path)


def frame(batch: Sequence[Slice], ids: Iterator[int]) -> tuple[list[memoryview | bytes], list[int]]:
    """Request frames (and WRITE payload views) for ``batch``, with fresh request ids."""
    bufs: list[memoryview | bytes] = []
    rids: list[int] = []
    for b in batch:
        rid = next(ids)
        rids.append(rid)
        if b.op is TransferOp.WRITE:
            bufs.append(
                wire.REQ.pack(wire.REQ_MAGIC, wire.OP_WRITE, 0, 0, rid, b.remote_addr, b.length)
            )
            bufs.append(b.local_view())
        else:
            bufs.append(
                wire.REQ.pack(wire.REQ_MAGIC, wire.OP_READ, 0, 0, rid, b.remote_addr, b.length)
            )
    return bufs, rids


def finish_response(
    sock: socket.socket,
    hdr: bytearray,
    s: Slice,
    want: int,
    peer: str,
    path: str,
    progress: Callable[[], object] | None = None,
) -> MooncakeConnectorsError | None:
    """Given a response header already in ``hdr``, read the rest for ``s`` (READ data lands in
    place). Returns the peer's error, if any; raises ProtocolError/OSError on a broken stream."""
    magic, status, _, _, rid, length = wire.RESP.unpack(hdr)
    if magic != wire.RESP_MAGIC or rid != want:
        raise ProtocolError(f"bad response frame (id {rid}, expected {want})", peer=peer, path=path)
    if status == wire.ST_OK:
        if s.op is TransferOp.READ:
            if length != s.length:
                raise ProtocolError("READ answered with a wrong length", peer=peer, path=path)
            view = s.local_view()
            # Common case in one syscall; recv_exact only when the kernel splits it.
            k = sock.recv_into(view, length, _WAITALL) if length else 0
            if k != length:
                if k and progress is not None:  # the next wait gets what is left, no more
                    progress()
                wire.recv_exact(sock, view[k:] if k else view, progress)
        return None
    if length > wire.MAX_ERROR_MESSAGE:
        raise ProtocolError("oversized error message", peer=peer, path=path)
    msg = bytearray(length)
    wire.recv_exact(sock, memoryview(msg))
    return wire.error_from_status(status, msg.decode(errors="replace"), peer=peer, path=path)


class _Lane:
    """One connection to one peer, with its sender and receiver threads."""

    def __init__(self, owner: TcpTransport, peer: str, addr: str, index: int) -> None:
        self.owner = owner
        self.peer = peer
        self.addr = addr
        self.index = index
        self.path = f"tcp {addr} lane {index}"
        self.q: queue.SimpleQueue[Slice | None] = queue.SimpleQueue()
        self.inflight: collections.deque[tuple[int, Slice]] = collections.deque()
        self.lock = threading.Lock()
        self.send_lock = threading.Lock()
        self.sock: socket.socket | None = None
        self.broken: MooncakeConnectorsError | None = None
        self.ids = itertools.count(1)
        self.sender = threading.Thread(
            target=self._send_loop, name=f"mc-tcp-send-{index}", daemon=True
        )
        self.sender.start()

    def _connect(self) -> socket.socket:
        return open_connection(self.owner.ctx, self.peer, self.addr, self.path)

    # -- sending ----------------------------------------------------------------------------
    def _send_loop(self) -> None:
        try:
            self.sock = self._connect()
        except MooncakeConnectorsError as exc:
            self._break(exc)
            self._drain_queue()
            return
        threading.Thread(
            target=self._recv_loop, name=f"mc-tcp-recv-{self.index}", daemon=True
        ).start()
        sock = self.sock
        while True:
            s = self.q.get()
            if s is None:
                break
            batch = [s]
            while len(batch) < _COALESCE:
                try:
                    nxt = self.q.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self.q.put(None)
                    break
                batch.append(nxt)
            with self.send_lock:
                self._send(sock, batch)
        self._drain_queue()

    def _send(self, sock: socket.socket, batch: list[Slice]) -> None:
        """Frame and send ``batch``; caller holds ``send_lock`` so wire order = inflight order."""
        if self.broken is not None:
            for b in batch:
                b.complete(self.broken)
            return
        with self.lock:
            bufs, rids = frame(batch, self.ids)
            self.inflight.extend(zip(rids, batch, strict=True))
        try:
            wire.sendmsg_all(sock, bufs)
        except OSError as exc:
            self._break(TransportBroken(f"send failed: {exc}", peer=self.peer, path=self.path))

    def try_send_inline(self, batch: list[Slice]) -> bool:
        """Send from the caller's thread when the lane is connected and idle (saves a handoff)."""
        sock = self.sock
        if sock is None or self.broken is not None or not self.q.empty():
            return False
        if not self.send_lock.acquire(blocking=False):
            return False
        try:
            self._send(sock, batch)
        finally:
            self.send_lock.release()
        return True

    def _drain_queue(self) -> None:
        err = self.broken or TransportClosed("lane closed", peer=self.peer, path=self.path)
        while True:
            try:
                s = self.q.get_nowait()
            except queue.Empty:
                return
            if s is not None:
                s.complete(err)

    # -- receiving --------------------------------------------------------------------------
    def _recv_loop(self) -> None:
        sock = self.sock
        assert sock is not None
        hdr = bytearray(wire.RESP.size)
        hv = memoryview(hdr)
        try:
            while True:
                wire.recv_exact(sock, hv)
                # Requests enter ``inflight`` before they are sent, so the head is ours. It stays
                # there until its payload has landed: a break mid-payload must fail it too.
                with self.lock:
                    if not self.inflight:
                        raise ProtocolError(
                            "response without a request", peer=self.peer, path=self.path
                        )
                    want, s = self.inflight[0]
                err = finish_response(sock, hdr, s, want, self.peer, self.path)
                with self.lock:
                    self.inflight.popleft()
                s.complete(err)
        except (OSError, ConnectionError) as exc:
            self._break(TransportBroken(f"connection lost: {exc}", peer=self.peer, path=self.path))
        except MooncakeConnectorsError as exc:
            self._break(exc)

    # -- failure ----------------------------------------------------------------------------
    def _break(self, err: MooncakeConnectorsError) -> None:
        with self.lock:
            if self.broken is None:
                self.broken = err
            failed = list(self.inflight)
            self.inflight.clear()
        self.owner._forget(self)
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
        for _, s in failed:
            s.complete(err)
        self.q.put(None)  # wake the sender so it drains and exits

    def close(self) -> None:
        self._break(TransportClosed("transport closed", peer=self.peer, path=self.path))
        if self.sock is not None:
            self.sock.close()


class _Direct:
    """A connection driven by one waiting caller at a time: send a chunk, read its answers."""

    def __init__(self, sock: socket.socket, path: str) -> None:
        self.sock = sock
        self.path = path
        self.ids = itertools.count(1)
        self.hdr = bytearray(wire.RESP.size)
        self.hv = memoryview(self.hdr)
        self.timeout = -1.0  # kernel timeout currently set, seconds
        self.deadline = 0.0  # of the call driving it now (monotonic)

    def bound(self, seconds: float) -> None:
        """Bound each send/recv by ``seconds``. Requests in a row have nearly equal deadlines, so
        the two setsockopt calls are skipped while the bound already set is within [-1 s, +0.25 s]
        of the wanted one (0.25 s: the watchdog's own granularity)."""
        if -0.25 < seconds - self.timeout < 1.0:
            return
        _kernel_timeout(self.sock, seconds)
        self.timeout = max(seconds, 0.001)

    def rebound(self) -> None:
        """Bound the next send/recv by what is left of ``deadline``; TimeoutError if nothing."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request's deadline passed")
        self.bound(left)


def _exchange_one(conn: _Direct, s: Slice, peer: str) -> MooncakeConnectorsError | None:
    """One slice on a direct connection: what ``frame`` and the chunk loop of ``_run_direct``
    do, without their lists (the common synchronous request)."""
    sock = conn.sock
    s.path = conn.path
    conn.bound(conn.deadline - time.monotonic())
    rid = next(conn.ids)
    if s.op is TransferOp.WRITE:
        head = _REQ.pack(wire.REQ_MAGIC, wire.OP_WRITE, 0, 0, rid, s.remote_addr, s.length)
        payload = s.local_view()
        sent = sock.sendmsg((head, payload))
        if sent != _REQ_SIZE + s.length:
            rest: list[memoryview | bytes] = (
                [head[sent:], payload] if sent < _REQ_SIZE else [payload[sent - _REQ_SIZE :]]
            )
            conn.rebound()
            wire.sendmsg_all(sock, rest, conn.rebound)
    else:
        head = _REQ.pack(wire.REQ_MAGIC, wire.OP_READ, 0, 0, rid, s.remote_addr, s.length)
        sent = sock.send(head)
        if sent != _REQ_SIZE:
            conn.rebound()
            wire.sendmsg_all(sock, [memoryview(head)[sent:]], conn.rebound)
    conn.rebound()  # the wait gets what is left of the deadline, no more
    k = sock.recv_into(conn.hv, _RESP_SIZE, _WAITALL)
    if k != _RESP_SIZE:  # short (signal) or 0 (peer closed: recv_exact raises)
        wire.recv_exact(sock, conn.hv[k:] if k else conn.hv, conn.rebound)
    return finish_response(sock, conn.hdr, s, rid, peer, conn.path, conn.rebound)


def _kernel_timeout(sock: socket.socket, seconds: float) -> None:
    """Bound each blocking send/recv by the kernel (SO_RCVTIMEO/SO_SNDTIMEO). Python's own
    ``settimeout`` would switch the socket to non-blocking mode plus poll() before every call,
    which splits MSG_WAITALL receives and costs tens of microseconds per request."""
    seconds = max(seconds, 0.001)
    tv = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def _chunks(slices: Sequence[Slice]) -> Iterator[Sequence[Slice]]:
    """Runs of one op, at most _DIRECT_CHUNK long. Mixing a big WRITE after a READ in one chunk
    could deadlock (both sides blocked sending); within a run one direction carries only
    headers, which the socket buffers absorb."""
    start = 0
    for i in range(1, len(slices) + 1):
        if i == len(slices) or slices[i].op is not slices[start].op or i - start >= _DIRECT_CHUNK:
            yield slices[start:i]
            start = i


class TcpSettings(TransportSettings, frozen=True, forbid_unknown_fields=True):
    """``transport_settings["tcp"]``. lanes: connections per peer (default: the engine's
    ``tcp_lanes``)."""

    lanes: int | None = None
    # GPU memory crosses tcp through a pool of pinned host buffers: this many, of this size.
    staging_chunk: int = 1 << 20
    staging_buffers: int = 16

    def __post_init__(self) -> None:
        if self.lanes is not None and not 1 <= self.lanes <= 64:
            raise ConfigError(f"tcp lanes must be in 1..64, got {self.lanes}", transport="tcp")
        if not 4096 <= self.staging_chunk <= 1 << 30:
            raise ConfigError("tcp staging_chunk must be in 4 KiB..1 GiB", transport="tcp")
        if not 1 <= self.staging_buffers <= 1024:
            raise ConfigError("tcp staging_buffers must be in 1..1024", transport="tcp")


class TcpTransport(Transport):
    name = "tcp"
    Settings = TcpSettings

    def __init__(self, ctx: TransportContext) -> None:
        super().__init__(ctx)
        self.settings = load_settings(TcpSettings, self.name, ctx.config)
        self._lane_count = self.settings.lanes or ctx.config.tcp_lanes
        self._staging = Staging(self.settings.staging_chunk, self.settings.staging_buffers)
        self._staged = StagedTcp(self, self._staging, self._lane_count)
        self._server: TcpServer | None = None
        self._lanes: dict[tuple[str, int], _Lane] = {}
        self._idle: dict[tuple[str, str], list[_Direct]] = {}
        self._lock = threading.Lock()
        self._closed = False

    @property
    def port(self) -> int:
        return self._server.port if self._server else 0

    def start(self) -> dict[str, str]:
        self._server = TcpServer(self.ctx)
        self._server.staging = self._staging
        host = self.ctx.config.host
        host = f"[{host}]" if ":" in host else host
        ours = {"tcp": f"{host}:{self._server.port}"}
        if self._server.tls_ctx is not None:
            ours[TLS_ENDPOINT] = "mutual" if self._server.tls_mutual else "server"
        return ours

    def serves(self, local: LocationKind, remote: LocationKind) -> bool:
        return local in _HOST_OR_GPU and remote in _HOST_OR_GPU  # GPU ends are staged

    def reachable(self, peer: SegmentDesc, region: RegionDesc) -> bool:
        return "tcp" in peer.endpoints and region.kind in _HOST_OR_GPU

    def lanes(self, peer: SegmentDesc) -> int:
        return self._lane_count

    def submit(
        self, peer: SegmentDesc, slices: Sequence[Slice], *, inline_ok: bool = False
    ) -> None:
        # (the ends first: one attribute each, where a generator costs a microsecond)
        if (
            slices[0].local_device >= 0
            or slices[-1].local_device >= 0
            or (len(slices) > 2 and any(s.local_device >= 0 for s in slices))
        ):
            self._staged.submit(peer, [s for s in slices if s.local_device >= 0])
            slices = [s for s in slices if s.local_device < 0]
            if not slices:
                return
        addr = peer.endpoints["tcp"]
        if TLS_ENDPOINT in peer.endpoints and self.ctx.config.tls is None:
            refused = _tls_refused(peer)
            for s in slices:
                s.complete(refused)
            return
        if inline_ok and not self._closed:
            self._run_direct(peer, addr, slices)
            return
        by_lane: dict[int, list[Slice]] = {}
        for s in slices:
            by_lane.setdefault(s.lane, []).append(s)
        for lane_slices in by_lane.values():
            lane = self._lane(peer, addr, lane_slices[0].lane)
            if lane is None:
                err = TransportClosed("tcp transport closed", peer=peer.name)
                for s in lane_slices:
                    s.complete(err)
                continue
            for s in lane_slices:
                s.path = lane.path
            payload = sum(s.length for s in lane_slices if s.op is TransferOp.WRITE)
            # Inline sends skip a thread handoff; bulk payloads go inline only when the caller
            # waits anyway, so an async submit never blocks on a large WRITE.
            if (payload <= _INLINE_PAYLOAD or inline_ok) and lane.try_send_inline(lane_slices):
                continue
            for s in lane_slices:
                lane.q.put(s)
            if lane.broken is not None:  # it broke while we queued: its sender may be gone
                lane._drain_queue()

    def _lane(self, peer: SegmentDesc, addr: str, index: int) -> _Lane | None:
        key = (peer.name, index)
        lane = self._lanes.get(key)
        if lane is None or lane.broken is not None or lane.addr != addr:
            with self._lock:
                if self._closed:
                    return None
                lane = self._lanes.get(key)
                if lane is None or lane.broken is not None or lane.addr != addr:
                    lane = _Lane(self, peer.name, addr, index)
                    self._lanes[key] = lane
        return lane

    runs_inline = True

    def run_inline(self, peer: SegmentDesc, s: Slice) -> MooncakeConnectorsError | None:
        if TLS_ENDPOINT in peer.endpoints and self.ctx.config.tls is None:
            return _tls_refused(peer)
        if self._closed:
            return TransportClosed("tcp transport closed", peer=peer.name)
        return self._run_direct(peer, peer.endpoints["tcp"], (s,), report=False)

    def _run_direct(
        self, peer: SegmentDesc, addr: str, slices: Sequence[Slice], report: bool = True
    ) -> MooncakeConnectorsError | None:
        """The caller waits anyway: drive a pooled connection from its thread, as a plain
        request/response socket loop would, with no thread handoff. Socket timeouts follow the
        earliest deadline, so this returns by then (plus one syscall) at the latest.

        Each slice's outcome goes to its ``complete``; with ``report`` False (one slice) it is
        returned instead."""
        key = (peer.name, addr)
        # an engine's batch shares one deadline; a retried slice comes alone
        deadline = slices[0].deadline if len(slices) == 1 else min(s.deadline for s in slices)
        with self._lock:
            pool = self._idle.get(key)
            conn = pool.pop() if pool else None
        if conn is None:
            path = f"tcp {addr} direct"
            try:
                sock = open_connection(self.ctx, peer.name, addr, path, deadline)
            except MooncakeConnectorsError as exc:
                if not report:
                    return exc
                for s in slices:
                    s.complete(exc)
                return None
            conn = _Direct(sock, path)
        conn.deadline = deadline
        done = 0
        err: MooncakeConnectorsError | None = None
        result: MooncakeConnectorsError | None = None
        sock = conn.sock
        try:
            if len(slices) == 1:
                result = _exchange_one(conn, slices[0], peer.name)
                done = 1
                if report:
                    slices[0].complete(result)
            else:
                for chunk in _chunks(slices):
                    for s in chunk:
                        s.path = conn.path
                    conn.bound(deadline - time.monotonic())
                    bufs, rids = frame(chunk, conn.ids)
                    wire.sendmsg_all(sock, bufs, conn.rebound)
                    for s, rid in zip(chunk, rids, strict=True):
                        conn.rebound()  # each wait gets what is left of the deadline, no more
                        k = sock.recv_into(conn.hv, _RESP_SIZE, _WAITALL)
                        if k != _RESP_SIZE:  # short (signal) or 0 (peer closed: raises)
                            wire.recv_exact(sock, conn.hv[k:] if k else conn.hv, conn.rebound)
                        result = finish_response(
                            sock, conn.hdr, s, rid, peer.name, conn.path, conn.rebound
                        )
                        done += 1
                        if report:
                            s.complete(result)
        except (TimeoutError, BlockingIOError):
            err = TransferTimeout(
                "deadline passed on a direct tcp connection", peer=peer.name, path=conn.path
            )
        except (OSError, ConnectionError) as exc:
            err = TransportBroken(f"connection lost: {exc}", peer=peer.name, path=conn.path)
        except MooncakeConnectorsError as exc:
            err = exc
        if err is not None:
            sock.close()
            if not report:
                return err
            for s in slices[done:]:
                s.complete(err)
            return None
        with self._lock:
            pool = self._idle.setdefault(key, [])
            if self._closed or len(pool) >= _DIRECT_POOL:
                sock.close()
            else:
                pool.append(conn)
        return result

    def _forget(self, lane: _Lane) -> None:
        with self._lock:
            if self._lanes.get((lane.peer, lane.index)) is lane:
                del self._lanes[(lane.peer, lane.index)]

    def abort(self, peer_name: str, lane: int) -> None:
        self._staged.abort(peer_name)
        ln = self._lanes.get((peer_name, lane))
        if ln is not None:
            ln._break(
                TransportBroken(
                    "lane aborted after a missed deadline", peer=peer_name, path=ln.path
                )
            )

    def close(self) -> None:
        with self._lock:
            self._closed = True
            lanes = list(self._lanes.values())
            idle = [c for pool in self._idle.values() for c in pool]
            self._idle.clear()
        for c in idle:
            c.sock.close()
        for ln in lanes:
            ln.close()
        self._staged.close()
        if self._server is not None:
            self._server.close()
        if cuda_driver.loaded():
            self._staging.close()


@hookimpl
def mooncake_transport() -> type[Transport]:
    return TcpTransport


__all__ = ["TcpTransport"]
