"""LMCache's ``RemoteConnector`` over our store, loaded through ``remote_storage_plugins``.

LMCache builds it as ``StoreConnector(loop=, local_cpu_backend=, config=)`` (see docs/lmcache.md
for the config). It converts at the boundary — LMCache keys to store keys, MemoryObjs to
addresses or framed values (:mod:`.chunks`) — and delegates to one :class:`GuardedStore`,
which connects in the background and runs every store call on its own threads with a deadline.
What LMCache sees of a store failure is a miss: ``None`` from a get, ``False`` or a shorter
prefix from a contains, a put that did not happen; never an exception, and never a wait past the
deadline on its event loop.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from ...errors import ConfigError, MooncakeConnectorsError
from ...store.client import StoreClient
from ...store.guarded import FAILED, Failed, GuardedStore
from .chunks import ChunkCodec, release
from .config import Layout, PluginConfig, find_plugin_name, from_extra_config

log = logging.getLogger(__name__)


def _loads_class(cls: type) -> Callable[[str, str], bool]:
    """Does (module_path, class_name) name ``cls``? LMCache imported it already to build us."""

    def check(module: str, name: str) -> bool:
        return bool(module) and getattr(sys.modules.get(module), name, None) is cls

    return check


def cpu_buffer(local_cpu_backend: Any) -> tuple[int, int] | None:
    """(address, bytes) of the host buffer LMCache's CPU allocator carves MemoryObjs from."""
    allocator = getattr(local_cpu_backend, "memory_allocator", None)
    for owner in (allocator, getattr(allocator, "pin_allocator", None)):
        buf = getattr(owner, "buffer", None)
        if buf is not None and hasattr(buf, "data_ptr") and buf.device.type == "cpu":
            size = int(buf.numel()) * int(buf.element_size())
            if size:
                return int(buf.data_ptr()), size
    return None


