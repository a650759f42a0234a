"""``MooncakeDistributedStore`` with Mooncake 0.3.13's Python API, over our store.

    # from mooncake.store import MooncakeDistributedStore, ReplicateConfig
    from mooncake_connectors.compat import MooncakeDistributedStore, ReplicateConfig

Same method names, argument order and return conventions as Mooncake 0.3.13 (checked against the
wheel): ints are 0 or a negative Mooncake error code (-200 no space, -600 invalid argument, -704
not found, -800 transfer failed, -900 no master); ``get``/``get_batch`` return ``b""`` for a miss;
``get_into``/``batch_get_into`` return the bytes read; ``get_buffer``/``batch_get_buffer`` a
``BufferHandle`` (None for a miss); ``put_parts`` stores its parts' concatenation; ``is_exist``
1/0/-1; ``remove_all`` the number removed; a put of an existing key returns 0 and keeps the
stored value (as Mooncake does).
Two deliberate differences: a value of 0 bytes can be stored (Mooncake refuses it with -600), and
``remove`` of a key a reader just leased succeeds — the key disappears at once and its memory is
reused when the lease ends (Mooncake answers -706 until the lease expires).

Transports: ``protocol="tcp"`` enables our ``shm`` and ``tcp`` transports, and with ``shm`` the
same-host shortcuts: values move through shared memory when the client and the data owner share
a host, and control messages to a loopback master or server take an abstract unix socket.
Mooncake's ``tcp`` has neither. For TCP only (data and control), pass ``transports="tcp"`` to
``setup`` (a keyword, or a key of the dict form) or set ``MOONCAKE_CONNECTORS_TRANSPORTS=tcp``.
"""

from __future__ import annotations

import enum
import logging
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .compat_handles import BufferHandle, HandlePool
from .errors import (
    AccessViolation,
    ConfigError,
    MasterUnavailable,
    MooncakeConnectorsError,
    ObjectExists,
)

if TYPE_CHECKING:
    from .transfer_core.engine import TransferEngine

log = logging.getLogger(__name__)

OK = 0
NO_SPACE = -200
INVALID_PARAMS = -600
NOT_FOUND = -704
TRANSFER_FAIL = -800
RPC_FAIL = -900
INTERNAL_ERROR = -1


def finalize(facade: str, engine: TransferEngine | None, close: Callable[[], object]) -> None:
    """A facade's ``__del__``: ``close()``, or at interpreter exit only abandon its engine.

    At exit our threads are frozen, so close() could wait on them forever; waiting for nothing is
    safe there: the process's exit releases the sockets and memory, and the master sees the
    segment go as that of a process that exited (after its server_ttl)."""
    if sys.is_finalizing():
        if engine is not None:
            engine.abandon()
        return
    try:
        close()
    except Exception as exc:  # never raise from a finalizer
        log.debug("closing %s: %s", facade, exc)


def unsupported(facade: str, name: str, supported: str) -> AttributeError:
    """The error for a Mooncake method the facade does not provide, naming those it does."""
    return AttributeError(
        f"mooncake_connectors.compat.{facade} has no {name!r}; supported: {supported}"
    )


class SoftPinAction(enum.IntEnum):
    PRESERVE = 0
    ENABLE = 1
    DISABLE = 2


class ObjectDataType(enum.IntEnum):
    """Mooncake's hint of what a value holds (accepted; our store treats every value alike)."""

    UNKNOWN = 0
    KVCACHE = 1
    TENSOR = 2
    WEIGHT = 3
    SAMPLE = 4
    ACTIVATION = 5
    GRADIENT = 6
    OPTIMIZER_STATE = 7
    METADATA = 8
    GENERAL = 9


class ReplicateConfig:
    """Mooncake's per-put options (the attributes our store uses are honoured)."""

    def __init__(self) -> None:
        self.replica_num = 1
        self.with_hard_pin = False
        self.with_soft_pin = False  # Mooncake < 0.3.13 spelling
        self.soft_pin_action = SoftPinAction.PRESERVE
        self.soft_pin_ttl_ms: int | None = None
        self.preferred_segment = ""
        self.preferred_segments: list[str] = []
        self.prefer_alloc_in_same_node = False
        self.nof_replica_num = 0
        self.dfs_replica_num = 0
        self.data_type = ObjectDataType.UNKNOWN  # a hint (vLLM's embedding store sets TENSOR)

    def __repr__(self) -> str:
        return (
            f"ReplicateConfig(replica_num={self.replica_num}, with_hard_pin={self.with_hard_pin},"
            f" soft_pin={self._soft()}, preferred_segment={self._preferred()!r})"
        )

    def _soft(self) -> bool:
        return bool(self.with_soft_pin) or self.soft_pin_action == SoftPinAction.ENABLE

    def _preferred(self) -> str:
        return self.preferred_segment or (self.preferred_segments or [""])[0]


