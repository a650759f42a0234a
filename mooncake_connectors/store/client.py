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
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ..config import EngineConfig
from ..errors import (
    ConfigError,
    MooncakeConnectorsError,
    StoreError,
)
from ..transfer_core.engine import TransferEngine
from ..transfer_core.memory import unmapped
from .config import ClientConfig, ServerConfig
from .link import Dialer, MasterLink
from .protocol import (
    MAX_KEY,
    Bools,
    Code,
    Codes,
    Count,
    Exists,
    Get,
    Hello,
    HelloOk,
    Loc,
    Locs,
    Msg,
    Remove,
    RemoveAll,
    Stats,
    StatsOk,
)
from .reader import Reader
from .staging import Staging
from .writer import Raw, Result, Source, Writer, reply_error

log = logging.getLogger(__name__)


_DIRECT_MIN = 1 << 20
_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.restype = ctypes.py_object
_new_bytes.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)


def _bytes_data_offset() -> int:
    """Where a bytes object's payload starts (CPython); 0 if that cannot be confirmed."""
    probe = bytes(range(16))
    off = bytes.__basicsize__ - 1
    return off if ctypes.string_at(id(probe) + off, 16) == probe else 0


_BYTES_DATA = _bytes_data_offset()

T = TypeVar("T")
Alloc = Callable[[int], tuple[T, int]]
"""Makes a value's object for ``size`` bytes: the object and the address of its bytes."""


def _alloc_bytes(size: int) -> tuple[bytes, int]:
    """A new, uninitialised ``bytes`` of ``size`` (filled by the read before anyone sees it);
    its address needs ``_BYTES_DATA``, so only direct reads (on only where it is known) use it."""
    value = _new_bytes(None, size)
    return value, id(value) + _BYTES_DATA


def check_keys(keys: Sequence[str]) -> None:
    """Refuse (ConfigError, naming the key) a key the master would not take: not a string,
    empty, longer than ``MAX_KEY`` characters, or not encodable as UTF-8 (a lone surrogate)."""
    for key in keys:
        if type(key) is not str or not 0 < len(key) <= MAX_KEY:
            raise ConfigError(
                f"keys are strings of 1..{MAX_KEY} characters, got {key!r:.80}", key=key
            )
        if not key.isascii():
            try:
                key.encode()
            except UnicodeEncodeError as exc:
                raise ConfigError(f"key {key!r:.80} is not valid UTF-8: {exc.reason}") from None


