"""``HiCacheStore``: SGLang's ``HiCacheStorage`` over our store.

SGLang builds it as ``HiCacheStore(storage_config, kwargs)`` for ``--hicache-storage-backend
dynamic`` and hands it the host memory pool through ``register_mem_pool_host``. This class only
converts: SGLang page hashes and host-pool indices become store keys (:mod:`.keys`) and memory
pieces (the pool's ``get_page_buffer_meta``), and one :class:`.pages.PageStore` does the rest.
No method raises into SGLang's cache controller: failures are misses, ``False`` or 0.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from ...errors import ConfigError
from .config import HiCacheStoreConfig, from_extra_config
from .keys import KeyScheme, Shard, page_format
from .pages import Counters, PageStore, Piece

log = logging.getLogger(__name__)


class HiCacheStore(HiCacheStorage):
    def __init__(self, storage_config: Any, kwargs: dict[str, Any] | None = None) -> None:
        extra = dict(storage_config.extra_config or {})
        self.config: HiCacheStoreConfig = from_extra_config(extra)
        self.storage_config = storage_config
        # SGLang takes the zero-copy path only with interface_v1; otherwise it calls
        # batch_get/batch_set with flat pages, and batch_exists must look for those.
        self.zero_copy = bool(extra.get("interface_v1", 0))
        self.is_mla = bool(storage_config.is_mla_model)
        self.is_writer = bool(storage_config.is_storage_writer)
        if getattr(storage_config, "should_split_heads", False):
            raise ConfigError("HiCacheStore does not support tp_lcm_size (split heads)")
        if getattr(storage_config, "dcp_size", 1) > 1:
            raise ConfigError("HiCacheStore does not support decode context parallelism")
        self.shard = Shard(
            is_mla=self.is_mla,
            tp_rank=storage_config.tp_rank,
            tp_size=storage_config.tp_size,
            pp_rank=storage_config.pp_rank,
            pp_size=storage_config.pp_size,
            cp_rank=storage_config.attn_cp_rank,
            cp_size=storage_config.attn_cp_size,
        )
        self.model = self.config.model or storage_config.model_name or "unnamed"
        self.enable_metrics = bool(storage_config.enable_storage_metrics)
        self.mem_pool_host: Any = None
        self.keys = self._scheme("raw")  # until a pool says which page format it holds
        self._page_bytes = 0
        self._metrics: dict[str, list[float]] = {
            "prefetch_pgs": [],
            "backup_pgs": [],
            "prefetch_bandwidth": [],
            "backup_bandwidth": [],
        }
        self.store = PageStore(
            self.config, ranks_per_server=self.shard.tp_size * self.shard.pp_size
        )
        self.store.settle()  # bounded by the timeout; if unreachable, retried in the background

    def _scheme(self, fmt: str) -> KeyScheme:
        return KeyScheme(
            namespace=self.config.namespace,
            model=self.model,
            shard=self.shard,
            fmt=fmt,
            tenant=self.config.tenant,
            tag=self.config.tag,
        )

    # -- host pool ----------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        kv = getattr(mem_pool_host, "kv_buffer", None)
        if not isinstance(kv, torch.Tensor):
            raise ConfigError(
                f"HiCacheStore needs a host pool with one kv_buffer tensor, got "
                f"{type(mem_pool_host).__name__}"
            )
        fmt = page_format(
            mem_pool_host.layout,
            str(mem_pool_host.dtype),
            mem_pool_host.page_size,
            getattr(mem_pool_host, "storage_format_tag", None),
        )
        super().register_mem_pool_host(mem_pool_host)
        self.keys = self._scheme(fmt)
        self.store.register(kv.data_ptr(), kv.numel() * kv.element_size())
        probe = torch.zeros(mem_pool_host.page_size, dtype=torch.int64)
        self._page_bytes = sum(mem_pool_host.get_page_buffer_meta(probe)[1])
        log.info("HiCacheStore: keys %s/<page>/%s", self.keys.prefix, "|".join(self.keys.parts))

    def _objects(self, n_pages: int, host_indices: Any) -> list[list[Piece]]:
        """Pieces of every object of these pages, in ``KeyScheme.objects`` order."""
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        parts = len(self.keys.parts)
        if len(ptrs) != len(sizes) or not n_pages or len(ptrs) % (n_pages * parts):
            raise ConfigError(
                f"host pool gave {len(ptrs)} buffers for {n_pages} pages of {parts} part(s)"
            )
        per_page = len(ptrs) // n_pages
        out = []
        for p in range(n_pages):
            page = list(
                zip(
                    ptrs[p * per_page : (p + 1) * per_page],
                    sizes[p * per_page : (p + 1) * per_page],
                    strict=True,
                )
            )
            # MHA pieces alternate K, V (one pair per page, or per layer of a layer_first page).
            out.extend([page[j::parts] for j in range(parts)])
        return out

    def _pages_ok(self, per_object: Sequence[bool]) -> list[bool]:
        parts = len(self.keys.parts)
        return [all(per_object[i : i + parts]) for i in range(0, len(per_object), parts)]

    def _record(self, kind: str, pages: int, seconds: float) -> None:
        if self.enable_metrics and pages:
            gb = pages * self._page_bytes / (1 << 30)
            self._metrics[f"{kind}_pgs"].append(pages)
            self._metrics[f"{kind}_bandwidth"].append(gb / max(seconds, 1e-9))

    def _guard(self, what: str, failed: Any) -> _Guard:
        """A block whose unexpected exception makes the call return ``failed``, logged."""
        return _Guard(self, what, failed)

    # -- zero copy (interface_v1) -------------------------------------------------------------
    def batch_set_v1(
        self, keys: list[str], host_indices: Any, extra_info: Any = None
    ) -> list[bool]:
        if not keys:
            return []
        if self.is_mla and not self.is_writer:
            return [True] * len(keys)  # the writer rank stores the page all ranks share
        return self._pages_v1("batch_set_v1", "backup", self.store.put, keys, host_indices)

    def batch_get_v1(
        self, keys: list[str], host_indices: Any, extra_info: Any = None
    ) -> list[bool]:
        if not keys:
            return []
        return self._pages_v1("batch_get_v1", "prefetch", self.store.get, keys, host_indices)

    def _pages_v1(
        self,
        what: str,
        kind: str,
        move: Callable[[list[str], list[list[Piece]]], list[bool]],
        keys: list[str],
        host_indices: Any,
    ) -> list[bool]:
        """Move whole pages between the host pool and the store; a page counts (in ``kind``'s
        metrics) only when all its objects moved."""
        if self.mem_pool_host is None:
            return [False] * len(keys)
        with self._guard(what, [False] * len(keys)) as g:
            t0 = time.perf_counter()
            moved = move(self.keys.objects(keys), self._objects(len(keys), host_indices))
            ok = self._pages_ok(moved)
            self._record(kind, sum(ok), time.perf_counter() - t0)
            g.result = ok
        return list(g.result)

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many pages, from the first, are in the store (all their objects)."""
        if not keys:
            return 0
        names = self.keys.objects(keys) if self.zero_copy else self.keys.flat(keys)
        found = self.store.exists(names)
        pages = self._pages_ok(found) if self.zero_copy else found
        return pages.index(False) if False in pages else len(pages)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- whole pages as tensors (SGLang's non-zero-copy calls) --------------------------------
    def set(
        self,
        key: str,
        value: Any = None,
        target_location: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        return self.batch_set([key], [value], target_location, target_sizes)

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Store each tensor (``values``) under its key; True if all are in the store."""
        if not keys:
            return True
        if self.is_mla and not self.is_writer:
            return True
        if values is None or len(values) != len(keys):
            log.warning("HiCacheStore.batch_set needs one tensor per key")
            return False
        with self._guard("batch_set", False) as g:
            objects = []
            for v in values:
                if not isinstance(v, torch.Tensor) or not v.is_contiguous() or v.is_cuda:
                    raise ConfigError("batch_set values must be contiguous CPU tensors")
                objects.append([(v.data_ptr(), v.numel() * v.element_size())])
            g.result = all(self.store.put(self.keys.flat(keys), objects))
        return bool(g.result)

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[Any]:
        """Per key: the tensor read (into ``target_locations[i]`` when given), or None."""
        if not keys:
            return []
        with self._guard("batch_get", [None] * len(keys)) as g:
            names = self.keys.flat(keys)
            if target_locations is None:
                g.result = [
                    None if b is None else torch.frombuffer(bytearray(b), dtype=torch.uint8)
                    for b in self.store.get_values(names)
                ]
            else:
                objects = []
                for t in target_locations:
                    if not isinstance(t, torch.Tensor) or not t.is_contiguous() or t.is_cuda:
                        raise ConfigError("batch_get targets must be contiguous CPU tensors")
                    objects.append([(t.data_ptr(), t.numel() * t.element_size())])
                ok = self.store.get(names, objects)
                g.result = [t if hit else None for t, hit in zip(target_locations, ok, strict=True)]
        return list(g.result)

    # -- the rest -----------------------------------------------------------------------------
    def clear(self) -> None:
        if not self.config.allow_clear:
            log.info("HiCacheStore.clear ignored (allow_clear is false)")
            return
        n = self.store.remove_all()
        if n is not None:
            log.info("HiCacheStore.clear removed %d objects from the store", n)

    def get_stats(self) -> Any:
        from sglang.srt.observability.metrics_collector import StorageMetrics

        m = StorageMetrics()
        for name, values in self._metrics.items():
            getattr(m, name).extend(values)
            values.clear()
        return m

    def counters(self) -> Counters:
        return self.store.counters

    def close(self) -> None:
        self.store.close()


class _Guard:
    """``with`` block whose unexpected exception becomes an all-failed result, logged."""

    def __init__(self, owner: HiCacheStore, what: str, failed: Any) -> None:
        self.owner = owner
        self.what = what
        self.result: Any = failed

    def __enter__(self) -> _Guard:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if exc is None:
            return False
        if not isinstance(exc, Exception):
            return False  # KeyboardInterrupt, SystemExit: not ours to swallow
        self.owner.store.counters.bugs += 1
        self.owner.store.log.warn(
            f"{self.what}-error", "HiCacheStore.%s failed, reported as a miss: %r", self.what, exc
        )
        log.debug("HiCacheStore.%s failure", self.what, exc_info=exc)
        return True  # the result given at creation (all failed) stands
