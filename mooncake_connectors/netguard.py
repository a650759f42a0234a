"""What every listening port shares: accept back-off, rate-limited logs, whole-request deadlines.

A listener must outlive a burst of ``accept()`` failures (EMFILE when connections exhaust the
descriptor limit, ENOBUFS, ECONNABORTED, a firewall's EPERM...): only a closed listener ends its
loop. Retrying at once would spin (a level-triggered listener stays readable while the kernel
queue is full), so failures back off exponentially from ``BACKOFF_MIN`` to ``BACKOFF_MAX`` and are
logged at most once per ``LOG_EVERY`` seconds, with how many were not logged.

A TLS listener (given an ``ssl.SSLContext``) runs each handshake in the connection's own thread,
under the request deadline, so a client that never finishes one holds no one else up.

A per-``recv`` timeout does not stop a client sending one byte per second: request deadlines here
cover a whole request (request line, headers and body), from its first byte.
"""

from __future__ import annotations

import errno
import http.server
import io
import logging
import socket
import ssl
import sys
import threading
import time
from typing import Any

BACKOFF_MIN = 0.01
BACKOFF_MAX = 1.0
LOG_EVERY = 10.0
BACKLOG = min(socket.SOMAXCONN, 4096)
MIN_RATE = 1 << 20  # bytes/s a request's payload must at least arrive at, beyond its grace time
HTTP_REQUEST_TIMEOUT = 10.0  # a whole HTTP request, from its first byte
HTTP_IDLE_TIMEOUT = 60.0  # a keep-alive connection with no request started

# errno values that say the listener itself is gone (closed, shut down, never listening)
_CLOSED = frozenset({errno.EBADF, errno.EINVAL, errno.ENOTSOCK})


def listener_closed(exc: OSError) -> bool:
    return exc.errno in _CLOSED


class RateLimitedLog:
    """The lines of one call site: the first ``burst`` of every ``every`` seconds are logged,
    the rest counted, and the next line logged says how many were suppressed. One instance per
    call site that a peer can trigger at will (hostile input must not flood the log: a fuzz run
    once left 3,418 lines); thread-safe, as such input arrives on many connections at once."""

    def __init__(self, logger: logging.Logger, every: float = LOG_EVERY, burst: int = 1) -> None:
        self.logger = logger
        self.every = every
        self.burst = burst
        self._window_end = 0.0
        self._left = 0
        self._held = 0
        self._lock = threading.Lock()

    def warning(self, fmt: str, *args: object) -> None:
        self.log(logging.WARNING, fmt, *args)

    def info(self, fmt: str, *args: object) -> None:
        self.log(logging.INFO, fmt, *args)

    def exception(self, fmt: str, *args: object) -> None:
        """An ERROR line with the traceback being handled (for the lines that are logged)."""
        self.log(logging.ERROR, fmt, *args, exc_info=True)

    def log(self, level: int, fmt: str, *args: object, exc_info: bool = False) -> None:
        if not self.logger.isEnabledFor(level):
            return
        now = time.monotonic()
        with self._lock:
            if now >= self._window_end:
                self._window_end = now + self.every
                self._left = self.burst
            if self._left <= 0:
                self._held += 1
                return
            self._left -= 1
            held, self._held = self._held, 0
        if held:
            self.logger.log(level, fmt + " (suppressed %d similar)", *args, held, exc_info=exc_info)
        else:
            self.logger.log(level, fmt, *args, exc_info=exc_info)


class SiteLogs:
    """One :class:`RateLimitedLog` per call site (a short name), made at its first line: for a
    server's warnings about what its peers send, ``burst`` lines per site every ``every`` s."""

    def __init__(self, logger: logging.Logger, every: float = LOG_EVERY, burst: int = 5) -> None:
        self.logger = logger
        self.every = every
        self.burst = burst
        self._sites: dict[str, RateLimitedLog] = {}
        self._lock = threading.Lock()

    def __call__(self, site: str) -> RateLimitedLog:
        rl = self._sites.get(site)
        if rl is None:
            with self._lock:
                rl = self._sites.setdefault(
                    site, RateLimitedLog(self.logger, self.every, self.burst)
                )
        return rl


