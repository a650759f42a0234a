"""The backend's core: objects made of memory pieces, moved between engine memory and the store.

An object is a list of pieces ``(address, bytes)`` stored as their concatenation. A one-piece
object goes straight between the engine's registered memory and the store (zero copy); a
many-piece object (a ``layer_first`` page, whose layers are not adjacent) is gathered into
registered staging memory before a put and scattered out of it after a get.

Nothing here raises into the engine: every failure — store unreachable, slow, full, a server
gone — comes back as a miss (``False``/``None``) and is logged at most once per
``log_interval`` per kind. A call that finds the master unreachable makes the following calls
answer misses at once for ``retry_interval`` seconds, so an engine thread never waits on a dead
store more than once per interval; a store not reachable at start-up is connected to lazily.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from ...errors import MasterUnavailable, MooncakeConnectorsError, ObjectExists
from ...store.client import StoreClient
from ...store.config import ClientConfig
from .config import HiCacheStoreConfig

log = logging.getLogger(__name__)
Piece = tuple[int, int]  # (address, bytes)


class Throttle:
    """Log a kind of failure at most once per ``interval`` seconds, counting the rest."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._last: dict[str, float] = {}
        self._hidden: dict[str, int] = {}
        self._lock = threading.Lock()

    def warn(self, kind: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self.interval:
                self._hidden[kind] = self._hidden.get(kind, 0) + 1
                return
            self._last[kind] = now
            hidden = self._hidden.pop(kind, 0)
        suffix = f" ({hidden} more like it not logged)" if hidden else ""
        log.warning(msg + suffix, *args)


@dataclasses.dataclass
class Counters:
    """What the backend did; read by tests and ``HiCacheStore.counters()``."""

    objects_put: int = 0
    objects_put_failed: int = 0
    objects_read: int = 0
    objects_missed: int = 0
    exists_calls: int = 0
    errors: int = 0
    skipped_while_down: int = 0
    connects: int = 0


class PageStore:
    """One rank's store client with deadlines, staging and failure isolation."""

    def __init__(self, cfg: HiCacheStoreConfig, ranks_per_server: int = 1) -> None:
        self.cfg = cfg
        self.client_config = ClientConfig(
            master=cfg.master,
            host=cfg.host,
            global_segment_size=cfg.global_segment_size // max(1, ranks_per_server),
            local_buffer_size=cfg.local_buffer_size,
            metadata=cfg.metadata,
            transports=cfg.transports,
            timeout=cfg.timeout,
            rpc_timeout=min(cfg.rpc_timeout, cfg.timeout),
            replica_timeout=min(1.0, cfg.timeout),
        )
        self.counters = Counters()
        self.throttle = Throttle(cfg.log_interval)
        self._client: StoreClient | None = None
        self._regions: list[Piece] = []  # registered with every client we connect
        self._down_until = 0.0
        self._lock = threading.Lock()  # connecting and registering
        self._stage_lock = threading.Lock()
        self._staging: Any = None  # numpy uint8 array, made on first use
        self._closed = False

    # -- connection ---------------------------------------------------------------------------
    @property
    def connected(self) -> bool:
        return self._client is not None

    def connect(self) -> bool:
        """Try to reach the store now (bounded by ``timeout``); False if it is unreachable."""
        with self._lock:
            if self._client is None and not self._closed:
                self._connect_locked()
        return self._client is not None

    def _connect_locked(self) -> None:
        client = StoreClient(self.client_config)
        try:
            client.start()
            for addr, size in self._regions:
                client.register_buffer(addr, size)
        except (MooncakeConnectorsError, OSError) as exc:
            client.close()
            self._down_until = time.monotonic() + self.cfg.retry_interval
            self.throttle.warn(
                "connect",
                "store at %s unreachable (%s); HiCache storage answers misses, retrying every "
                "%.0fs",
                self.cfg.master,
                exc,
                self.cfg.retry_interval,
            )
            return
        self.counters.connects += 1
        self._client = client
        log.info("HiCache storage connected to the store at %s", self.cfg.master)

    def _ready(self) -> StoreClient | None:
        """The client to use now, or None: answer a miss without touching the store."""
        if self._closed:
            return None
        if time.monotonic() < self._down_until:
            self.counters.skipped_while_down += 1
            return None
        client = self._client
        if client is not None:
            return client
        if not self._lock.acquire(blocking=False):
            self.counters.skipped_while_down += 1  # another thread is connecting
            return None
        try:
            if self._client is None and not self._closed:
                self._connect_locked()
            return self._client
        finally:
            self._lock.release()

    def _failed(self, what: str, exc: BaseException) -> None:
        self.counters.errors += 1
        if isinstance(exc, MasterUnavailable):
            self._down_until = time.monotonic() + self.cfg.retry_interval
            self.throttle.warn(
                "unreachable",
                "store master %s unreachable during %s (%s); answering misses for %.0fs",
                self.cfg.master,
                what,
                exc,
                self.cfg.retry_interval,
            )
        else:
            self.throttle.warn(what, "store %s failed, reported as a miss: %s", what, exc)

    def register(self, addr: int, size: int) -> None:
        """Memory the engine owns that pages live in: registered once for zero-copy I/O."""
        if size <= 0:
            return
        with self._lock:
            self._regions.append((addr, size))
            if self._client is not None:
                try:
                    self._client.register_buffer(addr, size)
                except MooncakeConnectorsError as exc:
                    # Unregistered memory still works, copied through the client's staging.
                    self.throttle.warn("register", "registering %d bytes failed: %s", size, exc)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            client.close()

    # -- staging ------------------------------------------------------------------------------
    def _staging_addr(self) -> int:
        """Base address of the registered staging memory (caller holds ``_stage_lock``)."""
        if self._staging is None:
            import numpy as np

            arr = np.empty(self.cfg.staging_size, dtype=np.uint8)
            arr.fill(0)  # fault the pages in now, not during a transfer
            self._staging = arr
            self.register(int(arr.ctypes.data), int(arr.nbytes))
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
        out = [False] * len(keys)
        client = self._ready()
        if client is None or not keys:
            return out
        sizes = [sum(n for _, n in obj) for obj in objects]
        deadline = time.monotonic() + self.cfg.timeout
        single = [i for i, obj in enumerate(objects) if len(obj) == 1]
        multi = [i for i, obj in enumerate(objects) if len(obj) != 1]
        try:
            if single:
                self._put_from(client, keys, single, [objects[i][0][0] for i in single], sizes, out)
            for chunk in self._chunks(multi, sizes):
                if time.monotonic() >= deadline:
                    break
                with self._stage_lock:
                    if len(chunk) == 1 and sizes[chunk[0]] > self.cfg.staging_size:
                        _keep, base = self._temp(sizes[chunk[0]])
                    else:
                        base = self._staging_addr()
                    addrs = []
                    for i in chunk:
                        self._gather(base, objects[i])
                        addrs.append(base)
                        base += sizes[i]
                    self._put_from(client, keys, chunk, addrs, sizes, out)
        except (MooncakeConnectorsError, OSError) as exc:
            self._failed("put", exc)
        stored = sum(out)
        self.counters.objects_put += stored
        self.counters.objects_put_failed += len(out) - stored
        return out

    def _put_from(
        self,
        client: StoreClient,
        keys: Sequence[str],
        idx: list[int],
        addrs: list[int],
        sizes: list[int],
        out: list[bool],
    ) -> None:
        errs = client.batch_put_from(
            [keys[i] for i in idx], addrs, [sizes[i] for i in idx], replicas=self.cfg.replicas
        )
        for i, err in zip(idx, errs, strict=True):
            # Another rank or server stored the same page first: that is a success.
            out[i] = err is None or isinstance(err, ObjectExists)
            if not out[i]:
                self.throttle.warn("put", "store put failed, page not saved: %s", err)

    def get(self, keys: Sequence[str], objects: Sequence[Sequence[Piece]]) -> list[bool]:
        """Read every object into its pieces; per key True only if all its bytes arrived."""
        out = [False] * len(keys)
        client = self._ready()
        if client is None or not keys:
            return out
        sizes = [sum(n for _, n in obj) for obj in objects]
        deadline = time.monotonic() + self.cfg.timeout
        single = [i for i, obj in enumerate(objects) if len(obj) == 1]
        multi = [i for i, obj in enumerate(objects) if len(obj) != 1]
        try:
            if single:
                got = self._get_into(
                    client, keys, single, [objects[i][0][0] for i in single], sizes
                )
                for i, ok in zip(single, got, strict=True):
                    out[i] = ok
            for chunk in self._chunks(multi, sizes):
                if time.monotonic() >= deadline:
                    break
                with self._stage_lock:
                    if len(chunk) == 1 and sizes[chunk[0]] > self.cfg.staging_size:
                        _keep, base = self._temp(sizes[chunk[0]])
                    else:
                        base = self._staging_addr()
                    addrs = []
                    for i in chunk:
                        addrs.append(base)
                        base += sizes[i]
                    got = self._get_into(client, keys, chunk, addrs, sizes)
                    for i, addr, ok in zip(chunk, addrs, got, strict=True):
                        if ok:
                            self._scatter(addr, objects[i])
                        out[i] = ok
        except (MooncakeConnectorsError, OSError) as exc:
            self._failed("get", exc)
        hits = sum(out)
        self.counters.objects_read += hits
        self.counters.objects_missed += len(out) - hits
        return out

    def _get_into(
        self,
        client: StoreClient,
        keys: Sequence[str],
        idx: list[int],
        addrs: list[int],
        sizes: list[int],
    ) -> list[bool]:
        res = client.batch_get_into([keys[i] for i in idx], addrs, [sizes[i] for i in idx])
        out = []
        for i, r in zip(idx, res, strict=True):
            # A stored object of another size is another format's page: a miss, never half a page.
            out.append(isinstance(r, int) and r == sizes[i])
            if isinstance(r, MooncakeConnectorsError):
                self.throttle.warn("get", "store read failed, reported as a miss: %s", r)
        return out

    def exists(self, keys: Sequence[str]) -> list[bool]:
        client = self._ready()
        if client is None or not keys:
            return [False] * len(keys)
        self.counters.exists_calls += 1
        try:
            return list(client.batch_exists(keys))
        except (MooncakeConnectorsError, OSError) as exc:
            self._failed("exists", exc)
            return [False] * len(keys)

    def get_values(self, keys: Sequence[str]) -> list[bytes | None]:
        """Whole values as bytes (the non-zero-copy path); None for a miss."""
        client = self._ready()
        if client is None or not keys:
            return [None] * len(keys)
        try:
            out = client.get_batch(keys)
        except (MooncakeConnectorsError, OSError) as exc:
            self._failed("get", exc)
            return [None] * len(keys)
        hits = sum(v is not None for v in out)
        self.counters.objects_read += hits
        self.counters.objects_missed += len(out) - hits
        return out

    def remove_all(self, *, force: bool = False) -> int | None:
        """Remove every object in the store; how many, or None if the store did not answer.
        ``force`` also frees memory readers still hold a lease on (benchmarks between rounds)."""
        client = self._ready()
        if client is None:
            return None
        try:
            return client.remove_all(force=force)
        except (MooncakeConnectorsError, OSError) as exc:
            self._failed("clear", exc)
            return None
