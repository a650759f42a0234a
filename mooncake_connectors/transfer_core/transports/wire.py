"""Wire format of the tcp transport (also used by tests that send malformed frames).

Connection start (server speaks first), a mutual HMAC-SHA256 challenge-response:
    server HELLO   <4sHHI16s   magic b"MCCT", version, flags (bit 0: token required), 0,
                               target nonce
    client AUTH    <4sHH32s16s magic b"MCCT", version, 0, initiator proof or zeros,
                               initiator nonce
    server VERDICT <4sHH32s    magic b"MCCT", status (0 ok, 1 bad token, 2 bad version), 0,
                               target proof or zeros
Both proofs cover both nonces under different labels, so neither side can replay the other's
answer, and the target answers with its proof only to an initiator that proved the token first.
An initiator holding a token refuses a target that does not ask for one or whose proof is wrong,
before any request is sent. HELLO keeps its version-1 layout so that peers of either version
read each other's version and fail with a clear mismatch.
Then pipelined requests, answered in order:
    request  <IBBHQQQ  REQ_MAGIC, op, 0, 0, request id, remote address, length [+ payload if WRITE]
                       (OP_CONTROL: address 0, length and payload of a control message, answered
                       with the listener's reply as payload; used by rdma's connect exchange)
    response <IBBHQQ   RESP_MAGIC, status, 0, 0, request id, length [+ payload: READ data, or an
                       utf-8 error message when status != OK]
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from ...errors import AccessViolation, MooncakeConnectorsError, ProtocolError, TransportBroken
from ...types import TransferOp

if TYPE_CHECKING:
    from ..transport import Slice

_WAITALL = socket.MSG_WAITALL

MAGIC = b"MCCT"
HELLO = struct.Struct("<4sHHI16s")
AUTH_HEAD = struct.Struct("<4sHH")  # what the target checks before reading the rest of AUTH
AUTH = struct.Struct("<4sHH32s16s")
VERDICT = struct.Struct("<4sHH32s")
REQ = struct.Struct("<IBBHQQQ")
RESP = struct.Struct("<IBBHQQ")
REQ_MAGIC = 0x4D435251  # "MCRQ"
RESP_MAGIC = 0x4D435250  # "MCRP"

OP_READ = 0
OP_WRITE = 1
OP_PING = 2
OP_CONTROL = 3  # a control message (payload: msgpack) for a transport's own exchange
MAX_CONTROL = 64 * 1024

ST_OK = 0
ST_ACCESS = 1
ST_PROTOCOL = 2
ST_INTERNAL = 3

VERDICT_OK = 0
VERDICT_BAD_TOKEN = 1
VERDICT_BAD_VERSION = 2

FLAG_AUTH = 1
MAX_PAYLOAD = 1 << 30  # matches the largest slice_size EngineConfig accepts
MAX_ERROR_MESSAGE = 4096

# 1: one-way authentication (initiator only); 2: mutual. Independent of descriptor versions.
VERSION = 2
NONCE = 16


def initiator_proof(token: str | None, target_nonce: bytes, initiator_nonce: bytes) -> bytes:
    return _proof(token, b"mcct-initiator\0", target_nonce, initiator_nonce)


def target_proof(token: str | None, target_nonce: bytes, initiator_nonce: bytes) -> bytes:
    return _proof(token, b"mcct-target\0", target_nonce, initiator_nonce)


def _proof(token: str | None, label: bytes, target_nonce: bytes, initiator_nonce: bytes) -> bytes:
    if not token:
        return bytes(32)
    msg = label + target_nonce + initiator_nonce
    return hmac.new(token.encode(), msg, hashlib.sha256).digest()


def recv_some(
    sock: socket.socket, buf: memoryview, n: int, progress: Callable[[], object] | None
) -> int:
    """One MSG_WAITALL receive of up to ``n`` bytes into ``buf``. A kernel timeout that passes
    with nothing received (EAGAIN) while the caller's deadline has time left is waited again:
    ``progress`` bounds the next wait by what is left, or raises TimeoutError (without it the
    BlockingIOError propagates)."""
    while True:
        try:
            return sock.recv_into(buf, n, _WAITALL)
        except BlockingIOError:
            if progress is None:
                raise
            progress()


def send_some(
    sock: socket.socket, bufs: list[memoryview | bytes], progress: Callable[[], object] | None
) -> int:
    """One ``sendmsg`` of ``bufs``: the bytes sent, re-waiting as ``recv_some`` does."""
    while True:
        try:
            return sock.sendmsg(bufs)
        except BlockingIOError:
            if progress is None:
                raise
            progress()


def recv_exact(
    sock: socket.socket, buf: memoryview, progress: Callable[[], object] | None = None
) -> None:
    """Fill ``buf`` completely from ``sock``; ConnectionError when the peer closes first.

    A socket timeout bounds each receive, and one that times out returns what it has:
    ``progress`` runs before the next one, to bound it by what is left of the caller's deadline
    (or raise TimeoutError), so a peer that stops mid-frame costs the deadline, not another
    timeout per receive."""
    n = len(buf)
    got = 0
    while got < n:
        k = recv_some(sock, buf[got:], n - got, progress)
        if k == 0:
            raise ConnectionError(f"peer closed the connection after {got} of {n} bytes")
        got += k
        if got < n and progress is not None:
            progress()


def recv_until(sock: socket.socket, buf: memoryview, deadline: float) -> None:
    """Fill ``buf`` by ``deadline`` (monotonic), else TimeoutError: a per-recv timeout alone
    lets a peer trickling one byte at a time hold the connection forever. The socket has a
    per-recv timeout (settimeout or SO_RCVTIMEO) so each recv returns in time to check."""
    n = len(buf)
    got = 0
    per_recv = sock.gettimeout()  # None: blocking, SO_RCVTIMEO bounds each recv
    try:
        while got < n:
            if per_recv is not None:  # never wait past the deadline
                sock.settimeout(max(0.001, min(per_recv, deadline - time.monotonic())))
            try:
                k = sock.recv_into(buf[got:], n - got, socket.MSG_WAITALL)
            except (BlockingIOError, TimeoutError):
                k = -1
            if k == 0:
                raise ConnectionError(f"peer closed the connection after {got} of {n} bytes")
            got += max(k, 0)
            if got < n and time.monotonic() >= deadline:
                raise TimeoutError(f"only {got} of {n} bytes arrived within the deadline")
    finally:
        if per_recv is not None:
            sock.settimeout(per_recv)


def _drop_sent(bufs: list[memoryview | bytes], sent: int) -> None:
    """Take the first ``sent`` bytes off ``bufs``: whole buffers, then the head of the next."""
    while sent:
        first = bufs[0]
        if sent >= len(first):
            sent -= len(first)
            bufs.pop(0)
        else:
            bufs[0] = memoryview(first)[sent:]
            sent = 0


def send_until(sock: socket.socket, bufs: list[memoryview | bytes], deadline: float) -> None:
    """``sendmsg_all`` for a socket with SO_SNDTIMEO: TimeoutError at ``deadline`` when the
    peer stops reading."""
    bufs = [b for b in bufs if len(b)]
    while bufs:
        try:
            sent = sock.sendmsg(bufs[:1024])
        except (BlockingIOError, TimeoutError):
            sent = 0
        _drop_sent(bufs, sent)
        if bufs and time.monotonic() >= deadline:
            raise TimeoutError("the peer did not read the answer within the deadline")


def set_io_tick(sock: socket.socket, seconds: float) -> None:
    """Kernel-side timeouts on a blocking socket: each recv/send returns within ``seconds``
    (with what it has, or EAGAIN), with no poll() per call as ``settimeout`` would add."""
    tv = struct.pack("ll", int(seconds), int((seconds % 1) * 1_000_000))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def sendmsg_all(
    sock: socket.socket,
    bufs: list[memoryview | bytes],
    progress: Callable[[], object] | None = None,
) -> None:
    """Send every buffer, in order, with as few syscalls as the kernel allows (``progress``
    runs between partial sends, as in ``recv_exact``)."""
    first_call = True
    while bufs:
        if not first_call and progress is not None:
            progress()
        first_call = False
        sent = send_some(sock, bufs[:1024], progress)
        _drop_sent(bufs, sent)
        # drop empty buffers so sendmsg never spins on zero-length entries
        while bufs and len(bufs[0]) == 0:
            bufs.pop(0)


def error_from_status(
    status: int, message: str, *, peer: str, path: str
) -> MooncakeConnectorsError:
    """The exception for a non-OK response status (one mapping for every framed transport)."""
    if status == ST_ACCESS:
        return AccessViolation(f"peer refused access: {message}", peer=peer, path=path)
    if status == ST_PROTOCOL:
        return ProtocolError(f"peer reported a protocol error: {message}", peer=peer, path=path)
    return TransportBroken(
        f"peer failed the request (status {status}): {message}", peer=peer, path=path
    )


def frame(batch: Sequence[Slice], ids: Iterator[int]) -> tuple[list[memoryview | bytes], list[int]]:
    """Request frames (and WRITE payload views) for ``batch``, with fresh request ids."""
    bufs: list[memoryview | bytes] = []
    rids: list[int] = []
    for b in batch:
        rid = next(ids)
        rids.append(rid)
        if b.op is TransferOp.WRITE:
            bufs.append(REQ.pack(REQ_MAGIC, OP_WRITE, 0, 0, rid, b.remote_addr, b.length))
            bufs.append(b.local_view())
        else:
            bufs.append(REQ.pack(REQ_MAGIC, OP_READ, 0, 0, rid, b.remote_addr, b.length))
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
    magic, status, _, _, rid, length = RESP.unpack(hdr)
    if magic != RESP_MAGIC or rid != want:
        raise ProtocolError(f"bad response frame (id {rid}, expected {want})", peer=peer, path=path)
    if status == ST_OK:
        if s.op is TransferOp.READ:
            if length != s.length:
                raise ProtocolError("READ answered with a wrong length", peer=peer, path=path)
            view = s.local_view()
            # Common case in one syscall; recv_exact only when the kernel splits it.
            k = recv_some(sock, view, length, progress) if length else 0
            if k != length:
                if k and progress is not None:  # the next wait gets what is left, no more
                    progress()
                recv_exact(sock, view[k:] if k else view, progress)
        return None
    if length > MAX_ERROR_MESSAGE:
        raise ProtocolError("oversized error message", peer=peer, path=path)
    msg = bytearray(length)
    recv_exact(sock, memoryview(msg))
    return error_from_status(status, msg.decode(errors="replace"), peer=peer, path=path)
