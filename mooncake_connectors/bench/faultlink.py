"""A lossy, slow or cut link between two TCP endpoints: a relay on 127.0.0.1.

Where the kernel has tc netem, loss and reordering act on packets. Where it has not (netem is a
kernel module some kernels lack), this relay is the next best, and honest about what it does:
it works on the byte stream TCP already delivered, so

- delay: every chunk is forwarded ``delay`` ± ``jitter`` seconds after it arrived, in order
  (jitter larger than the gap between chunks is what reordering looks like to the application:
  TCP hands over bytes in order, late);
- loss: a chunk is held back by ``stall`` seconds with probability ``loss``, what a lost segment
  costs TCP (a retransmission timeout is 200 ms or more);
- partition: nothing is forwarded either way, no FIN, no RST, until :meth:`heal` (or never);
- :meth:`reset`: every relayed connection is closed abruptly (a link flap).

Packet-level effects on congestion control are not reproduced. Each relayed connection has a
reader and a writer thread per direction; a chunk is at most 64 KiB.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import random
import selectors
import socket
import threading
import time

CHUNK = 64 << 10


@dataclasses.dataclass(eq=False)
class _Direction:
    """One direction of a relayed connection: its reader queues each chunk from ``src`` with
    the time it is due, and its writer sends it on to ``dst`` then."""

    src: socket.socket
    dst: socket.socket
    q: collections.deque[tuple[float, bytes]] = dataclasses.field(default_factory=collections.deque)
    ready: threading.Condition = dataclasses.field(default_factory=threading.Condition)


class FaultLink:
    def __init__(self, target: tuple[str, int], seed: int = 0) -> None:
        self.target = target
        self.delay = 0.0
        self.jitter = 0.0
        self.loss = 0.0
        self.stall = 0.25
        self._rng = random.Random(seed)
        self._open = threading.Event()  # set: forwarding; clear: partitioned
        self._open.set()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.connections = 0
        threading.Thread(target=self._accept, name="mc-faultlink", daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self._listener.getsockname()[1]}"

    def shape(
        self, delay: float = 0.0, jitter: float = 0.0, loss: float = 0.0, stall: float = 0.25
    ) -> None:
        self.delay, self.jitter, self.loss, self.stall = delay, jitter, loss, stall

    def partition(self) -> None:
        self._open.clear()

    def heal(self) -> None:
        self._open.set()

    def reset(self) -> None:
        """Close every relayed connection now (RST); new ones are accepted as before."""
        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:
            with contextlib.suppress(OSError):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
            with contextlib.suppress(OSError):
                s.close()

    def close(self) -> None:
        self._stop.set()
        self._open.set()
        self.reset()
        with contextlib.suppress(OSError):
            self._listener.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                down, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                up = socket.create_connection(self.target, timeout=5)
            except OSError:
                down.close()
                continue
            down.settimeout(None)
            up.settimeout(None)
            self.connections += 1
            with self._lock:
                self._socks += [down, up]
            pair = (down, up)
            done = [0]
            for a, b in ((down, up), (up, down)):
                d = _Direction(a, b)
                threading.Thread(target=self._read, args=(d,), daemon=True).start()
                threading.Thread(
                    target=self._write_then_close, args=(d, pair, done), daemon=True
                ).start()

    def _write_then_close(
        self, d: _Direction, pair: tuple[socket.socket, socket.socket], done: list[int]
    ) -> None:
        try:
            self._write(d)
        finally:
            with self._lock:
                done[0] += 1
                last = done[0] == 2
                if last:
                    self._socks = [s for s in self._socks if s not in pair]
            if last:  # both directions ended: the connection is over
                for s in pair:
                    with contextlib.suppress(OSError):
                        s.close()

    def _due(self) -> float:
        d = self.delay + (self._rng.uniform(-self.jitter, self.jitter) if self.jitter else 0.0)
        if self.loss and self._rng.random() < self.loss:
            d += self.stall
        return time.monotonic() + max(0.0, d)

    def _read(self, d: _Direction) -> None:
        src, q, ready = d.src, d.q, d.ready
        sel = selectors.DefaultSelector()
        try:
            sel.register(src, selectors.EVENT_READ)
            last = 0.0
            while not self._stop.is_set():
                if src.fileno() < 0:  # closed under us (reset, or the other direction ended)
                    return
                if not sel.select(0.1):
                    continue
                try:
                    data = src.recv(CHUNK, socket.MSG_DONTWAIT)  # both threads share src
                except BlockingIOError:
                    continue
                except OSError:
                    return
                if not data:
                    return
                due = max(self._due(), last)  # in order, as TCP delivers
                last = due
                with ready:
                    q.append((due, data))
                    ready.notify()
        except (OSError, ValueError):
            return
        finally:
            sel.close()
            with ready:  # the end of this direction, for its writer (and so its thread) to end
                q.append((time.monotonic(), b""))
                ready.notify()

    def _write(self, d: _Direction) -> None:
        src, dst, q, ready = d.src, d.dst, d.q, d.ready
        while not self._stop.is_set():
            with ready:
                while not q and not self._stop.is_set():
                    ready.wait(0.1)
                if not q:
                    return
                due, data = q.popleft()
            while not self._stop.is_set():
                wait = due - time.monotonic()
                if wait <= 0 and self._open.is_set():
                    break
                self._open.wait(min(max(wait, 0.01), 0.1))
                time.sleep(min(max(wait, 0.0), 0.05))
            try:
                if not data:
                    dst.shutdown(socket.SHUT_WR)
                    return
                dst.sendall(data)
            except OSError:
                for s in (src, dst):
                    with contextlib.suppress(OSError):
                        s.close()
                return
