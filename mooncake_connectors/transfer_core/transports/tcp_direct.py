"""Direct tcp connections: the caller that waits anyway drives the socket itself.

A synchronous transfer needs no sender/receiver threads: the calling thread takes a pooled
connection, sends a chunk of requests and reads their answers (READ data lands straight in
place), as a plain request/response socket loop would. Socket timeouts follow the earliest
deadline, so a call returns by then (plus one syscall) at the latest.

A large transfer (``stripe_min`` bytes or more, one direction) is *striped*: cut into
``stripes`` contiguous portions of about equal size, each driven on its own connection, the
first by the caller and the others by stripe workers. One TCP stream's copies run on one core
at each end; on the project's 2-core machine one loopback stream moved 16 MiB at 2.3-3.6 GB/s
and two in parallel at 5.0-5.7 GB/s. A portion no worker has started when the caller is done
with its own is run by the caller, so a busy worker never delays anyone by more than its
current portion.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from ...errors import MooncakeConnectorsError, ProtocolError, TransferTimeout, TransportBroken
from ...types import TransferOp
from ..descriptor import SegmentDesc
from ..transport import Slice
from . import wire
from .fast import tcp as fast

_WAITALL = socket.MSG_WAITALL
_RESP_SIZE = wire.RESP.size
_REQ = wire.REQ
_REQ_SIZE = wire.REQ.size
_CHUNK = 512  # requests sent before their answers are read
_POOL = 8  # idle connections kept per peer
_ALIGN = 4096  # portion boundaries fall on pages: the copies on both ends stay aligned
_GRACE = 2.0  # seconds past the deadline a caller waits for a worker's portion
# SO_RCVTIMEO/SO_SNDTIMEO run on the kernel's timer wheel, which fires a long timeout late by up
# to an eighth of it (a 30 s one 1.7-1.9 s late at HZ=250, 20 s: 0.96 s). No kernel timeout is
# set longer than this: a longer wait is a run of short ones, each bounded again by what is left
# of the deadline (``rebound``; the compiled loop waits the rest by poll(), which is precise).
KERNEL_MAX = 1.0

Connect = Callable[[str, str, str, float], socket.socket]
log = logging.getLogger(__name__)


class Direct:
    """A connection driven by one waiting caller at a time: send a chunk, read its answers."""

    def __init__(self, sock: socket.socket, path: str) -> None:
        self.sock = sock
        self.path = path
        self.ids = itertools.count(1)
        self.hdr = bytearray(wire.RESP.size)
        self.hv = memoryview(self.hdr)
        self.timeout = -1.0  # kernel timeout currently set, seconds
        self.deadline = 0.0  # of the call driving it now (monotonic)
        # the compiled loop drives plain sockets (a TLS stream goes through Python's ssl)
        self.fd = sock.fileno() if fast is not None and type(sock) is socket.socket else -1

    def bound(self, seconds: float) -> None:
        """Bound each send/recv by ``seconds``, at most KERNEL_MAX. Requests in a row have
        nearly equal deadlines, so the two setsockopt calls are skipped while the bound already
        set is within [-1 s, +0.05 s] of the wanted one (a wait may end up to 0.05 s late)."""
        seconds = min(seconds, KERNEL_MAX)
        if -0.05 < seconds - self.timeout < 1.0:
            return
        kernel_timeout(self.sock, seconds)
        self.timeout = max(seconds, 0.001)

    def rebound(self) -> None:
        """Bound the next send/recv by what is left of ``deadline``; TimeoutError if nothing."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request's deadline passed")
        self.bound(left)


