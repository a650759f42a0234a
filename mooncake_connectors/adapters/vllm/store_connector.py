"""``MooncakeConnectorsStore``: vLLM's connector interface over mooncake-connectors' KV store.

Prefix KV reuse across instances: any instance saves the full prompt blocks it computed under
prefix-hash keys, any instance loads the blocks it lacks. The scheduler-role instance owns a
:class:`StoreScheduler`, the worker-role instance a :class:`StoreWorker`; every method here only
converts vLLM's arguments and forwards.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from .stats import StorePromMetrics, StoreStats
from .store_config import StoreConnectorConfig
from .store_scheduler import StoreConnectorMetadata, StoreScheduler, block_keys
from .store_worker import StoreWorker

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


class MooncakeConnectorsStore(KVConnectorBase_V1):  # type: ignore[misc]  # Any without vLLM
    """Prefix-hash KV reuse across vLLM instances through mooncake-connectors' store."""

    # A remote memory pool: none of vLLM's named tiers (device, host, p2p, disk) fits.
    _cache_hit_source = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = self._kv_transfer_config  # the base class checked it is set
        config = StoreConnectorConfig.from_extra_config(ktc.kv_connector_extra_config)
        self._scheduler: StoreScheduler | None = None
        self._worker: StoreWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = StoreScheduler(
                config,
                vllm_config,
                kv_cache_config,
                load=bool(ktc.is_kv_consumer),
                save=bool(ktc.is_kv_producer),
            )
        else:
            keys, layers = block_keys(config, vllm_config, kv_cache_config)
            spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
            self._worker = StoreWorker(
                config,
                keys,
                layers,
                kv_cache_config.num_blocks,
                int(getattr(spec, "num_kv_heads", 0) or 0),
            )

    @property
    def scheduler(self) -> StoreScheduler:
        if self._scheduler is None:
            raise RuntimeError("scheduler-side method called on a worker-role connector")
        return self._scheduler

    @property
    def worker(self) -> StoreWorker:
        if self._worker is None:
            raise RuntimeError("worker-side method called on a scheduler-role connector")
        return self._worker

    # -- scheduler side ----------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta()

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    # -- worker side -------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self.worker.register_kv_caches(kv_caches, get_tensor_model_parallel_rank())

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, StoreConnectorMetadata)
        self.worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete before vLLM schedules the request (asynchronous loading)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return  # saved from the finished blocks (request_finished), not layer by layer

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker.get_finished()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return None if self._worker is None else self._worker.stats.take()

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return StoreStats(data=dict(data)) if data is not None else StoreStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> StorePromMetrics:
        # Also required under vLLM's MultiConnector, which refuses stats without it.
        return StorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()
