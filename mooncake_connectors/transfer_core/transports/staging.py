"""GPU memory over a host-memory transport: pinned staging buffers and a copy pipeline.

Bytes of a GPU region cross the network through pinned host buffers from one bounded pool per
process side (allocated once, on first GPU use, and never per request). A transfer is cut into
chunks of one buffer each and pipelined on a CUDA stream of the worker doing it:

  * to the network (initiator WRITE, target READ): the device-to-host copies of the next chunks
    are queued while the current chunk is being sent;
  * from the network (initiator READ, target WRITE): the host-to-device copy of a received chunk
    runs while the next chunk is being received.

A worker holds at least one buffer and takes more only while the pool has them, so no two
workers can wait on each other. Every wait has the transfer's deadline.
"""

from __future__ import annotations

import collections
import socket
import threading
import time
from collections.abc import Callable

from ...errors import GpuError, TransferTimeout
from .. import cuda_driver
from ..cuda_driver import CudaDriver, Fence
from ..memory import view

# A chunk's host copy is ready to go on the wire (to the network), or landed in the buffer
# (from the network): the callable sends it or receives into it.
SendChunk = Callable[[memoryview], None]
RecvChunk = Callable[[memoryview], None]


class PinnedPool:
    """``count`` pinned host buffers of ``size`` bytes, allocated on first use."""

    def __init__(self, size: int, count: int) -> None:
        self.size = size
        self.count = count
        self._cv = threading.Condition()
        self._free: list[int] = []
        self._all: list[int] = []

    def _fill(self, drv: CudaDriver) -> None:
        if not self._all:
            self._all = [drv.host_alloc(self.size) for _ in range(self.count)]
            self._free = list(self._all)

    def acquire(self, deadline: float) -> int:
        """One buffer, waiting for one until ``deadline`` (TransferTimeout after)."""
        with self._cv:
            self._fill(cuda_driver.driver())
            while not self._free:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferTimeout("no staging buffer came free before the deadline")
                self._cv.wait(left)
            return self._free.pop()

    def try_acquire(self) -> int | None:
        with self._cv:
            return self._free.pop() if self._free else None

    def release(self, buf: int) -> None:
        with self._cv:
            self._free.append(buf)
            self._cv.notify()

    def close(self) -> None:
        with self._cv:
            bufs, self._all, self._free = self._all, [], []
        if bufs:
            drv = cuda_driver.driver()
            for b in bufs:
                drv.host_free(b)


class Pipe:
    """One worker's stream and events; reused for every transfer that worker stages."""

    def __init__(self, pool: PinnedPool, device: int, depth: int) -> None:
        self.drv = cuda_driver.driver()
        self.pool = pool
        self.device = device
        self.stream = self.drv.stream_create(device)
        self.events = [self.drv.event_create(device) for _ in range(max(1, depth))]

    def close(self) -> None:
        for e in self.events:
            self.drv.event_destroy(e)
        self.drv.stream_destroy(self.stream)

    def _wait(self, event: int, deadline: float) -> None:
        if not cuda_driver.wait_event(self.drv, event, deadline):
            raise TransferTimeout("a staging copy outlasted the deadline")

    def _buffers(self, n_chunks: int, deadline: float) -> list[int]:
        want = min(n_chunks, len(self.events))
        bufs = [self.pool.acquire(deadline)]
        while len(bufs) < want:
            b = self.pool.try_acquire()
            if b is None:
                break
            bufs.append(b)
        return bufs

    def to_network(
        self, addr: int, length: int, send: SendChunk, deadline: float, after: Fence | None = None
    ) -> None:
        """Copy ``addr``+``length`` of device memory out through ``send``, chunk by chunk
        (after ``after``, a point in the application's stream, when given)."""
        if after is not None:
            after.order(self.stream)
        size = self.pool.size
        chunks = [(off, min(size, length - off)) for off in range(0, length, size)]
        bufs = self._buffers(len(chunks), deadline)
        k = len(bufs)
        ready: collections.deque[tuple[int, int, int]] = collections.deque()  # (i, buf, n)
        try:
            issued = 0
            for i in range(len(chunks)):
                while issued < len(chunks) and issued < i + k:  # keep k copies ahead
                    o2, n2 = chunks[issued]
                    b = bufs[issued % k]
                    self.drv.memcpy_async(b, addr + o2, n2, self.stream)
                    self.drv.event_record(self.events[issued % k], self.stream)
                    ready.append((issued, b, n2))
                    issued += 1
                j, b, n = ready.popleft()  # j == i: the stream keeps order
                self._wait(self.events[j % k], deadline)
                send(view(b, n))  # the next copies run on the GPU meanwhile
        finally:
            self._give_back(bufs, deadline)

    def from_network(
        self, addr: int, length: int, recv: RecvChunk, deadline: float, after: Fence | None = None
    ) -> None:
        """Fill ``addr``+``length`` of device memory from ``recv``, chunk by chunk."""
        if after is not None:
            after.order(self.stream)
        size = self.pool.size
        chunks = [(off, min(size, length - off)) for off in range(0, length, size)]
        bufs = self._buffers(len(chunks), deadline)
        k = len(bufs)
        try:
            for i, (off, n) in enumerate(chunks):
                b = bufs[i % k]
                if i >= k:  # the buffer's previous copy must have left it
                    self._wait(self.events[i % k], deadline)
                recv(view(b, n))
                self.drv.memcpy_async(addr + off, b, n, self.stream)
                self.drv.event_record(self.events[i % k], self.stream)
            for i in range(max(0, len(chunks) - k), len(chunks)):
                self._wait(self.events[i % k], deadline)
        finally:
            self._give_back(bufs, deadline)

    def _give_back(self, bufs: list[int], deadline: float) -> None:
        """Return ``bufs`` to the pool once no queued copy uses them any more. A copy that
        never finishes keeps its buffers out of the pool (smaller pool, no corrupted bytes)."""
        last = self.events[0]
        self.drv.event_record(last, self.stream)
        if not cuda_driver.wait_event(self.drv, last, max(deadline, time.monotonic() + 5)):
            raise GpuError("a staging copy did not finish; its buffers are not reused")
        for b in bufs:
            self.pool.release(b)


class Staging:
    """A pinned pool plus one Pipe per (thread, device), for one side of a transport."""

    def __init__(self, chunk: int, buffers: int) -> None:
        self.pool = PinnedPool(chunk, buffers)
        self.depth = buffers
        self._tls = threading.local()

    def pipe(self, device: int) -> Pipe:
        pipes: dict[int, Pipe] | None = getattr(self._tls, "pipes", None)
        if pipes is None:
            pipes = self._tls.pipes = {}
        p = pipes.get(device)
        if p is None:
            p = pipes[device] = Pipe(self.pool, device, self.depth)
        return p

    def release_thread(self) -> None:
        """Destroy this thread's streams and events (its worker is ending)."""
        pipes: dict[int, Pipe] = getattr(self._tls, "pipes", None) or {}
        for p in pipes.values():
            p.close()
        pipes.clear()

    def close(self) -> None:
        self.pool.close()


def sender(sock: socket.socket) -> SendChunk:
    def send(chunk: memoryview) -> None:
        sock.sendall(chunk)

    return send


def receiver(
    sock: socket.socket, recv_exact: Callable[[socket.socket, memoryview], None]
) -> RecvChunk:
    def recv(chunk: memoryview) -> None:
        recv_exact(sock, chunk)

    return recv
