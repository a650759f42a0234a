"""An LMCache storage layer on CPU wired to our store, as LMCache builds it from its config.

Shared by the tests and by ``lmcache_instance.py`` (a second LMCache in its own process).
Chunks are real ``MemoryObj``s from LMCache's own allocator, filled with a pattern per seed.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.event_manager import EventManager
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.remote_backend import RemoteBackend
from lmcache.v1.storage_backend.storage_manager import StorageManager

PLUGIN = "mooncake_connectors"
MOONCAKESTORE = "mooncakestore"  # LMCache's own Mooncake connector (needs mooncake.store)
MODEL = "tiny-llama"
CHUNK = 16  # tokens per chunk
LAYERS, HEADS, HEAD_SIZE = 2, 2, 64
DTYPE = torch.bfloat16
TOKEN_BYTES = 2 * LAYERS * HEADS * HEAD_SIZE * 2  # K and V, bf16
CHUNK_BYTES = CHUNK * TOKEN_BYTES


def engine_config(master: str, **settings: Any) -> Any:
    """LMCache's config with our plugin; ``settings`` become remote_storage_plugin.<name>.*"""
    extra: dict[str, Any] = {
        f"remote_storage_plugin.{PLUGIN}.module_path": "mooncake_connectors.adapters.lmcache",
        f"remote_storage_plugin.{PLUGIN}.class_name": "StoreConnector",
        f"remote_storage_plugin.{PLUGIN}.master": master,
    }
    lmcache_extra = settings.pop("lmcache_extra", {})
    extra.update({f"remote_storage_plugin.{PLUGIN}.{k}": v for k, v in settings.items()})
    extra.update(lmcache_extra)
    return LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK,
        local_cpu=False,  # every hit below comes from the store, not LMCache's own CPU cache
        max_local_cpu_size=0.03,
        remote_serde="naive",
        remote_storage_plugins=[PLUGIN],
        extra_config=extra,
    )


def mooncakestore_config(master: str, save_chunk_meta: bool = False) -> Any:
    """LMCache's config for its own ``mooncakestore`` connector, as LMCache users write it for
    Mooncake's store: Mooncake's setup keys (``mooncake_`` prefix: LMCache 0.5.6 forwards its
    legacy ``master_server_address`` under a name Mooncake 0.3.13 ignores)."""
    return LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK,
        local_cpu=False,
        max_local_cpu_size=0.03,
        remote_serde="naive",
        remote_storage_plugins=[MOONCAKESTORE],
        extra_config={
            "local_hostname": "127.0.0.1",
            "metadata_server": "P2PHANDSHAKE",
            "mooncake_master_server_addr": master,
            "global_segment_size": 0,  # the store servers hold the data
            "local_buffer_size": 16 << 20,
            "protocol": "tcp",
            "device_name": "",
            "save_chunk_meta": save_chunk_meta,
            "transfer_timeout": 10,
        },
    )


def metadata() -> Any:
    return LMCacheMetadata(
        model_name=MODEL,
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=DTYPE,
        kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD_SIZE),
        chunk_size=CHUNK,
    )


def storage_manager(master: str, backend: str = PLUGIN, **settings: Any) -> Any:
    if backend == MOONCAKESTORE:
        config = mooncakestore_config(master, **settings)
    else:
        config = engine_config(master, **settings)
    return StorageManager(config, metadata(), EventManager())


def remote(sm: Any, plugin: str = PLUGIN) -> Any:
    backend = sm.storage_backends[f"RemoteBackend-{plugin}"]
    assert isinstance(backend, RemoteBackend)
    return backend


def connector(sm: Any) -> Any:
    """Our connector inside LMCache's InstrumentedRemoteConnector wrapper."""
    return remote(sm).connection.getWrappedConnector()


def key(seed: int) -> Any:
    return CacheEngineKey(model_name=MODEL, world_size=1, worker_id=0, chunk_hash=seed, dtype=DTYPE)


def pattern(seed: int, tokens: int = CHUNK) -> bytes:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=tokens * TOKEN_BYTES, dtype=np.uint8).tobytes()


def chunk(sm: Any, seed: int, tokens: int = CHUNK) -> Any:
    """A MemoryObj from LMCache's allocator, KV_2LTD [2, layers, tokens, hidden]."""
    shape = torch.Size([2, LAYERS, tokens, HEADS * HEAD_SIZE])
    obj = sm.allocate(shape, DTYPE, MemoryFormat.KV_2LTD, busy_loop=False)
    assert obj is not None, "LMCache's CPU buffer is full"
    obj.byte_array.cast("B")[:] = pattern(seed, tokens)
    return obj


def put(sm: Any, seeds: list[int], tokens: int = CHUNK) -> list[Any]:
    """Put one chunk per seed through LMCache's storage manager (asynchronous in LMCache)."""
    keys = [key(s) for s in seeds]
    sm.batched_put(keys, [chunk(sm, s, tokens) for s in seeds])
    return keys


def wait_stored(sm: Any, seeds: list[int], timeout: float = 20.0, plugin: str = PLUGIN) -> None:
    """Until the store answers contains for every key (LMCache's puts are fire-and-forget)."""
    backend = remote(sm, plugin)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if all(backend.contains(key(s)) for s in seeds):
            return
        time.sleep(0.02)
    raise AssertionError(f"chunks {seeds} not in the store after {timeout}s")


def matches(obj: Any, seed: int, tokens: int = CHUNK) -> bool:
    if obj is None:
        return False
    shape = list(obj.get_shape())
    return shape == [2, LAYERS, tokens, HEADS * HEAD_SIZE] and bytes(obj.byte_array) == pattern(
        seed, tokens
    )