def _part(value: Any) -> memoryview:
    """One part of ``put_parts``: a 1-D buffer of 1-byte items, as Mooncake 0.3.13 wants
    (not bytes-like: TypeError; another shape or item size: RuntimeError). A strided part is
    refused too (Mooncake reads the bytes under it as if it were contiguous)."""
    mv = memoryview(value)
    if mv.ndim != 1 or mv.itemsize != 1 or not mv.c_contiguous:
        raise RuntimeError("parts must be 1-D bytes-like")
    return mv if mv.format == "B" else mv.cast("B")


def _code(err: MooncakeConnectorsError | None) -> int:
    if err is None:
        return OK
    if isinstance(err, ObjectExists):
        return OK  # Mooncake reports success and keeps the stored value
    if isinstance(err, MasterUnavailable):
        return RPC_FAIL
    code = err.fields.get("code")
    if isinstance(code, int) and code < 0:
        return code
    if isinstance(err, (ConfigError, AccessViolation)):  # a bad key, size or address
        return INVALID_PARAMS
    return INTERNAL_ERROR


def _read_codes(out: Sequence[int | MooncakeConnectorsError | None]) -> list[int]:
    """A get's per-key outcomes as Mooncake returns them: bytes read, -704 for a miss, or the
    error's code."""
    return [NOT_FOUND if v is None else v if isinstance(v, int) else _code(v) for v in out]


def metadata_url(metadata_server: str) -> str:
    """Our metadata URL for one of Mooncake's metadata_server forms."""
    m = metadata_server.strip()
    if m.upper() == "P2PHANDSHAKE":
        return "p2p"
    if m.startswith(("http://", "etcd://", "memory")):
        return m
    return f"etcd://{m}"  # Mooncake treats a bare HOST:PORT as an etcd endpoint


def _metadata(metadata_server: str) -> str | None:
    """The store client's metadata URL (None: the master's, when none is given)."""
    return metadata_url(metadata_server) if metadata_server.strip() else None