class AcceptBackoff:
    """How long a listener waits after a failed ``accept()``; doubles per failure in a row."""

    def __init__(self, name: str, logger: logging.Logger) -> None:
        self.name = name
        self.log = RateLimitedLog(logger)
        self.delay = 0.0
        self.failures = 0  # in a row

    def failed(self, exc: OSError) -> float:
        self.failures += 1
        self.delay = min(BACKOFF_MAX, max(BACKOFF_MIN, 2 * self.delay))
        self.log.warning("%s: accept failed (%s); retrying in %.3gs", self.name, exc, self.delay)
        return self.delay

    def succeeded(self) -> None:
        if self.failures:
            self.log.logger.info(
                "%s: accepting again after %d failed accept(s)", self.name, self.failures
            )
            self.failures = 0
            self.delay = 0.0


class _DeadlineReader(io.RawIOBase):
    """The socket as a raw stream whose reads stop at the current request's deadline."""

    def __init__(self, sock: socket.socket, handler: GuardedHandler) -> None:
        self.sock = sock
        self.handler = handler

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        h = self.handler
        idle = h.timeout or HTTP_IDLE_TIMEOUT
        if h.deadline is None:  # waiting for a request to start: the idle timeout applies
            self.sock.settimeout(idle)
            n = self.sock.recv_into(b)
            h.deadline = time.monotonic() + h.request_timeout
            return n
        left = h.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("request not complete within its deadline")
        self.sock.settimeout(min(left, idle))
        try:
            return self.sock.recv_into(b)
        finally:
            self.sock.settimeout(idle)  # answers are written under the idle timeout


class GuardedHandler(http.server.BaseHTTPRequestHandler):
    """A request handler whose requests must arrive whole within the server's
    ``request_timeout``."""

    timeout = HTTP_IDLE_TIMEOUT
    request_timeout = HTTP_REQUEST_TIMEOUT
    deadline: float | None = None

    def setup(self) -> None:
        if isinstance(self.request, ssl.SSLSocket):
            self.request.settimeout(getattr(self.server, "request_timeout", HTTP_REQUEST_TIMEOUT))
            self.request.do_handshake()
        super().setup()
        self.request_timeout = getattr(self.server, "request_timeout", HTTP_REQUEST_TIMEOUT)
        self.rfile = io.BufferedReader(_DeadlineReader(self.connection, self))

    def handle_one_request(self) -> None:
        self.deadline = None
        super().handle_one_request()


class GuardedHTTPServer(http.server.ThreadingHTTPServer):
    """A threading HTTP server with a deep backlog that survives ``accept()`` failures."""

    daemon_threads = True
    request_queue_size = BACKLOG

    def __init__(
        self,
        addr: tuple[str, int],
        handler: type[GuardedHandler],
        request_timeout: float = HTTP_REQUEST_TIMEOUT,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        super().__init__(addr, handler)
        self.request_timeout = request_timeout
        self.tls = tls
        self.accept_backoff = AcceptBackoff(f"http {addr[0]}:{self.server_address[1]}", _log)

    def get_request(self) -> tuple[socket.socket, Any]:
        try:
            got = super().get_request()
        except OSError as exc:
            # serve_forever drops the error and selects again; without a pause the listener,
            # still readable, would spin
            if not listener_closed(exc):
                time.sleep(self.accept_backoff.failed(exc))
            raise
        self.accept_backoff.succeeded()
        if self.tls is not None:
            sock, peer = got
            return self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False), peer
        return got

    def handle_error(self, request: Any, client_address: Any) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, (ssl.SSLError, TimeoutError, ConnectionError)):
            # a refused certificate, a plaintext client, one that went quiet: no traceback
            _log.info("http %s: dropped %s: %s", self.server_address, client_address, exc)
            return
        super().handle_error(request, client_address)


_log = logging.getLogger(__name__)
