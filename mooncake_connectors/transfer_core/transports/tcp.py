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
import threading
import time
from collections.abc import Sequence
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
from .fast import tcp as fast
from .staging import Staging
from .tcp_direct import DirectRunner
from .tcp_server import TLS_ENDPOINT, TcpServer, _tune
from .tcp_staged import StagedTcp
from .tls_stream import TlsStream

log = logging.getLogger(__name__)

_COALESCE = 64  # most requests one sendmsg carries
_INLINE_PAYLOAD = 256 * 1024  # WRITE bytes an async submit may send from the caller's thread
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
            bufs, rids = wire.frame(batch, self.ids)
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
                err = wire.finish_response(sock, hdr, s, want, self.peer, self.path)
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


class TcpSettings(TransportSettings, frozen=True, forbid_unknown_fields=True):
    """``transport_settings["tcp"]``. lanes: connections per peer (default: the engine's
    ``tcp_lanes``). A synchronous transfer of ``stripe_min`` bytes or more in one direction is
    cut into ``stripes`` portions moved on as many connections at once (1: never)."""

    lanes: int | None = None
    stripes: int = 2
    stripe_min: int = 16 << 20
    # GPU memory crosses tcp through a pool of pinned host buffers: this many, of this size.
    staging_chunk: int = 1 << 20
    staging_buffers: int = 16

    def __post_init__(self) -> None:
        if self.lanes is not None and not 1 <= self.lanes <= 64:
            raise ConfigError(f"tcp lanes must be in 1..64, got {self.lanes}", transport="tcp")
        if not 4096 <= self.staging_chunk <= 1 << 30:
            raise ConfigError("tcp staging_chunk must be in 4 KiB..1 GiB", transport="tcp")
        if not 1 <= self.stripes <= 16:
            raise ConfigError(f"tcp stripes must be in 1..16, got {self.stripes}", transport="tcp")
        if self.stripe_min < 64 * 1024:
            raise ConfigError("tcp stripe_min must be at least 64 KiB", transport="tcp")
        if not 1 <= self.staging_buffers <= 1024:
            raise ConfigError("tcp staging_buffers must be in 1..1024", transport="tcp")


class TcpTransport(Transport):
    name = "tcp"
    Settings = TcpSettings
    orders_after = True  # GPU slices stage on a copy stream that waits for their fence

    def __init__(self, ctx: TransportContext) -> None:
        super().__init__(ctx)
        self.settings = load_settings(TcpSettings, self.name, ctx.config)
        self._lane_count = self.settings.lanes or ctx.config.tcp_lanes
        self._staging = Staging(self.settings.staging_chunk, self.settings.staging_buffers)
        self._staged = StagedTcp(self, self._staging, self._lane_count)
        self._server: TcpServer | None = None
        self._lanes: dict[tuple[str, int], _Lane] = {}
        self._direct = DirectRunner(
            lambda peer, addr, path, deadline: open_connection(ctx, peer, addr, path, deadline),
            self.settings.stripes,
            self.settings.stripe_min,
        )
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

    def prepare(self, peer: SegmentDesc, timeout: float) -> None:
        addr = peer.endpoints.get("tcp")
        if addr is None or self._closed:
            return
        if TLS_ENDPOINT in peer.endpoints and self.ctx.config.tls is None:
            return  # its transfers are refused (with the reason)
        self._direct.prepare(peer.name, addr, min(timeout, self.ctx.config.connect_timeout))

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

    runs_one = fast is not None  # (without the compiled loops the general way is as short)

    def run_one(
        self,
        peer: SegmentDesc,
        op: TransferOp,
        remote: int,
        local: int,
        length: int,
        deadline: float,
    ) -> MooncakeConnectorsError | bool:
        if self._closed or TLS_ENDPOINT in peer.endpoints:  # (TLS: the Python loops only)
            return False
        code = wire.OP_WRITE if op is TransferOp.WRITE else wire.OP_READ
        addr = peer.endpoints["tcp"]
        return self._direct.one(peer.name, addr, code, remote, local, length, deadline)

    def _run_direct(
        self, peer: SegmentDesc, addr: str, slices: Sequence[Slice], report: bool = True
    ) -> MooncakeConnectorsError | None:
        """The caller waits anyway: drive pooled connections from its thread (``tcp_direct``)."""
        return self._direct.run(peer, addr, slices, report)

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
        self._direct.close()
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
