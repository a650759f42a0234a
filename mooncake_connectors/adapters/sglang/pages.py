"""The backend's core: objects made of memory pieces, moved between engine memory and the store.

An object is a list of pieces ``(address, bytes)`` stored as their concatenation. A one-piece
object goes straight between the engine's registered memory and the store (zero copy); a
many-piece object (a ``layer_first`` page, whose layers are not adjacent) is gathered into
registered staging memory before a put and scattered out of it after a get.

Nothing here raises into the engine: every failure — store unreachable, slow, full, a server
gone — comes back as a miss (``False``/``None``). One :class:`GuardedStore` connects the client
in the background and, after a call finds the master unreachable, makes the following calls
answer misses at once for ``cooldown`` seconds, so an engine thread never waits on a dead store
more than once per interval; failures are logged at most once per ``log_interval`` per kind.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from ...errors import MasterUnavailable, MooncakeConnectorsError, ObjectExists
from ...store.client import StoreClient
from ...store.guarded import FAILED, Failed, GuardedStore
from .config import HiCacheStoreConfig

log = logging.getLogger(__name__)
Piece = tuple[int, int]  # (address, bytes)
T = TypeVar("T")


# (client, keys, addresses, sizes) -> per key: moved
_Transfer = Callable[[StoreClient, list[str], list[int], list[int]], list[bool]]


@dataclasses.dataclass
class Counters:
    """What the backend did; read by tests and ``HiCacheStore.counters()``."""

    objects_put: int = 0
    objects_put_failed: int = 0
    objects_read: int = 0
    objects_missed: int = 0
    exists_calls: int = 0
    bugs: int = 0  # unexpected exceptions the engine-facing class turned into misses
    store: dict[str, int] = dataclasses.field(default_factory=dict, repr=False)

    def count_puts(self, stored: int, failed: int) -> None:
        self.objects_put += stored
        self.objects_put_failed += failed

    def count_reads(self, hits: int, missed: int) -> None:
        self.objects_read += hits
        self.objects_missed += missed

    @property
    def errors(self) -> int:
        return self.store.get("failed", 0) + self.bugs

    @property
    def skipped_while_down(self) -> int:
        return self.store.get("skipped", 0)

    @property
    def connects(self) -> int:
        return self.store.get("connects", 0)


class PageStore:
    """One rank's store client with deadlines, staging and failure isolation."""

    def __init__(self, cfg: HiCacheStoreConfig, ranks_per_server: int = 1) -> None:
        self.cfg = cfg
        self.guard = GuardedStore(
            cfg.client_config(ranks_per_server),
            cooldown=cfg.cooldown,
            name="HiCache storage",
            log_interval=cfg.log_interval,
            # Only a master that does not answer skips the store; a server gone fails its keys.
            down_errors=(MasterUnavailable,),
        )
        self.log = self.guard.log
        self.counters = Counters(store=self.guard.counters)
        self._regions: list[Piece] = []  # registered with the client before its first use
        self._lock = threading.Lock()  # registering
        self._stage_lock = threading.Lock()
        self._staging: Any = None  # numpy uint8 array, made on first use

    # -- connection ---------------------------------------------------------------------------
    @property
    def connected(self) -> bool:
        return self.guard.connected

    def settle(self) -> bool:
        """Wait for the first connect attempt (bounded by ``timeout``); whether it succeeded."""
        return self.guard.settle(self.cfg.timeout + 1.0)

    def _call(self, op: str, fn: Callable[[StoreClient], T]) -> T | Failed:
        def registered_first(client: StoreClient) -> T:
            self._register_pending(client)
            return fn(client)

        return self.guard.call(op, registered_first)

    def _register_pending(self, client: StoreClient) -> None:
        if not self._regions:
            return
        with self._lock:
            regions, self._regions = self._regions, []
        for addr, size in regions:
            try:
                client.register_buffer(addr, size)
            except MooncakeConnectorsError as exc:
                # Unregistered memory still works, copied through the client's staging.
                self.log.warn("register", "registering %d bytes failed: %s", size, exc)

    def register(self, addr: int, size: int) -> None:
        """Memory the engine owns that pages live in: registered once for zero-copy I/O."""
        if size > 0:
            with self._lock:
                self._regions.append((addr, size))

    def close(self) -> None:
        self.guard.close()

    # -- staging ------------------------------------------------------------------------------
    def _staging_addr(self, client: StoreClient) -> int:
        """Base address of the registered staging memory (caller holds ``_stage_lock``)."""
        if self._staging is None:
            import numpy as np

            arr = np.empty(self.cfg.staging_size, dtype=np.uint8)
            arr.fill(0)  # fault the pages in now, not during a transfer
            self._staging = arr
            self.register(int(arr.ctypes.data), int(arr.nbytes))
            self._register_pending(client)
        return int(self._staging.ctypes.data)

    def _chunks(self, idx: list[int], sizes: list[int]) -> Iterator[list[int]]:
        """Groups of objects whose total size fits the staging memory (an object that is
        larger than all of it goes alone, through a temporary buffer)."""
        chunk: list[int] = []
        used = 0
        for i in idx:
            n = sizes[i]
            if chunk and used + n > self.cfg.staging_size:
                yield chunk
                chunk, used = [], 0
            chunk.append(i)
            used += n
        if chunk:
            yield chunk

    @staticmethod
    def _gather(dst: int, pieces: Sequence[Piece]) -> None:
        for addr, n in pieces:
            ctypes.memmove(dst, addr, n)
            dst += n

    @staticmethod
    def _scatter(src: int, pieces: Sequence[Piece]) -> None:
        for addr, n in pieces:
            ctypes.memmove(addr, src, n)
            src += n

    def _temp(self, size: int) -> tuple[Any, int]:
        import numpy as np

        arr = np.empty(size, dtype=np.uint8)
        return arr, int(arr.ctypes.data)

    # -- operations ---------------------------------------------------------------------------
    def put(self, keys: Sequence[str], objects: Sequence[Sequence[Piece]]) -> list[bool]:
        """Store every object under its key; per key True if it is in the store now (stored,
        or already there)."""
        return self._batch("put", keys, objects, self._put_from, self.counters.count_puts)

    def get(self, keys: Sequence[str], objects: Sequence[Sequence[Piece]]) -> list[bool]:
        """Read every object into its pieces; per key True only if all its bytes arrived."""
        return self._batch("get", keys, objects, self._get_into, self.counters.count_reads, True)

    def _batch(
        self,
        op: str,
        keys: Sequence[str],
        objects: Sequence[Sequence[Piece]],
        transfer: _Transfer,
        count: Callable[[int, int], None],
        into: bool = False,
    ) -> list[bool]:
        """One store call moving every object (see :meth:`_move`); ``count(ok, failed)``."""
        out = [False] * len(keys)

        def call(client: StoreClient) -> None:
            def some(idx: list[int], addrs: list[int], sizes: list[int]) -> list[bool]:
                return transfer(client, [keys[i] for i in idx], addrs, [sizes[i] for i in idx])

            try:
                self._move(client, objects, out, some, into)
            finally:  # counted when the store was called, whatever it answered
                ok = sum(out)
                count(ok, len(out) - ok)

        if keys:
            self._call(op, call)
        return out

    def _move(
        self,
        client: StoreClient,
        objects: Sequence[Sequence[Piece]],
        out: list[bool],
        transfer: Callable[[list[int], list[int], list[int]], list[bool]],
        into: bool = False,
    ) -> None:
        """``transfer(indices, addresses, sizes)`` for every object, setting ``out`` as they
        succeed: one-piece objects from their own (registered) memory, the others through staging —
        gathered there before a put, scattered from there after a get (``into``)."""
        sizes = [sum(n for _, n in obj) for obj in objects]
        deadline = time.monotonic() + self.cfg.timeout
        single = [i for i, obj in enumerate(objects) if len(obj) == 1]
        multi = [i for i, obj in enumerate(objects) if len(obj) != 1]
        if single:
            got = transfer(single, [objects[i][0][0] for i in single], sizes)
            for i, ok in zip(single, got, strict=True):
                out[i] = ok
        for chunk in self._chunks(multi, sizes):
            if time.monotonic() >= deadline:
                break
            with self._stage_lock:
                if len(chunk) == 1 and sizes[chunk[0]] > self.cfg.staging_size:
                    _keep, base = self._temp(sizes[chunk[0]])
                else:
                    base = self._staging_addr(client)
                addrs = []
                for i in chunk:
                    if not into:
                        self._gather(base, objects[i])
                    addrs.append(base)
                    base += sizes[i]
                got = transfer(chunk, addrs, sizes)
                for i, addr, ok in zip(chunk, addrs, got, strict=True):
                    if ok and into:
                        self._scatter(addr, objects[i])
                    out[i] = ok

    def _put_from(
        self, client: StoreClient, keys: list[str], addrs: list[int], sizes: list[int]
    ) -> list[bool]:
        errs = client.batch_put_from(keys, addrs, sizes, replicas=self.cfg.replicas)
        out = []
        for err in errs:
            # Another rank or server stored the same page first: that is a success.
            out.append(err is None or isinstance(err, ObjectExists))
            if not out[-1]:
                self.log.warn("put", "store put failed, page not saved: %s", err)
        return out

    def _get_into(
        self, client: StoreClient, keys: list[str], addrs: list[int], sizes: list[int]
    ) -> list[bool]:
        res = client.batch_get_into(keys, addrs, sizes)
        out = []
        for size, r in zip(sizes, res, strict=True):
            # A stored object of another size is another format's page: a miss, never half a page.
            out.append(isinstance(r, int) and r == size)
            if isinstance(r, MooncakeConnectorsError):
                self.log.warn("get", "store read failed, reported as a miss: %s", r)
        return out

    def exists(self, keys: Sequence[str]) -> list[bool]:
        def exists(client: StoreClient) -> list[bool]:
            self.counters.exists_calls += 1
            return list(client.batch_exists(keys))

        got = self._call("exists", exists) if keys else FAILED
        return [False] * len(keys) if got is FAILED else got

    def get_values(self, keys: Sequence[str]) -> list[bytes | None]:
        """Whole values as bytes (the non-zero-copy path); None for a miss."""
        got = self._call("get", lambda client: client.get_batch(keys)) if keys else FAILED
        if got is FAILED:
            return [None] * len(keys)
        hits = sum(v is not None for v in got)
        self.counters.count_reads(hits, len(got) - hits)
        return got

    def remove_all(self, *, force: bool = False) -> int | None:
        """Remove every object in the store; how many, or None if the store did not answer.
        ``force`` also frees memory readers still hold a lease on (benchmarks between rounds)."""
        got = self._call("clear", lambda client: client.remove_all(force=force))
        return None if got is FAILED else got