def _as_bytes(value: Any) -> memoryview:
    try:
        mv = memoryview(value)
    except TypeError as exc:
        # str, None, int...: a value is bytes-like; encoding a str is the caller's choice.
        raise ConfigError(
            f"a value must be a contiguous bytes-like buffer, not {type(value).__name__}"
        ) from exc
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
        self.link = MasterLink(self.cfg.master, self.cfg.rpc_timeout, Dialer.of(self.cfg))
        self.stripe_size = 0
        self.put_lease = 60.0
        self._staging: Staging | None = None
        self._writer: Writer | None = None
        self._reader: Reader | None = None
        self._closed = False
        self._direct = False  # large gets read straight into the bytes they return

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
            auth_token=cfg.auth_token,
        ).replace(**(cfg.tls.fields() if cfg.tls else {}))
        self.engine = TransferEngine(ecfg).start()
        try:
            self._staging = Staging(self.engine, cfg.local_buffer_size)

            self._reader = Reader(self.engine, cfg.replica_timeout, self.link, cfg.rpc_timeout)
            # Registering memory re-publishes this engine's descriptor and makes peers that read
            # from it re-fetch: only for a pure client whose metadata is local (p2p, memory).
            self._direct = (
                _BYTES_DATA > 0
                and not cfg.global_segment_size
                and ecfg.metadata.split(":", 1)[0].lower() in ("p2p", "p2phandshake", "memory")
            )
            self._writer = Writer(
                self.engine, self.link, self._staging, self.put_lease, cfg.timeout, self._direct
            )
            if cfg.global_segment_size:
                from .server import StoreServer

                scfg = ServerConfig(
                    master=cfg.master,
                    memory=cfg.global_segment_size,
                    host=cfg.host,
                    rpc_timeout=cfg.rpc_timeout,
                    auth_token=cfg.auth_token,
                    transports=cfg.transports,
                    tls=cfg.tls,
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

    @property
    def reads_direct(self) -> bool:
        """Whether large values are read straight into the caller's new objects (a pure client
        on local metadata: registering memory re-publishes nothing a peer must re-fetch)."""
        return self._direct

    # -- plumbing ---------------------------------------------------------------------------
    def _master(self, msg: Msg, deadline: float) -> Msg:
        return self.link.call(msg, deadline)

    def _deadline(self) -> float:
        return time.monotonic() + self.cfg.timeout

    # -- registration -----------------------------------------------------------------------
    def register_buffer(
        self, buffer: Any, size: int | None = None, *, location: str | None = None
    ) -> int:
        """Register memory for zero-copy put_from/get_into: an array/tensor/buffer, or an
        address with ``size``. Returns the address. GPU memory is registered the same way (a
        CUDA tensor, or an address with ``location="cuda:N"``); puts and gets then read from
        and land in it directly."""
        assert self.engine is not None
        if isinstance(buffer, int):
            if size is None:
                raise ConfigError("register_buffer(address) needs a size")
            return self.engine.register_raw(buffer, size, location=location or "cpu:0").addr
        return self.engine.register(buffer, location=location).addr

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
            (a, n, None if not n or self._registered(a, n) else Raw(a, n))
            for a, n in zip(addrs, sizes, strict=True)
        ]
        return self._put(list(keys), srcs, **opts)

    def _put(self, keys: list[str], srcs: list[Source], **opts: Any) -> list[Result]:
        assert self._writer is not None
        check_keys(keys)
        if opts.get("preferred_segment"):
            check_keys([opts["preferred_segment"]])
        return self._writer.put(keys, srcs, **opts)

    def _stage(self, sizes: Sequence[int]) -> contextlib.AbstractContextManager[list[int]]:
        assert self._staging is not None
        return self._staging.stage(sizes)

    def _reply_error(self, reply: Msg, key: str) -> StoreError:
        return reply_error(reply, key)

    def _registered(self, addr: int, size: int) -> bool:
        assert self.engine is not None
        region = self.engine.local.find(addr, size)
        return region is not None and region.writable

    # -- gets -------------------------------------------------------------------------------
    def _lookup(self, keys: list[str], deadline: float) -> list[Loc | None]:
        check_keys(keys)
        reply = self._master(Get(keys), deadline)
        if not isinstance(reply, Locs):
            raise self._reply_error(reply, keys[0] if keys else "")
        return reply.items

    def get(self, key: str) -> bytes | None:
        """The value, or None on a miss (an unreadable key also reads as a miss)."""
        assert self._reader is not None
        deadline = self._deadline()
        locs = self._lookup([key], deadline)
        loc = locs[0]
        if loc is None:
            return None
        if loc.size >= _DIRECT_MIN and self._direct:
            return self._values([key], locs, deadline, _alloc_bytes)[0]
        with self._stage([loc.size]) as (addr,):  # the common small value: one staging slot
            err = self._reader.read([(loc, addr)], deadline)[0]
            if err is None:
                return ctypes.string_at(addr, loc.size) if loc.size else b""
        log.info("get %r failed, reported as a miss: %s", key, err)
        return None

    def get_batch(self, keys: Sequence[str]) -> list[bytes | None]:
        """Values in order; None for a miss (an unreadable key also reads as a miss)."""
        return self.get_batch_as(keys, _alloc_bytes)

    def get_batch_as(self, keys: Sequence[str], alloc: Alloc[T]) -> list[T | None]:
        """Values in order, each read straight into an object ``alloc(size)`` made (returning
        the object and the address of its ``size`` writable bytes, which must stay put while
        the object lives); None for a miss (an unreadable key also reads as a miss). The one
        copy of a value is the read (or, through staging, one copy out of it)."""
        keys = list(keys)
        if not keys:
            return []
        deadline = self._deadline()
        return self._values(keys, self._lookup(keys, deadline), deadline, alloc)

    def _values(
        self, keys: list[str], locs: list[Loc | None], deadline: float, alloc: Alloc[T]
    ) -> list[T | None]:
        """Read the found values into objects ``alloc`` makes: straight into them when the
        allocator's memory is registered (a pool's), or when this pure client registers them
        for the read (large values); else through staging and one copy out."""
        assert self._reader is not None
        found = [(i, loc) for i, loc in enumerate(locs) if loc is not None]
        out: list[T | None] = [None] * len(keys)
        if not found:
            return out
        as_bytes = alloc is _alloc_bytes  # type: ignore[comparison-overlap]
        # bytes are made only where read into directly (their address needs _BYTES_DATA)
        made = None if as_bytes else [alloc(loc.size) for _, loc in found]
        if made and all(
            loc.size and self._registered(a, loc.size)
            for (_, a), (_, loc) in zip(made, found, strict=True)
        ):
            return self._read_made(keys, found, made, deadline, out)
        if self._direct and all(loc.size >= _DIRECT_MIN for _, loc in found):
            made = made or [alloc(loc.size) for _, loc in found]
            regions = self._register_for(made, found)
            if regions is not None:
                assert self.engine is not None
                try:
                    return self._read_made(keys, found, made, deadline, out)
                finally:
                    for region in regions:
                        self.engine.unregister(region)
        with self._stage([loc.size for _, loc in found]) as addrs:
            errors = self._reader.read(
                [(loc, a) for (_, loc), a in zip(found, addrs, strict=True)], deadline
            )
            for k, ((i, loc), addr, err) in enumerate(zip(found, addrs, errors, strict=True)):
                if err is not None:
                    log.info("get %r failed, reported as a miss: %s", keys[i], err)
                elif as_bytes:
                    out[i] = ctypes.string_at(addr, loc.size) if loc.size else b""  # type: ignore[assignment]
                else:
                    assert made is not None
                    value, dest = made[k]
                    if loc.size:
                        ctypes.memmove(dest, addr, loc.size)
                    out[i] = value
        return out

    def _read_made(
        self,
        keys: list[str],
        found: list[tuple[int, Loc]],
        made: list[tuple[T, int]],
        deadline: float,
        out: list[T | None],
    ) -> list[T | None]:
        assert self._reader is not None
        errors = self._reader.read(
            [(loc, a) for (_, loc), (_, a) in zip(found, made, strict=True)], deadline
        )
        for (i, _), (value, _), err in zip(found, made, errors, strict=True):
            if err is None:
                out[i] = value
            else:
                log.info("get %r failed, reported as a miss: %s", keys[i], err)
        return out

    def _register_for(
        self, made: list[tuple[Any, int]], found: list[tuple[int, Loc]]
    ) -> list[Any] | None:
        """Register the new objects' memory for one direct read (None: stage instead)."""
        assert self.engine is not None
        ranges = [(a, loc.size) for (_, a), (_, loc) in zip(made, found, strict=True)]
        if any(
            self.engine.local.find(a, 1) or self.engine.local.find(a + n - 1, 1) for a, n in ranges
        ):
            return None  # memory someone registered and freed: stay out of its way
        try:
            regions: list[Any] = self.engine.register_many(
                ranges, owner=[v for v, _ in made], check=False
            )
        except MooncakeConnectorsError as exc:
            log.debug("direct get unavailable (%s); staging instead", exc)
            return None
        return regions

    def get_into(self, key: str, addr: int, size: int) -> int | None:
        """Read ``key`` into registered memory; bytes read, or None on a miss."""
        assert self._reader is not None
        deadline = self._deadline()
        locs = self._lookup([key], deadline)
        loc = locs[0]
        if loc is not None and loc.size <= size and self._registered(addr, loc.size):
            err = self._reader.read([(loc, addr)], deadline)[0]  # the common case, direct
            if err is not None:
                raise err
            return loc.size
        out = self._read_into([key], locs, [addr], [size], deadline)[0]
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
        deadline = self._deadline()
        keys = list(keys)
        return self._read_into(keys, self._lookup(keys, deadline), addrs, sizes, deadline)

    def _read_into(
        self,
        keys: Sequence[str],
        locs: list[Loc | None],
        addrs: Sequence[int],
        sizes: Sequence[int],
        deadline: float,
    ) -> list[int | MooncakeConnectorsError | None]:
        assert self._reader is not None
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
        # Unregistered destinations are read through staging, then copied: memory that is not
        # writable there is refused rather than copied into (which would crash the process).
        raw = [k for k, (i, loc) in enumerate(todo) if not self._registered(addrs[i], loc.size)]
        bad = unmapped([(addrs[todo[k][0]], todo[k][1].size) for k in raw], write=True)
        for j, exc in bad.items():
            out[todo[raw[j]][0]] = exc
        refused, unregistered = {raw[j] for j in bad}, set(raw)
        kept = [k for k in range(len(todo)) if k not in refused]
        unreg = [n for n, k in enumerate(kept) if k in unregistered]  # indices into the new todo
        todo = [todo[k] for k in kept]
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
        check_keys(keys)
        reply = self._master(Exists(list(keys)), self._deadline())
        if not isinstance(reply, Bools):
            raise self._reply_error(reply, keys[0] if keys else "")
        return reply.values

    def remove(self, key: str, *, force: bool = False) -> bool:
        """True if removed, False if there was no such key. A leased object disappears at once;
        its memory is reused when the lease ends (``force`` frees it now)."""
        check_keys([key])
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
