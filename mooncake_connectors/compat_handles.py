"""``BufferHandle``: the values ``get_buffer`` / ``batch_get_buffer`` return, over warm memory.

Mooncake's handle views its client's registered buffer, so a get allocates nothing. Ours owns a
block of memory that the store client reads the value straight into; when the handle is gone the
block goes back to its :class:`HandlePool` and the next get of that size reuses it: memory that is
already faulted in (a fresh multi-MiB allocation costs a page fault per 4 KiB page, more than the
read itself on a VM) and, for a pure client that reads large values directly, already registered
with the transfer engine (no registration per call).

A handle is a writable buffer of unsigned bytes (a ctypes ``c_ubyte`` array: ``len``,
``bytes()``, ``torch.frombuffer``, ``numpy.frombuffer``, ``struct.unpack_from``, ``memoryview``)
with ``ptr()`` and ``size()``, as Mooncake's. Its ``memoryview`` format is ctypes' ``"<B"``
(Mooncake's is ``"b"``), which Python's memoryview slices and copies but indexes only after
``.cast("B")``. Anything holding a view of it (a memoryview, tensor or array over it) keeps the
handle, so its block is never handed out while viewed; it stays valid after the store is closed.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from collections import deque
from typing import Any

log = logging.getLogger(__name__)

REGISTER_MIN = 64 << 10
"""Blocks this large are registered once (pure clients): their values are read into them
directly; smaller ones come through the client's staging area."""


class BufferHandle:
    """The type every handle is an instance of (``isinstance(h, BufferHandle)``): the bytes of a
    value as a ctypes array of ``c_ubyte`` with Mooncake's two methods."""

    __slots__ = ()

    def ptr(self) -> int:
        """The address of the value's bytes (0 for an empty value)."""
        return ctypes.addressof(self) if self.size() else 0  # type: ignore[arg-type]

    def size(self) -> int:
        return len(self)  # type: ignore[arg-type]


class _Returned:
    """Gives the handle's block back to its pool when the handle goes (never blocks: an append
    to a deque, which the pool drains under its lock on its next allocation); a closed pool
    takes nothing back."""

    __slots__ = ()

    def __del__(self) -> None:
        home = self.__dict__.get("_home")  # type: ignore[attr-defined]
        if home is not None and not home._closed:
            home._back.append(self.__dict__["_block"])  # type: ignore[attr-defined]


@functools.lru_cache(maxsize=256)
def _handle_type(size: int) -> type[Any]:
    return type("BufferHandle", (_Returned, BufferHandle, ctypes.c_ubyte * size), {})


def _address(block: bytearray) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(block)) if block else 0


class HandlePool:
    """Blocks for handles, kept for reuse up to ``retain`` idle bytes.

    ``register(address, size)`` / ``unregister(address)`` (the store client's, for a client
    that reads large values directly; None otherwise) are called once per block kept, not per
    get. Thread-safe: LMCache calls ``batch_get_buffer`` from worker threads."""

    def __init__(self, retain: int, register: Any = None, unregister: Any = None) -> None:
        self._retain = retain
        self._register = register
        self._unregister = unregister
        self._idle: dict[int, list[bytearray]] = {}
        self._idle_bytes = 0
        self._back: deque[bytearray] = deque()
        self._registered: set[int] = set()  # id() of the blocks registered
        self._lock = threading.Lock()
        self._closed = False

    def alloc(self, size: int) -> tuple[BufferHandle, int]:
        """A handle of ``size`` bytes and the address of its bytes (the client reads into it)."""
        with self._lock:
            self._drain()
            idle = self._idle.get(size)
            if idle:
                block = idle.pop()
                self._idle_bytes -= size
            else:
                block = self._new(size)
        handle = _handle_type(size).from_buffer(block)
        handle._home, handle._block = self, block
        return handle, _address(block)

    def _new(self, size: int) -> bytearray:
        block = bytearray(size)
        if self._register is not None and size >= REGISTER_MIN and not self._closed:
            try:
                self._register(_address(block), size)
                self._registered.add(id(block))
            except Exception as exc:  # a block we cannot register is still a block
                log.debug("handle block not registered (%s); values come through staging", exc)
        return block

    def _drain(self) -> None:
        while self._back:
            block = self._back.popleft()
            n = len(block)
            if not self._closed and self._idle_bytes + n <= self._retain:
                self._idle.setdefault(n, []).append(block)
                self._idle_bytes += n
            else:
                self._drop(block)

    def _drop(self, block: bytearray) -> None:
        if id(block) in self._registered:
            self._registered.discard(id(block))
            if self._unregister is not None and not self._closed:
                try:
                    self._unregister(_address(block))
                except Exception as exc:
                    log.debug("handle block not unregistered: %s", exc)

    @property
    def idle_bytes(self) -> int:
        return self._idle_bytes

    def close(self) -> None:
        """Forget the idle blocks (their registrations go with the client's engine); handles
        still held keep their memory and no longer come back."""
        with self._lock:
            self._drain()
            for blocks in self._idle.values():
                for block in blocks:
                    self._drop(block)
            self._closed = True
            self._idle.clear()
            self._idle_bytes = 0
            self._registered.clear()
