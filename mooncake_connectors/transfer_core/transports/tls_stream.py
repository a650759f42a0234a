"""A TLS connection behind the part of the socket API the ``tcp`` transport uses.

Why not hand the transport an ``ssl.SSLSocket``: a lane reads and writes one connection from two
threads, and OpenSSL does not allow two threads in one connection's state at once; an SSLSocket
also refuses ``MSG_WAITALL`` and ``sendmsg``, and a kernel receive timeout surfaces from it as
``SSLWantReadError`` rather than ``BlockingIOError``. Here the socket is non-blocking, every
OpenSSL call holds one lock (a record's worth of work, never a wait), and waiting is a poll() on
the descriptor outside the lock. The transport's timeouts keep their meaning: ``settimeout``
bounds a call and then raises TimeoutError; SO_RCVTIMEO/SO_SNDTIMEO (the transport's kernel
tick) bound a call and then return what arrived, or raise BlockingIOError when nothing did.

Receives decrypt straight into the caller's buffer (registered memory too). A write that
OpenSSL could not finish must be retried with the same bytes; ``sendmsg`` reports progress only
at the boundaries of the pieces it hands OpenSSL, and cuts a buffer list into pieces the same
way whatever offset the caller resumes from, so a caller retrying "the rest" retries that piece.
"""

from __future__ import annotations

import errno
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Iterator, Sequence

_SMALL = 64 * 1024  # buffers below this are joined: one record, not one per request header
_PIECE = 256 * 1024  # at most this much per OpenSSL call, so a reader never waits long
_TV = struct.Struct("ll")


class TlsStream:
    def __init__(self, ssock: ssl.SSLSocket, *, mutual: bool) -> None:
        self.mutual = mutual  # both sides verified each other's certificate against the CA
        self._s = ssock
        ssock.setblocking(False)
        self._fd = ssock.fileno()
        self._lock = threading.Lock()
        self._timeout: float | None = None  # settimeout: TimeoutError when it passes
        self._tick: float | None = None  # SO_RCVTIMEO/SO_SNDTIMEO: BlockingIOError

    # -- the socket API the transport uses -----------------------------------------------------
    def fileno(self) -> int:
        return self._fd

    def gettimeout(self) -> float | None:
        return self._timeout

    def settimeout(self, timeout: float | None) -> None:
        self._timeout = timeout

    def setsockopt(self, level: int, option: int, value: int | bytes) -> None:
        if (
            level == socket.SOL_SOCKET
            and option in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO)
            and isinstance(value, bytes)
        ):
            sec, usec = _TV.unpack(value)
            self._tick = (sec + usec / 1e6) or None  # 0: no timeout, as for the kernel
            return
        self._s.setsockopt(level, option, value)

    def recv_into(self, buffer: memoryview | bytearray, nbytes: int = 0, flags: int = 0) -> int:
        view = memoryview(buffer).cast("B")
        n = nbytes or len(view)
        waitall = bool(flags & socket.MSG_WAITALL)
        end = self._end()
        got = 0
        while got < n:
            with self._lock:
                try:
                    k = self._s.recv_into(view[got:n], n - got)
                    want = 0
                except ssl.SSLWantReadError:
                    k, want = -1, select.POLLIN
                except ssl.SSLWantWriteError:
                    k, want = -1, select.POLLOUT
                except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                    k = 0
            if k == 0:
                return got
            if k > 0:
                got += k
                if not waitall:
                    return got
                continue
            if not self._wait(want, end):
                if got:
                    return got
                raise self._timed_out()
        return got

    def sendmsg(self, buffers: Sequence[memoryview | bytes]) -> int:
        end = self._end()
        sent = 0
        for piece in _pieces(buffers):
            while True:
                with self._lock:
                    try:
                        self._s.send(piece)
                        break
                    except ssl.SSLWantWriteError:
                        want = select.POLLOUT
                    except ssl.SSLWantReadError:
                        want = select.POLLIN
                if not self._wait(want, end):
                    if sent:
                        return sent
                    raise self._timed_out()
            sent += len(piece)
        return sent

    def send(self, data: bytes | memoryview) -> int:
        return self.sendmsg([data])

    def sendall(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while view:
            view = view[self.sendmsg([view]) :]

    def shutdown(self, how: int) -> None:
        # The plain socket's shutdown: SSLSocket.shutdown drops its TLS state, which would let
        # a reader in another thread go on reading ciphertext as if it were data.
        socket.socket.shutdown(self._s, how)

    def close(self) -> None:
        self._s.close()

    # -- waiting -------------------------------------------------------------------------------
    def _end(self) -> float | None:
        limit = self._timeout if self._timeout is not None else self._tick
        return None if limit is None else time.monotonic() + limit

    def _wait(self, events: int, end: float | None) -> bool:
        """Until the descriptor is ready for ``events`` (True) or ``end`` passes (False)."""
        if end is None:
            ms = -1
        else:
            left = end - time.monotonic()
            if left <= 0:
                return False
            ms = max(1, int(left * 1000))
        poller = select.poll()
        poller.register(self._fd, events)
        poller.poll(ms)
        return True  # readiness or not, the caller tries again and then checks the time

    def _timed_out(self) -> OSError:
        if self._timeout is not None:
            return TimeoutError("timed out")
        return BlockingIOError(errno.EAGAIN, "no progress within the socket's timeout")


def _pieces(buffers: Sequence[memoryview | bytes]) -> Iterator[bytes | memoryview]:
    """Small buffers joined, large ones cut: a function of the buffers from the first one on."""
    small: list[bytes | memoryview] = []
    size = 0
    for buf in buffers:
        if not len(buf):
            continue
        if len(buf) < _SMALL:
            if size + len(buf) > _SMALL and small:
                yield b"".join(small)
                small, size = [], 0
            small.append(buf)
            size += len(buf)
            continue
        if small:
            yield b"".join(small)
            small, size = [], 0
        view = memoryview(buf).cast("B")
        for i in range(0, len(view), _PIECE):
            yield view[i : i + _PIECE]
    if small:
        yield b"".join(small)
