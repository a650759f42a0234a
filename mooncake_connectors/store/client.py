"""The store client: the API adapters use.

    with StoreClient(ClientConfig(master="127.0.0.1:50051")) as store:
        store.put("k", b"value", replicas=2)
        store.get("k")                      # b"value"; a miss is None
        buf = np.zeros(1 << 20, np.uint8); store.register_buffer(buf)
        store.get_into("k", buf.ctypes.data, buf.nbytes)   # zero-copy: bytes read, or None

A put is two-phase: the master allocates stripes in mounted segments, this client writes them
through its own transfer engine (one batch for every stripe of every replica of every key), then
commits; a key becomes visible only at commit. A get asks the master where the copies are (which
also takes a read lease) and reads each stripe from the nearest copy — this process, then this
host (shm), then remote — falling over to another copy on error. Batch calls take one control
round trip and one transfer batch for all their keys; per-key failures come back as values.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import random
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

from ..config import EngineConfig
from ..errors import (
    CapacityExceeded,
    ConfigError,
    MooncakeConnectorsError,
    ObjectExists,
    PutExpired,
    ReplicaUnavailable,
    StoreError,
)
from ..transfer_core.engine import TransferEngine, TransferRequest
from ..transfer_core.memory import SharedBuffer, view
from ..types import TransferOp, TransferStatus
from .allocator import RangeAllocator, aligned
from .config import ClientConfig, ServerConfig
from .link import MasterLink
from .protocol import (
    Allocs,
    Bools,
    Code,
    Codes,
    Committed,
    Count,
    Err,
    Exists,
    Get,
    Hello,
    HelloOk,
    Loc,
    Locs,
    Msg,
    PutEnd,
    PutReserved,
    PutStart,
    Remove,
    RemoveAll,
    Spare,
    Stats,
    StatsOk,
    stripe_bounds,
)
from .reader import Reader

log = logging.getLogger(__name__)
Result = MooncakeConnectorsError | None


class _Raw:
    """Unregistered memory to copy through staging (touched only once the put is placed)."""

    __slots__ = ("addr", "size")

    def __init__(self, addr: int, size: int) -> None:
        self.addr = addr
        self.size = size


# (registered address, size, what to stage instead: a view of the bytes or raw memory)
Source = tuple[int, int, "memoryview | _Raw | None"]
_BUSY_PAUSE = 0.02
_SLOT = 64 * 1024  # staging slots for single small values (taken without a lock)
_SPARE_MAX = 64 << 20  # puts up to this size reserve room for the next one
_FALLBACK = object()
_SLOTS = 16


def error_for(code: int, key: str, what: str = "") -> StoreError:
    """The exception for a master result code (its ``code`` field keeps the number)."""
    detail = f"{key!r}: {what}" if what else repr(key)
    if code == Code.EXISTS:
        return ObjectExists(f"key exists or is being written: {detail}", key=key, code=code)
    if code in (Code.NO_SPACE, Code.BUSY):
        return CapacityExceeded(
            f"no room for {detail} even after eviction (or larger than any segment)",
            key=key,
            code=int(Code.NO_SPACE),
        )
    if code == Code.PUT_EXPIRED:
        return PutExpired(f"put lease expired before commit: {detail}", key=key, code=code)
    if code == Code.UNAVAILABLE:
        return ReplicaUnavailable(f"no live copy: {detail}", key=key, code=code)
    return StoreError(f"store error {code}: {detail}", key=key, code=code)


def _as_bytes(value: Any) -> memoryview:
    mv = memoryview(value)
    if not mv.c_contiguous:
        raise ConfigError("values must be C-contiguous buffers")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


class StoreClient:
    def __init__(self, config: ClientConfig | None = None, **overrides: Any) -> None:
        cfg = config or ClientConfig()
        self.cfg = cfg.replace(**overrides) if overrides else cfg
        self.client_id = f"client-{uuid.uuid4().hex[:12]}"
        self.engine: TransferEngine | None = None
        self.server: Any = None  # the embedded StoreServer, if any
        self.link = MasterLink(self.cfg.master, self.cfg.rpc_timeout)
        self.stripe_size = 0
        self.put_lease = 60.0
        self._staging: SharedBuffer | None = None
        self._stage_alloc: RangeAllocator | None = None
        self._stage_lock = threading.Lock()
        self._slots: list[int] = []
        # (size, replicas) -> [(reservation id, stripes, use before)]
        self._spares: dict[
            tuple[int, int], list[tuple[int, list[list[tuple[str, int]]], float]]
        ] = {}
        self._stage_base = 0
        self._reader: Reader | None = None
        self._closed = False

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> StoreClient:
        cfg = self.cfg
        from ..transfer_core.descriptor import host_id

        hello = self._master(Hello(self.client_id, host_id()), time.monotonic() + cfg.timeout)
        if not isinstance(hello, HelloOk):
            raise StoreError(f"master refused hello: {getattr(hello, 'message', hello)}")
        self.stripe_size = hello.stripe_size
        self.put_lease = hello.put_lease_ms / 1000
        ecfg = EngineConfig(
            host=cfg.host,
            metadata=cfg.metadata or hello.metadata,
            transports=cfg.transports,
            timeout=cfg.timeout,
        )
        self.engine = TransferEngine(ecfg).start()
        try:
            n_slots = min(_SLOTS, cfg.local_buffer_size // (2 * _SLOT))
            self._staging = self.engine.allocate_buffer(cfg.local_buffer_size)
            self._slots = [self._staging.addr + i * _SLOT for i in range(n_slots)]
            self._stage_alloc = (
                RangeAllocator(cfg.local_buffer_size - n_slots * _SLOT)
                if n_slots
                else RangeAllocator(cfg.local_buffer_size)
            )
            self._stage_base = self._staging.addr + n_slots * _SLOT
            self._reader = Reader(self.engine, cfg.replica_timeout, self.link, cfg.rpc_timeout)
            if cfg.global_segment_size:
                from .server import StoreServer

                scfg = ServerConfig(
                    master=cfg.master,
                    memory=cfg.global_segment_size,
                    host=cfg.host,
                    rpc_timeout=cfg.rpc_timeout,
                )
                self.server = StoreServer(
                    scfg, engine=self.engine, client_id=self.client_id + "-seg"
                ).start()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.server is not None:
            self.server.close()
        if self._reader is not None:
            self._reader.close()
        self.link.close()
        if self.engine is not None:
            self.engine.close()

    def __enter__(self) -> StoreClient:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def local_segment(self) -> str:
        """The embedded segment's name ("" for a pure client)."""
        return self.server.segment if self.server is not None else ""

    # -- plumbing ---------------------------------------------------------------------------
    def _master(self, msg: Msg, deadline: float) -> Msg:
        return self.link.call(msg, deadline)

    def _deadline(self) -> float:
        return time.monotonic() + self.cfg.timeout

    @contextlib.contextmanager
    def _stage(self, sizes: Sequence[int]) -> Iterator[list[int]]:
        """Registered scratch addresses for values of ``sizes`` bytes (staging or temporary)."""
        assert self.engine is not None and self._staging is not None
        if len(sizes) == 1 and sizes[0] <= _SLOT and self._slots:
            addr = self._slots.pop()  # the common single small value: no lock, no allocator
            try:
                yield [addr]
            finally:
                self._slots.append(addr)
            return
        alloc = self._stage_alloc
        assert alloc is not None
        spans = [aligned(n) for n in sizes]
        total = sum(spans)
        with self._stage_lock:
            off = alloc.alloc(total) if total else None
        temp = None
        if off is not None:
            base = self._stage_base + off
        else:
            temp = self.engine.allocate_buffer(max(total, 1))
            base = temp.addr
        addrs = []
        for n in spans:
            addrs.append(base)
            base += n
        try:
            yield addrs
        finally:
            if off is not None:
                with self._stage_lock:
                    alloc.release(off, total)
            if temp is not None:
                self.engine.free_buffer(temp.addr)

    # -- registration -----------------------------------------------------------------------
    def register_buffer(self, buffer: Any, size: int | None = None) -> int:
        """Register memory for zero-copy put_from/get_into: an array/tensor/buffer, or an
        address with ``size``. Returns the address."""
        assert self.engine is not None
        if isinstance(buffer, int):
            if size is None:
                raise ConfigError("register_buffer(address) needs a size")
            return self.engine.register_raw(buffer, size).addr
        return self.engine.register(buffer).addr

    def unregister_buffer(self, addr: int) -> None:
        assert self.engine is not None
        self.engine.unregister(addr)

    # -- puts -------------------------------------------------------------------------------
    def put(
        self,
        key: str,
        value: Any,
        *,
        replicas: int = 1,
        ttl: float | None = None,
        soft_pin: bool = False,
        hard_pin: bool = False,
        preferred_segment: str = "",
    ) -> None:
        """Store ``value`` (any contiguous buffer) under ``key``; raises a StoreError."""
        err = self.put_batch(
            [key],
            [value],
            replicas=replicas,
            ttl=ttl,
            soft_pin=soft_pin,
            hard_pin=hard_pin,
            preferred_segment=preferred_segment,
        )[0]
        if err is not None:
            raise err

    def put_batch(self, keys: Sequence[str], values: Sequence[Any], **opts: Any) -> list[Result]:
        """Put several values in one round trip; per key None (stored) or the error."""
        if len(keys) != len(values):
            raise ConfigError("keys and values differ in length")
        srcs: list[Source] = []
        for v in values:
            mv = _as_bytes(v)
            srcs.append((0, len(mv), mv))  # copied to registered staging once placed
        return self._put(list(keys), srcs, **opts)

    def put_from(self, key: str, addr: int, size: int, **opts: Any) -> None:
        """Zero-copy put from registered memory (other memory is copied through staging)."""
        err = self.batch_put_from([key], [addr], [size], **opts)[0]
        if err is not None:
            raise err

    def batch_put_from(
        self, keys: Sequence[str], addrs: Sequence[int], sizes: Sequence[int], **opts: Any
    ) -> list[Result]:
        if not len(keys) == len(addrs) == len(sizes):
            raise ConfigError("keys, addresses and sizes differ in length")
        srcs: list[Source] = [
            (a, n, None if not n or self._registered(a, n) else _Raw(a, n))
            for a, n in zip(addrs, sizes, strict=True)
        ]
        return self._put(list(keys), srcs, **opts)

    def _registered(self, addr: int, size: int) -> bool:
        assert self.engine is not None
        region = self.engine.local.find(addr, size)
        return region is not None and region.writable

    def _put(self, keys: list[str], srcs: list[Source], **opts: Any) -> list[Result]:
        if len(keys) == 1 and not opts.get("preferred_segment") and srcs[0][1] <= _SPARE_MAX:
            r = self._put_reserved(keys[0], srcs[0], **opts)
            if r is not _FALLBACK:
                return [r]  # type: ignore[list-item]
        results = self._put_once(keys, srcs, **opts)
        # A leader change between allocation and commit loses the allocation (the new master
        # never made it): put those keys again, once, from the same source bytes.
        again = [i for i, r in enumerate(results) if isinstance(r, PutExpired)]
        if again:
            log.info("%d put(s) expired before commit (a master fail-over?); retrying", len(again))
            retried = self._put_once([keys[i] for i in again], [srcs[i] for i in again], **opts)
            for i, r in zip(again, retried, strict=True):
                results[i] = r
        return results

    def _put_once(
        self,
        keys: list[str],
        srcs: list[Source],
        *,
        replicas: int = 1,
        ttl: float | None = None,
        soft_pin: bool = False,
        hard_pin: bool = False,
        preferred_segment: str = "",
    ) -> list[Result]:
        assert self.engine is not None
        if not keys:
            return []
        deadline = self._deadline()
        put_id = random.getrandbits(62) + 1
        results: list[Result] = [None] * len(keys)
        allocs: dict[int, list[list[tuple[str, int]]]] = {}
        todo = list(range(len(keys)))
        while todo:
            reply = self._master(
                PutStart(
                    put_id,
                    [keys[i] for i in todo],
                    [srcs[i][1] for i in todo],
                    replicas,
                    int(ttl * 1000) if ttl else 0,
                    soft_pin,
                    hard_pin,
                    preferred_segment,
                    reserve=len(keys) == 1 and not preferred_segment and srcs[0][1] <= _SPARE_MAX,
                ),
                deadline,
            )
            if isinstance(reply, Allocs) and reply.spare is not None:
                self._keep_spare(srcs[0][1], replicas, reply.spare)
            if not isinstance(reply, Allocs):
                err = self._reply_error(reply, keys[todo[0]])
                for i in todo:
                    results[i] = err
                break
            busy = []
            for i, code, stripes in zip(todo, reply.codes, reply.stripes, strict=True):
                if code == Code.OK:
                    allocs[i] = stripes
                elif code == Code.BUSY and time.monotonic() < deadline:
                    busy.append(i)  # eviction is spilling to SSD; room comes shortly
                else:
                    results[i] = error_for(code, keys[i])
            todo = busy
            if todo:
                time.sleep(_BUSY_PAUSE)
        staged = [i for i in allocs if srcs[i][2] is not None and srcs[i][1]]
        with self._stage([srcs[i][1] for i in staged]) as tmp:
            addrs = [a for a, _, _ in srcs]
            for i, addr in zip(staged, tmp, strict=True):
                what, n = srcs[i][2], srcs[i][1]
                if isinstance(what, _Raw):
                    ctypes.memmove(addr, what.addr, n)
                else:
                    view(addr, n)[:] = what  # type: ignore[index,assignment]
                addrs[i] = addr
            return self._write_and_commit(keys, srcs, addrs, allocs, put_id, results, deadline)

    # -- one-round-trip puts ------------------------------------------------------------------
    # A single put also reserves room for this client's next put of the same size and replica
    # count; that next put writes straight into the reservation and commits it (which reserves
    # again): one control round trip instead of two. An unused reservation expires on the
    # master with the put lease, so a client that dies leaks nothing.
    def _keep_spare(self, size: int, replicas: int, spare: Spare) -> None:
        pool = self._spares.setdefault((size, replicas), [])
        if len(pool) < 4:
            pool.append((spare[0], spare[1], time.monotonic() + self.put_lease * 0.5))

    def _put_reserved(
        self,
        key: str,
        src: Source,
        *,
        replicas: int = 1,
        ttl: float | None = None,
        soft_pin: bool = False,
        hard_pin: bool = False,
        preferred_segment: str = "",
    ) -> Result | object:
        assert self.engine is not None
        size = src[1]
        pool = self._spares.get((size, replicas))
        try:
            rid, stripes, until = pool.pop() if pool else (0, [], 0.0)
        except IndexError:  # another thread took the last one
            return _FALLBACK
        if not rid or until < time.monotonic():
            return _FALLBACK
        deadline = self._deadline()
        with self._stage([size] if src[2] is not None and size else []) as tmp:
            addr = src[0]
            if tmp:
                addr = tmp[0]
                if isinstance(src[2], _Raw):
                    ctypes.memmove(addr, src[2].addr, size)
                else:
                    view(addr, size)[:] = src[2]  # type: ignore[index,assignment]
            reqs = [
                TransferRequest(TransferOp.WRITE, seg, addr + off, remote, n)
                for (off, n), copies in zip(stripe_bounds(size, len(stripes)), stripes, strict=True)
                if n
                for seg, remote in copies
            ]
            if reqs:
                left = min(deadline - time.monotonic(), self.put_lease * 0.4)
                batch = self.engine.submit(reqs, timeout=max(0.001, left))
                batch.wait()
                if any(st is not TransferStatus.COMPLETED for st in batch.statuses):
                    return _FALLBACK  # the reservation expires on the master
        msg = PutReserved(rid, key, size, int(ttl * 1000) if ttl else 0, soft_pin, hard_pin)
        reply = self._master(msg, deadline)
        while (
            isinstance(reply, Committed) and reply.code == Code.BUSY and time.monotonic() < deadline
        ):
            time.sleep(_BUSY_PAUSE)  # a new master still hearing from its servers
            reply = self._master(msg, deadline)
        if not isinstance(reply, Committed):
            return self._reply_error(reply, key)
        if reply.spare is not None:
            self._keep_spare(size, replicas, reply.spare)
        if reply.code == Code.OK:
            return None
        if reply.code == Code.EXISTS:
            self._keep_spare(size, replicas, (rid, stripes))  # still ours
            return error_for(reply.code, key)
        if reply.code == Code.PUT_EXPIRED:
            self._spares.clear()  # a new master, or expired: these are gone
            return _FALLBACK
        return error_for(reply.code, key)

    def _write_and_commit(
        self,
        keys: list[str],
        srcs: list[Source],
        addrs: list[int],
        allocs: dict[int, list[list[tuple[str, int]]]],
        put_id: int,
        results: list[Result],
        deadline: float,
    ) -> list[Result]:
        assert self.engine is not None
        reqs: list[TransferRequest] = []
        owner: list[int] = []
        for i, stripes in allocs.items():
            addr, size = addrs[i], srcs[i][1]
            bounds = stripe_bounds(size, len(stripes))
            for (off, n), copies in zip(bounds, stripes, strict=True):
                if n:
                    for seg, remote in copies:
                        reqs.append(TransferRequest(TransferOp.WRITE, seg, addr + off, remote, n))
                        owner.append(i)
        failed: dict[int, MooncakeConnectorsError] = {}
        if reqs:
            left = min(deadline - time.monotonic(), self.put_lease * 0.8)
            batch = self.engine.submit(reqs, timeout=max(0.001, left))
            batch.wait()
            for j, st in enumerate(batch.statuses):
                if st is not TransferStatus.COMPLETED and owner[j] not in failed:
                    e = batch.errors[j]
                    failed[owner[j]] = StoreError(
                        f"writing {keys[owner[j]]!r} failed: {e}",
                        key=keys[owner[j]],
                        code=int(Code.TRANSFER_FAIL),
                    )
        commit = [i for i in allocs if i not in failed]
        revoke = [keys[i] for i in failed]
        while commit or revoke:
            reply = self._master(PutEnd(put_id, [keys[i] for i in commit], revoke), deadline)
            revoke = []
            if not isinstance(reply, Codes):
                for i in commit:
                    results[i] = self._reply_error(reply, keys[i])
                break
            busy = []
            for i, code in zip(commit, reply.codes, strict=True):
                if code == Code.BUSY and time.monotonic() < deadline:
                    busy.append(i)  # a new master still hearing from its servers
                else:
                    results[i] = None if code == Code.OK else error_for(code, keys[i])
            commit = busy
            if commit:
                time.sleep(_BUSY_PAUSE)
        for i, e in failed.items():
            results[i] = e
        return results

    def _reply_error(self, reply: Msg, key: str) -> StoreError:
        if isinstance(reply, Err):
            return error_for(reply.code, key, reply.message)
        return StoreError(f"unexpected reply {type(reply).__name__}", key=key, code=-1)

    # -- gets -------------------------------------------------------------------------------
    def _lookup(self, keys: list[str], deadline: float) -> list[Loc | None]:
        reply = self._master(Get(keys), deadline)
        if not isinstance(reply, Locs):
            raise self._reply_error(reply, keys[0] if keys else "")
        return reply.items

    def get(self, key: str) -> bytes | None:
        """The value, or None on a miss."""
        out = self.get_batch([key])[0]
        if isinstance(out, MooncakeConnectorsError):
            raise out
        return out

    def get_batch(self, keys: Sequence[str]) -> list[bytes | None]:
        """Values in order; None for a miss (an unreadable key also reads as a miss)."""
        keys = list(keys)
        if not keys:
            return []
        assert self._reader is not None
        deadline = self._deadline()
        locs = self._lookup(keys, deadline)
        found = [(i, loc) for i, loc in enumerate(locs) if loc is not None]
        out: list[bytes | None] = [None] * len(keys)
        with self._stage([loc.size for _, loc in found]) as addrs:
            errors = self._reader.read(
                [(loc, a) for (_, loc), a in zip(found, addrs, strict=True)], deadline
            )
            for (i, loc), addr, err in zip(found, addrs, errors, strict=True):
                if err is None:
                    out[i] = ctypes.string_at(addr, loc.size) if loc.size else b""
                else:
                    log.info("get %r failed, reported as a miss: %s", keys[i], err)
        return out

    def get_into(self, key: str, addr: int, size: int) -> int | None:
        """Read ``key`` into registered memory; bytes read, or None on a miss."""
        out = self.batch_get_into([key], [addr], [size])[0]
        if isinstance(out, MooncakeConnectorsError):
            raise out
        return out

    def batch_get_into(
        self, keys: Sequence[str], addrs: Sequence[int], sizes: Sequence[int]
    ) -> list[int | MooncakeConnectorsError | None]:
        """Per key: bytes read, None on a miss, or the error (e.g. buffer too small)."""
        if not len(keys) == len(addrs) == len(sizes):
            raise ConfigError("keys, addresses and sizes differ in length")
        if not keys:
            return []
        assert self._reader is not None
        deadline = self._deadline()
        locs = self._lookup(list(keys), deadline)
        out: list[int | MooncakeConnectorsError | None] = [None] * len(keys)
        todo = []
        for i, loc in enumerate(locs):
            if loc is None:
                continue
            if loc.size > sizes[i]:
                out[i] = ConfigError(
                    f"buffer of {sizes[i]} bytes is too small for {keys[i]!r} ({loc.size})",
                    key=keys[i],
                    code=int(Code.INVALID),
                )
                continue
            todo.append((i, loc))
        # Unregistered destinations are read through staging, then copied.
        unreg = [k for k, (i, loc) in enumerate(todo) if not self._registered(addrs[i], loc.size)]
        with self._stage([todo[k][1].size for k in unreg]) as tmp:
            dests = [addrs[i] for i, _ in todo]
            for k, addr in zip(unreg, tmp, strict=True):
                dests[k] = addr
            errors = self._reader.read(
                [(loc, d) for (_, loc), d in zip(todo, dests, strict=True)], deadline
            )
            for k in unreg:
                i, loc = todo[k]
                if errors[k] is None and loc.size:
                    ctypes.memmove(addrs[i], dests[k], loc.size)
        for (i, loc), err in zip(todo, errors, strict=True):
            out[i] = loc.size if err is None else err
        return out

    # -- the rest ---------------------------------------------------------------------------
    def exists(self, key: str) -> bool:
        return self.batch_exists([key])[0]

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        reply = self._master(Exists(list(keys)), self._deadline())
        if not isinstance(reply, Bools):
            raise self._reply_error(reply, keys[0] if keys else "")
        return reply.values

    def remove(self, key: str, *, force: bool = False) -> bool:
        """True if removed, False if there was no such key. A leased object disappears at once;
        its memory is reused when the lease ends (``force`` frees it now)."""
        reply = self._master(Remove([key], force), self._deadline())
        if not isinstance(reply, Codes):
            raise self._reply_error(reply, key)
        return reply.codes[0] == Code.OK

    def remove_all(self, *, force: bool = False) -> int:
        """Remove every object; returns how many."""
        reply = self._master(RemoveAll(force), self._deadline())
        if not isinstance(reply, Count):
            raise self._reply_error(reply, "*")
        return reply.n

    def stats(self) -> dict[str, float]:
        """The master's counters and gauges."""
        reply = self._master(Stats(), self._deadline())
        if not isinstance(reply, StatsOk):
            raise self._reply_error(reply, "")
        return reply.stats