class MooncakeDistributedStore:
    """Mooncake's ``mooncake.store.MooncakeDistributedStore`` over our client."""

    def __init__(self) -> None:
        self._client: Any = None
        self._handles: HandlePool | None = None

    def _fail(self, what: str, exc: BaseException) -> int:
        log.error("%s failed: %s", what, exc)
        return _code(exc) if isinstance(exc, MooncakeConnectorsError) else INTERNAL_ERROR

    # -- setup ------------------------------------------------------------------------------
    def setup(self, *args: Any, **kwargs: Any) -> int:
        """``setup(local_hostname, metadata_server, global_segment_size, local_buffer_size,
        protocol, rdma_devices, master_server_addr, engine=None, ...)`` or ``setup(dict)``.

        Beyond Mooncake's arguments, ``transports`` (keyword or dict key): our transports in
        preference order, ``"tcp"``, ``"shm,tcp"`` or a list of names; default
        ``MOONCAKE_CONNECTORS_TRANSPORTS``, else ``shm,tcp``. Without ``shm`` nothing takes a
        same-host shortcut: data and control messages go over (loopback) TCP."""
        if len(args) == 1 and isinstance(args[0], dict) and not kwargs:
            conf = dict(args[0])
        else:
            names = [
                "local_hostname",
                "metadata_server",
                "global_segment_size",
                "local_buffer_size",
                "protocol",
                "rdma_devices",
                "master_server_addr",
                "engine",
            ]
            if len(args) > len(names):
                return self._fail("setup", TypeError("too many positional arguments"))
            conf = dict(zip(names, args, strict=False))
            conf.update(kwargs)
        if self._client is not None:
            return self._fail("setup", RuntimeError("already set up"))
        try:
            from .config import (
                parse_transports,
                store_token_from_env,
                tls_from_env,
                transports_from_env,
            )
            from .store.client import StoreClient
            from .store.config import ClientConfig

            tenant = str(conf.get("tenant_id") or "default")
            if tenant != "default":  # Mooncake keeps tenants' keys apart; ours has one space
                raise ConfigError(f"tenant_id {tenant!r}: only the default tenant is supported")
            if str(conf.get("protocol", "tcp")).lower() != "tcp":
                raise ConfigError(f"protocol {conf.get('protocol')!r}: only 'tcp' is supported")
            given = conf.get("transports")
            if given is None:
                transports = transports_from_env() or ("shm", "tcp")
            elif isinstance(given, str):
                transports = parse_transports(given)
            elif isinstance(given, (list, tuple)) and all(isinstance(t, str) for t in given):
                transports = parse_transports(",".join(given))
            else:
                raise ConfigError(f"transports must be a string or a list of names: {given!r}")
            host = str(conf.get("local_hostname") or "127.0.0.1").rpartition(":")
            hostname = (host[0] or host[2]) if host[2].isdigit() else "".join(host)
            cfg = ClientConfig(
                master=str(conf.get("master_server_addr") or "127.0.0.1:50051"),
                host="127.0.0.1" if hostname in ("", "localhost") else hostname,
                global_segment_size=int(conf.get("global_segment_size", 16 << 20)),
                local_buffer_size=max(4096, int(conf.get("local_buffer_size", 16 << 20))),
                metadata=_metadata(str(conf.get("metadata_server") or "")),
                transports=transports,
                # Mooncake's setup() has no token argument: the environment carries it.
                auth_token=str(conf.get("auth_token") or store_token_from_env() or "") or None,
                tls=tls_from_env(),  # likewise for TLS: MOONCAKE_CONNECTORS_TLS_*
            )
            self._client = StoreClient(cfg).start()
            # get_buffer's handles: warm blocks, up to the local buffer's size kept idle (what
            # Mooncake's handles view), registered once where large values are read directly.
            direct = self._client.reads_direct
            self._handles = HandlePool(
                cfg.local_buffer_size,
                self._client.register_buffer if direct else None,
                self._client.unregister_buffer if direct else None,
            )
        except (MooncakeConnectorsError, ValueError, OSError, TypeError) as exc:
            self._client = None
            return self._fail("setup", exc)
        return OK

    @property
    def client(self) -> Any:
        """Our StoreClient underneath (for code that wants the richer API)."""
        if self._client is None:
            raise MooncakeConnectorsError("MooncakeDistributedStore is not set up")
        return self._client

    def get_hostname(self) -> str:
        return str(self.client.local_segment or self.client.engine.segment_name)

    def close(self) -> int:
        if self._handles is not None:
            self._handles.close()
            self._handles = None
        if self._client is not None:
            self._client.close()
            self._client = None
        return OK

    # -- buffers ----------------------------------------------------------------------------
    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        try:
            self.client.register_buffer(int(buffer_ptr), int(size))
        except MooncakeConnectorsError as exc:
            log.error("register_buffer failed: %s", exc)
            return INVALID_PARAMS
        return OK

    def unregister_buffer(self, buffer_ptr: int) -> int:
        try:
            self.client.unregister_buffer(int(buffer_ptr))
        except MooncakeConnectorsError as exc:
            log.error("unregister_buffer failed: %s", exc)
            return INVALID_PARAMS
        return OK

    # -- puts -------------------------------------------------------------------------------
    @staticmethod
    def _opts(config: ReplicateConfig | None) -> dict[str, Any]:
        if config is None:
            return {}
        return {
            "replicas": max(1, int(getattr(config, "replica_num", 1) or 1)),
            "hard_pin": bool(getattr(config, "with_hard_pin", False)),
            "soft_pin": config._soft()
            if isinstance(config, ReplicateConfig)
            else bool(getattr(config, "with_soft_pin", False)),
            "preferred_segment": config._preferred()
            if isinstance(config, ReplicateConfig)
            else str(getattr(config, "preferred_segment", "") or ""),
        }

    def put(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        try:
            return _code(self.client.put_batch([key], [value], **self._opts(config))[0])
        except (MooncakeConnectorsError, ValueError, TypeError) as exc:
            return self._fail("put", exc)

    def put_batch(
        self, keys: Sequence[str], values: Sequence[Any], config: ReplicateConfig | None = None
    ) -> int:
        try:
            errs = self.client.put_batch(list(keys), list(values), **self._opts(config))
        except (MooncakeConnectorsError, ValueError, TypeError) as exc:
            return self._fail("put_batch", exc)
        return next((c for c in map(_code, errs) if c), OK)

    def put_parts(self, key: str, *parts: Any, config: ReplicateConfig | None = None) -> int:
        """Store the concatenation of ``parts`` (bytes-like) under ``key``, as Mooncake 0.3.13
        does: 0 or a negative code; a part that is not bytes-like is a ``TypeError``, one not 1-D
        with 1-byte items a ``RuntimeError``; parts of 0
        bytes in all store nothing and answer 0 (what the wheel does)."""
        views = [_part(p) for p in parts]
        if not sum(v.nbytes for v in views):
            return OK
        value = views[0] if len(views) == 1 else b"".join(views)
        return self.put(key, value, config)

    def put_from(
        self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None
    ) -> int:
        return self.batch_put_from([key], [buffer_ptr], [size], config)[0]

    def batch_put_from(
        self,
        keys: Sequence[str],
        buffer_ptrs: Sequence[int],
        sizes: Sequence[int],
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        try:
            errs = self.client.batch_put_from(
                list(keys), list(buffer_ptrs), list(sizes), **self._opts(config)
            )
        except (MooncakeConnectorsError, ValueError, TypeError) as exc:
            return [self._fail("batch_put_from", exc)] * len(keys)
        return [_code(e) for e in errs]

    # -- gets -------------------------------------------------------------------------------
    def get(self, key: str) -> bytes:
        return self.get_batch([key])[0]

    def get_batch(self, keys: Sequence[str]) -> list[bytes]:
        try:
            return [v if v is not None else b"" for v in self.client.get_batch(list(keys))]
        except (MooncakeConnectorsError, ValueError, TypeError) as exc:
            self._fail("get_batch", exc)
            return [b""] * len(keys)

    def get_buffer(self, key: str) -> BufferHandle | None:
        """The value as a :class:`BufferHandle`, or None for a miss (or a failure)."""
        return self.batch_get_buffer([key])[0]

    def batch_get_buffer(self, keys: Sequence[str]) -> list[BufferHandle | None]:
        """Per key a :class:`BufferHandle`, None for a miss; all None when the store fails."""
        try:
            client = self.client
            assert self._handles is not None
            got: list[BufferHandle | None] = client.get_batch_as(list(keys), self._handles.alloc)
            return got
        except (MooncakeConnectorsError, ValueError, TypeError) as exc:
            self._fail("batch_get_buffer", exc)
            return [None] * len(keys)

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        return self.batch_get_into([key], [buffer_ptr], [size])[0]

    def batch_get_into(
        self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        try:
            out = self.client.batch_get_into(list(keys), list(buffer_ptrs), list(sizes))
        except (MooncakeConnectorsError, ValueError, TypeError) as exc:
            return [self._fail("batch_get_into", exc)] * len(keys)
        return _read_codes(out)

    # -- Mooncake's multi-buffer calls (vLLM's MooncakeStoreConnector); see compat_multi --------
    def batch_put_from_multi_buffers(
        self,
        keys: Sequence[str],
        all_buffer_ptrs: Sequence[Sequence[int]],
        all_sizes: Sequence[Sequence[int]],
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        from .compat_multi import put_multi

        try:
            errs = put_multi(self.client, keys, all_buffer_ptrs, all_sizes, self._opts(config))
        except (MooncakeConnectorsError, ValueError, TypeError) as exc:
            return [self._fail("batch_put_from_multi_buffers", exc)] * len(keys)
        return [e if isinstance(e, int) else _code(e) for e in errs]

    def batch_get_into_multi_buffers(
        self,
        keys: Sequence[str],
        all_buffer_ptrs: Sequence[Sequence[int]],
        all_sizes: Sequence[Sequence[int]],
        prefer_alloc_in_same_node: bool = False,
    ) -> list[int]:
        from .compat_multi import get_multi

        try:
            out = get_multi(self.client, keys, all_buffer_ptrs, all_sizes)
        except (MooncakeConnectorsError, ValueError, TypeError) as exc:
            return [self._fail("batch_get_into_multi_buffers", exc)] * len(keys)
        return _read_codes(out)

    def get_size(self, key: str) -> int:
        try:
            loc = self.client._lookup([key], self.client._deadline())[0]
        except MooncakeConnectorsError as exc:
            return self._fail("get_size", exc)
        return NOT_FOUND if loc is None else int(loc.size)

    # -- the rest ---------------------------------------------------------------------------
    def is_exist(self, key: str) -> int:
        return self.batch_is_exist([key])[0]

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        try:
            return [int(b) for b in self.client.batch_exists(list(keys))]
        except MooncakeConnectorsError as exc:
            self._fail("batch_is_exist", exc)
            return [-1] * len(keys)

    def remove(self, key: str, force: bool = False) -> int:
        try:
            return OK if self.client.remove(key, force=force) else NOT_FOUND
        except MooncakeConnectorsError as exc:
            return self._fail("remove", exc)

    def remove_all(self, force: bool = False) -> int:
        try:
            return int(self.client.remove_all(force=force))
        except MooncakeConnectorsError as exc:
            return self._fail("remove_all", exc)

    def __del__(self) -> None:
        engine = None if self._client is None else self._client.engine
        finalize("MooncakeDistributedStore", engine, self.close)

    def __getattr__(self, name: str) -> Any:
        raise unsupported(
            "MooncakeDistributedStore",
            name,
            "setup, put, get, put_batch, get_batch, put_parts, get_buffer, batch_get_buffer, "
            "put_from, get_into, batch_put_from, batch_get_into, batch_put_from_multi_buffers, "
            "batch_get_into_multi_buffers, "
            "is_exist, batch_is_exist, get_size, remove, remove_all, "
            "register_buffer, unregister_buffer, get_hostname, close",
        )
