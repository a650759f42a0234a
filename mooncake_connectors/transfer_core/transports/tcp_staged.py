"""The initiator side of ``tcp`` for slices whose local memory is a GPU's.

Such a slice never becomes a memoryview (that would read device memory as host memory). A small
pool of worker threads, each with its own connection per peer, sends the usual request frame and
moves the payload through ``staging.Pipe``: a WRITE's chunks are copied device-to-host ahead of
the send, a READ's chunks host-to-device behind the receive. The target serves the frame like any
other; if the target's region is a GPU's too, it stages on its side the same way.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import socket
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ...errors import (
    GpuError,
    MooncakeConnectorsError,
    ProtocolError,
    TransferTimeout,
    TransportBroken,
    TransportClosed,
)
from ...types import TransferOp
from ..descriptor import SegmentDesc
from ..transport import Slice
from . import wire
from .staging import Staging, receiver, sender
from .tcp_direct import kernel_timeout

if TYPE_CHECKING:
    from .tcp import TcpTransport

log = logging.getLogger(__name__)


class StagedTcp:
    """Workers that move GPU slices over tcp connections of their own."""

    def __init__(self, owner: TcpTransport, staging: Staging, workers: int) -> None:
        self.owner = owner
        self.staging = staging
        self.n_workers = workers
        self.q: queue.SimpleQueue[tuple[SegmentDesc, Slice] | None] = queue.SimpleQueue()
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()
        self.closed = False
        self._tls = threading.local()
        self._socks: list[tuple[str, socket.socket]] = []  # (peer name, socket), all workers

    def submit(self, peer: SegmentDesc, slices: Sequence[Slice]) -> None:
        # Always through the workers, even for a caller that waits: streams and pinned
        # buffers belong to a fixed set of threads, not to every thread that ever called.
        self._start()
        for s in slices:
            self.q.put((peer, s))

    def _start(self) -> None:
        if len(self.threads) >= self.n_workers:
            return
        with self.lock:
            while len(self.threads) < self.n_workers and not self.closed:
                t = threading.Thread(target=self._work, name="mc-tcp-staged", daemon=True)
                t.start()
                self.threads.append(t)

    def _work(self) -> None:
        try:
            while True:
                item = self.q.get()
                if item is None:
                    return
                self._run(*item)
        finally:
            self._drop_socks()
            with contextlib.suppress(GpuError):
                self.staging.release_thread()

    def _sock(self, peer: SegmentDesc, deadline: float) -> socket.socket:
        socks: dict[str, socket.socket] | None = getattr(self._tls, "socks", None)
        if socks is None:
            socks = self._tls.socks = {}
        addr = peer.endpoints["tcp"]
        sock = socks.get(addr)
        if sock is None:
            from .tcp import open_connection

            path = f"tcp {addr} staged"
            sock = open_connection(self.owner.ctx, peer.name, addr, path, deadline)
            socks[addr] = sock
            with self.lock:
                self._socks.append((peer.name, sock))
        return sock

    def _drop_socks(self, addr: str | None = None) -> None:
        socks: dict[str, socket.socket] = getattr(self._tls, "socks", None) or {}
        for a in [a for a in socks if addr is None or a == addr]:
            sock = socks.pop(a)
            with self.lock:
                self._socks = [(p, k) for p, k in self._socks if k is not sock]
            sock.close()

    def _run(self, peer: SegmentDesc, s: Slice) -> None:
        addr = peer.endpoints["tcp"]
        s.path = f"tcp {addr} staged"
        if self.closed:
            s.complete(TransportClosed("tcp transport closed", peer=peer.name))
            return
        try:
            err = self._move(peer, s)
        except MooncakeConnectorsError as exc:
            self._drop_socks(addr)
            err = exc
        except (OSError, ConnectionError) as exc:
            self._drop_socks(addr)
            late = time.monotonic() >= s.deadline
            err = (
                TransferTimeout("staged transfer missed its deadline", peer=peer.name)
                if late
                else TransportBroken(f"staged transfer failed: {exc}", peer=peer.name)
            )
        s.complete(err)

    def _move(self, peer: SegmentDesc, s: Slice) -> MooncakeConnectorsError | None:
        sock = self._sock(peer, s.deadline)
        left = s.deadline - time.monotonic()
        if left <= 0:
            raise TransferTimeout("deadline passed before sending", peer=peer.name)
        kernel_timeout(sock, left)
        pipe = self.staging.pipe(s.local_device)
        rid = next(_ids)
        write = s.op is TransferOp.WRITE
        op = wire.OP_WRITE if write else wire.OP_READ
        sock.sendall(wire.REQ.pack(wire.REQ_MAGIC, op, 0, 0, rid, s.remote_addr, s.length))
        if write:
            pipe.to_network(s.local_addr, s.length, sender(sock), s.deadline, s.after)
        hdr = bytearray(wire.RESP.size)
        wire.recv_exact(sock, memoryview(hdr))
        magic, status, _, _, got_rid, length = wire.RESP.unpack(hdr)
        if magic != wire.RESP_MAGIC or got_rid != rid:
            raise ProtocolError("bad response frame", peer=peer.name, path=s.path)
        if status != wire.ST_OK:
            if length > wire.MAX_ERROR_MESSAGE:
                raise ProtocolError("oversized error message", peer=peer.name, path=s.path)
            msg = bytearray(length)
            wire.recv_exact(sock, memoryview(msg))
            text = msg.decode(errors="replace")
            return wire.error_from_status(status, text, peer=peer.name, path=s.path)
        if not write:
            if length != s.length:
                raise ProtocolError("READ answered with a wrong length", peer=peer.name)
            recv = receiver(sock, wire.recv_exact)
            pipe.from_network(s.local_addr, s.length, recv, s.deadline, s.after)
        return None

    def abort(self, peer_name: str) -> None:
        """A slice to ``peer_name`` missed its deadline: cut that peer's connections, so the
        workers stop moving bytes for it (a READ's copies already queued still land)."""
        with self.lock:
            socks = [k for p, k in self._socks if p == peer_name]
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with self.lock:
            self.closed = True
            socks = [k for _, k in self._socks]
        for sock in socks:  # wakes workers blocked on a peer
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for _ in self.threads:
            self.q.put(None)
        for t in self.threads:
            t.join(timeout=5)
        while True:
            try:
                item = self.q.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[1].complete(TransportClosed("tcp transport closed", peer=item[0].name))


_ids = itertools.count(1)