def kernel_timeout(sock: socket.socket, seconds: float) -> None:
    """Bound each blocking send/recv by the kernel (SO_RCVTIMEO/SO_SNDTIMEO). Python's own
    ``settimeout`` would switch the socket to non-blocking mode plus poll() before every call,
    which splits MSG_WAITALL receives and costs tens of microseconds per request."""
    seconds = max(seconds, 0.001)
    tv = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def exchange_one(conn: Direct, s: Slice, peer: str) -> MooncakeConnectorsError | None:
    """One slice on a direct connection: what ``frame`` and the chunk loop of
    ``DirectRunner.run_on`` do, without their lists (the common synchronous request)."""
    sock = conn.sock
    s.path = conn.path
    conn.bound(conn.deadline - time.monotonic())
    rid = next(conn.ids)
    if conn.fd >= 0:
        assert fast is not None
        s.local_view()  # host memory only: raises for GPU memory, as the Python loop does
        op = wire.OP_WRITE if s.op is TransferOp.WRITE else wire.OP_READ
        got = fast.exchange(conn.fd, op, rid, s.remote_addr, s.local_addr, s.length, conn.deadline)
        return None if got == 0 else _compiled_outcome(conn, got, rid, peer)
    if s.op is TransferOp.WRITE:
        head = _REQ.pack(wire.REQ_MAGIC, wire.OP_WRITE, 0, 0, rid, s.remote_addr, s.length)
        payload = s.local_view()
        sent = wire.send_some(sock, [head, payload], conn.rebound)
        if sent != _REQ_SIZE + s.length:
            rest: list[memoryview | bytes] = (
                [head[sent:], payload] if sent < _REQ_SIZE else [payload[sent - _REQ_SIZE :]]
            )
            conn.rebound()
            wire.sendmsg_all(sock, rest, conn.rebound)
    else:
        head = _REQ.pack(wire.REQ_MAGIC, wire.OP_READ, 0, 0, rid, s.remote_addr, s.length)
        sent = wire.send_some(sock, [head], conn.rebound)
        if sent != _REQ_SIZE:
            conn.rebound()
            wire.sendmsg_all(sock, [memoryview(head)[sent:]], conn.rebound)
    conn.rebound()  # the wait gets what is left of the deadline, no more
    k = wire.recv_some(sock, conn.hv, _RESP_SIZE, conn.rebound)
    if k != _RESP_SIZE:  # short (signal) or 0 (peer closed: recv_exact raises)
        wire.recv_exact(sock, conn.hv[k:] if k else conn.hv, conn.rebound)
    return wire.finish_response(sock, conn.hdr, s, rid, peer, conn.path, conn.rebound)


def _compiled_outcome(
    conn: Direct, got: int | tuple[int, bytes], rid: int, peer: str
) -> MooncakeConnectorsError | None:
    """What the compiled exchange's outcome means, as the Python loop reports it: the peer's
    error, or the exception that ends the connection."""
    assert fast is not None
    if isinstance(got, tuple):
        status, message = got
        return wire.error_from_status(
            status, message.decode(errors="replace"), peer=peer, path=conn.path
        )
    if got == fast.TIMEOUT:
        raise TimeoutError("the request's deadline passed")
    if got == fast.PROTOCOL:
        raise ProtocolError(f"bad response frame (expected id {rid})", peer=peer, path=conn.path)
    if got == fast.CLOSED:
        raise ConnectionError("the peer closed the connection")
    err = fast.last_errno()
    raise OSError(err, os.strerror(err) if err else "socket error")


def chunks(slices: Sequence[Slice]) -> Iterator[Sequence[Slice]]:
    """Runs of one op, at most _CHUNK long. Mixing a big WRITE after a READ in one chunk
    could deadlock (both sides blocked sending); within a run one direction carries only
    headers, which the socket buffers absorb."""
    start = 0
    for i in range(1, len(slices) + 1):
        if i == len(slices) or slices[i].op is not slices[start].op or i - start >= _CHUNK:
            yield slices[start:i]
            start = i


class _Piece(Slice):
    """Part of a striped slice: completes into itself, read once every portion is over."""

    __slots__ = ("error", "finished")

    def __init__(self, s: Slice, off: int, n: int) -> None:
        super().__init__(s.op, s.local_addr + off, s.remote_addr + off, n, s.deadline, _noted)
        self.local_mv = s.local_view()[off : off + n]
        self.finished = False
        self.error: MooncakeConnectorsError | None = None


def _noted(p: Slice, err: MooncakeConnectorsError | None) -> None:
    assert isinstance(p, _Piece)
    p.error, p.finished = err, True


class _Job:
    """One portion of a striped transfer, for whichever thread claims it first."""

    __slots__ = ("addr", "claimed", "conn", "done", "peer", "pieces")

    def __init__(self, peer: str, addr: str, pieces: list[_Piece]) -> None:
        self.peer = peer
        self.addr = addr
        self.pieces = pieces
        self.claimed = False  # under DirectRunner._lock
        self.conn: Direct | None = None  # the connection a worker drives it on
        self.done = threading.Event()