class StoreConnector(RemoteConnector):  # type: ignore[misc]
    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend: Any, config: Any):
        metadata = getattr(local_cpu_backend, "metadata", None)
        config = config if config is not None else getattr(local_cpu_backend, "config", None)
        if metadata is None or config is None:
            raise ConfigError(
                "the store connector needs a worker's LocalCPUBackend (with metadata) and the "
                "LMCache config; the scheduler role is not supported"
            )
        super().__init__(config, metadata)
        name = find_plugin_name(
            config.remote_storage_plugins, config.extra_config, _loads_class(type(self))
        )
        self.settings: PluginConfig = from_extra_config(name, config.extra_config)
        self.layout = self._resolve_layout(self.settings.layout, config)
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.name = name
        self.prefix = f"{self.settings.key_prefix}{self.layout.value}/"
        # (address, bytes) of LMCache's CPU buffer once registered with the client.
        self.registered: tuple[int, int] | None = None
        self.guard = GuardedStore(
            self.settings.client_config(),
            cooldown=self.settings.cooldown,
            name=f"lmcache-{name}",
            on_connect=self._register_buffer,
            workers=self.settings.workers,
        )
        self.codec = ChunkCodec(
            local_cpu_backend,
            self.meta_shapes,
            self.meta_dtypes,
            self.meta_fmt,
            self.full_chunk_size_bytes,
            self.single_token_size,
            self.reshape_partial_chunk,
            self.guard.log.warn,
        )
        self._written: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._written_lock = threading.Lock()
        log.info(
            "LMCache plugin %r: store %s, layout %s, key prefix %r",
            name,
            self.settings.master,
            self.layout.value,
            self.prefix,
        )

    @staticmethod
    def _resolve_layout(layout: Layout, config: Any) -> Layout:
        plain = config.remote_serde in (None, "naive") and not config.use_layerwise
        if layout is Layout.AUTO:
            return Layout.RAW if plain else Layout.FRAMED
        if layout is Layout.RAW and not plain:
            raise ConfigError(
                "layout raw needs remote_serde naive and use_layerwise false (chunks of other "
                f"shapes need their header): serde {config.remote_serde!r}, layerwise "
                f"{config.use_layerwise}; use layout auto or framed"
            )
        return layout

    def _register_buffer(self, client: StoreClient) -> None:
        if not self.settings.register_buffer or self.registered is not None:
            return
        buf = cpu_buffer(self.local_cpu_backend)
        if buf is None:
            log.info("LMCache's CPU buffer is not reachable: chunks are copied via staging")
            return
        try:
            client.register_buffer(buf[0], buf[1])
            self.registered = buf
        except MooncakeConnectorsError as exc:
            log.warning("registering LMCache's CPU buffer failed (copies instead): %s", exc)

    # -- helpers ----------------------------------------------------------------------------
    def store_key(self, key: Any) -> str:
        return self.prefix + str(key.to_string())

    def _remember(self, keys: Sequence[str]) -> None:
        limit = self.settings.list_limit
        if not limit:
            return
        with self._written_lock:
            for k in keys:
                self._written[k] = None
                self._written.move_to_end(k)
            while len(self._written) > limit:
                self._written.popitem(last=False)

    async def _exists_many(self, keys: list[Any]) -> list[bool]:
        skeys = [self.store_key(k) for k in keys]
        got = await self.guard.run("exists", lambda c: c.batch_exists(skeys))
        return [False] * len(keys) if got is FAILED else got

    def _exists_many_sync(self, keys: list[Any]) -> list[bool]:
        skeys = [self.store_key(k) for k in keys]
        got = self.guard.run_sync("exists", lambda c: c.batch_exists(skeys))
        return [False] * len(keys) if got is FAILED else got

    @staticmethod
    def _prefix_len(found: Sequence[bool]) -> int:
        n = 0
        for hit in found:
            if not hit:
                break
            n += 1
        return n

    # -- RemoteConnector: contains ------------------------------------------------------------
    async def exists(self, key: Any) -> bool:
        return (await self._exists_many([key]))[0]

    def exists_sync(self, key: Any) -> bool:
        return self._exists_many_sync([key])[0]

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[Any]) -> int:
        """How many leading keys the store holds (one round trip)."""
        return self._prefix_len(self._exists_many_sync(list(keys))) if keys else 0

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(
        self, lookup_id: str, keys: list[Any], pin: bool = False
    ) -> int:
        return self._prefix_len(await self._exists_many(list(keys))) if keys else 0

    # -- RemoteConnector: get -----------------------------------------------------------------
    def support_batched_get(self) -> bool:
        return True

    async def get(self, key: Any) -> Any | None:
        return (await self.batched_get([key]))[0]

    async def batched_get(self, keys: list[Any]) -> list[Any | None]:
        """One MemoryObj (one reference, the caller's) or None per key."""
        if not keys:
            return []
        skeys = [self.store_key(k) for k in keys]
        read = self.codec.get_raw if self.layout is Layout.RAW else self.codec.get_framed
        got: list[Any | None] | Failed = await self.guard.run(
            "get", lambda c: read(c, skeys), unclaimed=release
        )
        return [None] * len(keys) if got is FAILED else got

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(self, lookup_id: str, keys: list[Any]) -> list[Any]:
        """The leading run of hits (LMCache loads a prefix); later hits are released."""
        got = await self.batched_get(list(keys))
        n = next((i for i, obj in enumerate(got) if obj is None), len(got))
        release(got[n:])
        return got[:n]

    # -- RemoteConnector: put -----------------------------------------------------------------
    def support_batched_put(self) -> bool:
        return True

    async def put(self, key: Any, memory_obj: Any) -> None:
        await self.batched_put([key], [memory_obj])

    async def batched_put(self, keys: list[Any], memory_objs: list[Any]) -> None:
        """Store each object; failures are logged, never raised. LMCache drops its reference
        when this returns; ours keeps the memory alive until the store is done with it."""
        pairs = list(zip(keys, memory_objs, strict=True))
        if self.layout is Layout.RAW:
            kept = []
            for key, obj in pairs:
                why = self.codec.raw_misfit(obj)
                if why is None:
                    kept.append((key, obj))
                else:
                    self.guard.log.warn("layout", "chunk %s not stored (raw layout): %s", key, why)
            pairs = kept
        if not pairs:
            return
        skeys = [self.store_key(k) for k, _ in pairs]
        objs = [obj for _, obj in pairs]
        write = self.codec.put_raw if self.layout is Layout.RAW else self.codec.put_framed
        replicas = self.settings.replicas
        for obj in objs:
            obj.ref_count_up()
        got = await self.guard.run(
            "put", lambda c: write(c, skeys, objs, replicas), ended=lambda: release(objs)
        )
        if got is not FAILED:
            self._remember([s for s, ok in zip(skeys, got, strict=True) if ok])

    # -- RemoteConnector: the rest ------------------------------------------------------------
    def remove_sync(self, key: Any) -> bool:
        got = self.guard.run_sync("remove", lambda c: c.remove(self.store_key(key)))
        return False if got is FAILED else got

    async def list(self) -> list[str]:
        """Keys this connector wrote (the last ``list_limit``) that the store still holds.

        The store has no key listing, so keys other instances wrote are not listed."""
        with self._written_lock:
            skeys = list(self._written)
        if not skeys:
            return []
        got = await self.guard.run("list", lambda c: c.batch_exists(skeys))
        if got is FAILED:
            return []
        n = len(self.prefix)
        return [s[n:] for s, hit in zip(skeys, got, strict=True) if hit]

    def support_ping(self) -> bool:
        return True

    async def ping(self) -> int:
        """0 when the master answers, 1 otherwise (also during a cool-down)."""
        got = await self.guard.run("ping", lambda c: c.stats())
        return 1 if got is FAILED else 0

    async def close(self) -> None:
        """Release the client, its threads and the buffer registration (bounded)."""
        try:
            await asyncio.wait_for(
                asyncio.get_running_loop().run_in_executor(None, self.guard.close),
                self.settings.timeout + 1.0,
            )
        except asyncio.TimeoutError:
            log.warning("closing the store connector took over %.1f s", self.settings.timeout)

    def __repr__(self) -> str:
        return f"<StoreConnector {self.name} {self.settings.master} {self.layout.value}>"