def portions(slices: Sequence[Slice], k: int) -> list[list[_Piece]]:
    """``slices`` cut into ``k`` runs of about equal byte count, in order (pieces of one slice
    stay contiguous; a cut falls on a page boundary of the run)."""
    total = sum(s.length for s in slices)
    per = -(-total // k)
    per += -per % _ALIGN
    out: list[list[_Piece]] = [[]]
    room = per
    for s in slices:
        off = 0
        while off < s.length:
            if room == 0:
                out.append([])
                room = per
            n = min(room, s.length - off)
            out[-1].append(_Piece(s, off, n))
            off += n
            room -= n
    return out


class DirectRunner:
    """Pooled direct connections per peer, and the stripe workers of this transport."""

    def __init__(self, connect: Connect, stripes: int, stripe_min: int) -> None:
        self.connect = connect  # (peer, addr, path, deadline) -> a handshaken blocking socket
        self.stripes = stripes
        self.stripe_min = stripe_min
        self._idle: dict[tuple[str, str], list[Direct]] = {}
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._workers = 0
        self.threads: list[threading.Thread] = []  # the stripe workers started (for tests)
        self.connects = 0  # connections a transfer had to open itself (none pooled)
        self._closed = False

    def run(
        self, peer: SegmentDesc, addr: str, slices: Sequence[Slice], report: bool = True
    ) -> MooncakeConnectorsError | None:
        """Move ``slices`` from this thread. Each slice's outcome goes to its ``complete``; with
        ``report`` False (one slice) it is returned instead."""
        if (
            self.stripes > 1
            and (slices[0].length if len(slices) == 1 else sum(s.length for s in slices))
            >= self.stripe_min
            and all(s.op is slices[0].op for s in slices)
        ):
            return self._striped(peer.name, addr, slices, report)
        return self.run_on(peer.name, addr, slices, report)

    def _striped(
        self, peer: str, addr: str, slices: Sequence[Slice], report: bool
    ) -> MooncakeConnectorsError | None:
        parts = portions(slices, self.stripes)
        jobs = [_Job(peer, addr, p) for p in parts[1:]]
        self._start_workers(len(jobs))
        for job in jobs:
            self._jobs.put(job)
        self.run_on(peer, addr, parts[0])
        deadline = min(s.deadline for s in slices)
        for job in jobs:
            with self._lock:
                mine = not job.claimed
                job.claimed = True
            if mine:  # no worker got to it: run it here rather than wait
                self.run_on(peer, addr, job.pieces)
            else:
                self._await(job, deadline)
        path = f"tcp {addr} direct x{len(parts)}"
        result: MooncakeConnectorsError | None = None
        pieces = iter(p for part in parts for p in part)
        for s in slices:
            s.path = path
            err: MooncakeConnectorsError | None = None
            got = 0
            while got < s.length:
                p = next(pieces)
                got += p.length
                if err is None:
                    err = p.error if p.finished else _late(peer, path)
            result = err
            if report:
                s.complete(err)
        return None if report else result

    def _start_workers(self, want: int) -> None:
        """At least ``want`` stripe workers running (none once closed)."""
        with self._lock:
            start = 0 if self._closed else max(0, want - self._workers)
            self._workers += start
        for _ in range(start):
            worker = threading.Thread(
                target=self._work, name=f"mc-tcp-stripe-{len(self.threads)}", daemon=True
            )
            self.threads.append(worker)
            worker.start()
            log.debug("tcp direct: stripe worker %s started", worker.name)

    def prepare(self, peer: str, addr: str, timeout: float) -> int:
        """Before the first transfer that needs them: the stripe workers, and as many idle
        connections to ``addr`` pooled as a striped transfer drives at once, so the first large
        transfer to a peer neither starts threads nor connects and handshakes (each a round of
        interpreter-lock hand-offs on a busy engine's process at both ends). Returns the
        connections opened; stops at the first that fails (a transfer then connects anew)."""
        if self.stripes > 1:
            self._start_workers(self.stripes - 1)
        key = (peer, addr)
        want = min(self.stripes, _POOL)
        opened = 0
        path = f"tcp {addr} direct"
        for _ in range(want):
            with self._lock:
                if self._closed or len(self._idle.get(key, ())) >= want:
                    break
            t0 = time.perf_counter()
            try:
                sock = self.connect(peer, addr, path, time.monotonic() + timeout)
            except MooncakeConnectorsError as exc:
                log.debug("tcp direct: preparing connections to %s failed: %s", addr, exc)
                break
            ms = 1e3 * (time.perf_counter() - t0)
            log.debug("tcp direct: connected to %s ahead of transfers in %.1f ms", addr, ms)
            self._park(key, Direct(sock, path))
            opened += 1
        return opened

    def _await(self, job: _Job, deadline: float) -> None:
        """Wait for a worker's portion. Its socket timeouts follow the deadline, so this
        returns in time; if not, the socket is shut so no late byte can land afterwards."""
        if job.done.wait(max(0.0, deadline - time.monotonic()) + _GRACE):
            return
        conn = job.conn
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)
        job.done.wait(_GRACE)

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            with self._lock:
                if job.claimed:
                    continue
                job.claimed = True
            try:
                self.run_on(job.peer, job.addr, job.pieces, job=job)
            finally:
                job.done.set()

    def run_on(
        self,
        peer: str,
        addr: str,
        slices: Sequence[Slice],
        report: bool = True,
        job: _Job | None = None,
    ) -> MooncakeConnectorsError | None:
        """``slices`` on one pooled connection, driven from this thread."""
        key = (peer, addr)
        # an engine's batch shares one deadline; a retried slice comes alone
        deadline = slices[0].deadline if len(slices) == 1 else min(s.deadline for s in slices)
        conn = self._take(key)
        if conn is None:
            path = f"tcp {addr} direct"
            t0 = time.perf_counter()
            try:
                sock = self.connect(peer, addr, path, deadline)
            except MooncakeConnectorsError as exc:
                if not report:
                    return exc
                for s in slices:
                    s.complete(exc)
                return None
            conn = Direct(sock, path)
            self.connects += 1
            ms = 1e3 * (time.perf_counter() - t0)
            log.debug("tcp direct: connected to %s in a transfer in %.1f ms", addr, ms)
        if job is not None:
            job.conn = conn
        conn.deadline = deadline
        done = 0
        err: MooncakeConnectorsError | None = None
        result: MooncakeConnectorsError | None = None
        sock = conn.sock
        try:
            if len(slices) == 1:
                result = exchange_one(conn, slices[0], peer)
                done = 1
                if report:
                    slices[0].complete(result)
            else:
                for chunk in chunks(slices):
                    for s in chunk:
                        s.path = conn.path
                    conn.bound(deadline - time.monotonic())
                    bufs, rids = wire.frame(chunk, conn.ids)
                    wire.sendmsg_all(sock, bufs, conn.rebound)
                    for s, rid in zip(chunk, rids, strict=True):
                        conn.rebound()  # each wait gets what is left of the deadline, no more
                        k = wire.recv_some(sock, conn.hv, _RESP_SIZE, conn.rebound)
                        if k != _RESP_SIZE:  # short (signal) or 0 (peer closed: raises)
                            wire.recv_exact(sock, conn.hv[k:] if k else conn.hv, conn.rebound)
                        result = wire.finish_response(
                            sock, conn.hdr, s, rid, peer, conn.path, conn.rebound
                        )
                        done += 1
                        if report:
                            s.complete(result)
        except (TimeoutError, BlockingIOError, OSError, MooncakeConnectorsError) as exc:
            err = _ended(exc, peer, conn.path)
        if err is not None:
            sock.close()
            if not report:
                return err
            for s in slices[done:]:
                s.complete(err)
            return None
        self._park(key, conn)
        return result

    def _take(self, key: tuple[str, str]) -> Direct | None:
        """An idle pooled connection to ``key`` (peer, address), or None."""
        with self._lock:
            pool = self._idle.get(key)
            return pool.pop() if pool else None

    def _park(self, key: tuple[str, str], conn: Direct) -> None:
        """Back to the pool after a clean exchange (closed when the pool is full or closed)."""
        with self._lock:
            pool = self._idle.setdefault(key, [])
            if self._closed or len(pool) >= _POOL:
                conn.sock.close()
            else:
                pool.append(conn)

    def one(
        self, peer: str, addr: str, op: int, remote: int, local: int, n: int, deadline: float
    ) -> MooncakeConnectorsError | bool:
        """One request of ``n`` bytes of host memory at ``local`` (checked by the caller), driven
        by the compiled exchange on an idle pooled connection: True when done, the error the
        peer or the connection gave, or False, having done nothing, when no idle plain
        connection is pooled (or nothing is compiled): then the caller takes the general way."""
        if fast is None or (self.stripes > 1 and n >= self.stripe_min):
            return False
        key = (peer, addr)
        conn = self._take(key)
        if conn is None:
            return False
        result: MooncakeConnectorsError | bool = True
        try:
            if conn.fd < 0:
                result = False
            else:
                conn.deadline = deadline
                conn.bound(deadline - time.monotonic())
                rid = next(conn.ids)
                got = fast.exchange(conn.fd, op, rid, remote, local, n, deadline)
                if got != 0:
                    result = _compiled_outcome(conn, got, rid, peer) or True
        except (TimeoutError, BlockingIOError, OSError, MooncakeConnectorsError) as exc:
            conn.sock.close()
            return _ended(exc, peer, conn.path)
        self._park(key, conn)
        return result

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle = [c for pool in self._idle.values() for c in pool]
            self._idle.clear()
            workers, self._workers = self._workers, 0
        for c in idle:
            c.sock.close()
        for _ in range(workers):
            self._jobs.put(None)


def _ended(exc: BaseException, peer: str, path: str) -> MooncakeConnectorsError:
    """The error a direct connection ends with (it is closed after this)."""
    if isinstance(exc, MooncakeConnectorsError):
        return exc
    if isinstance(exc, TimeoutError | BlockingIOError):
        return TransferTimeout("deadline passed on a direct tcp connection", peer=peer, path=path)
    return TransportBroken(f"connection lost: {exc}", peer=peer, path=path)


def _late(peer: str, path: str) -> TransferTimeout:
    return TransferTimeout("a striped portion did not finish by the deadline", peer=peer, path=path)
