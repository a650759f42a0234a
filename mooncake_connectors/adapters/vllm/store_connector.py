"""``MooncakeConnectorsStore``: vLLM's connector interface over mooncake-connectors' KV store.

Prefix KV reuse across instances: any instance saves the full prompt blocks it computed under
prefix-hash keys, any instance loads the blocks it lacks. The scheduler-role instance owns a
:class:`StoreScheduler`, the worker-role instance a :class:`StoreWorker`; every method here only
converts vLLM's arguments and forwards.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ...cpu_amx import enable_amx_tiles
from .base_connector import DelegatingConnector, num_kv_heads
from .stats import StorePromMetrics, StoreStats
from .store_config import StoreConnectorConfig
from .store_events import StoreKVEvents
from .store_scheduler import StoreConnectorMetadata, StoreScheduler, block_keys, group_windows
from .store_worker import StoreWorker

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class MooncakeConnectorsStore(
    DelegatingConnector[StoreScheduler, StoreWorker, StoreConnectorConfig],
    SupportsHMA,  # type: ignore[misc]  # Any without vLLM
):
    """Prefix-hash KV reuse across vLLM instances through mooncake-connectors' store.

    Saves happen per step, for the full prompt blocks a step completed (``save_during_prefill``),
    and for the rest when the request finishes (``request_finished``), not layer by layer. With
    vLLM's hybrid KV cache manager (``SupportsHMA``) each KV cache group's blocks are saved and
    loaded (:mod:`.store_scheduler`)."""

    # A remote memory pool: none of vLLM's named tiers (device, host, p2p, disk) fits.
    _cache_hit_source = CacheHitSource.EXTERNAL_UNSPECIFIED
    METADATA = StoreConnectorMetadata
    STATS = StoreStats
    PROM = StorePromMetrics

    @classmethod
    def _parse_config(cls, extra: Mapping[str, Any] | None) -> StoreConnectorConfig:
        return StoreConnectorConfig.from_extra_config(extra)

    @property
    def requires_kv_delivery(self) -> bool:
        # A cache, not a hand-off: a save that never happens is a later miss. A finished
        # request's blocks are kept until its saves are reported done, and a preempted request's
        # freed blocks are overwritten only after its step saves read them (handle_preemptions),
        # so vLLM may deliver a preempted request's in-flight tokens instead of recomputing them.
        return False

    def _build_scheduler(
        self, config: StoreConnectorConfig, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
    ) -> StoreScheduler:
        ktc = self._kv_transfer_config
        return StoreScheduler(
            config,
            vllm_config,
            kv_cache_config,
            load=bool(ktc.is_kv_consumer),
            save=bool(ktc.is_kv_producer),
        )

    def _build_worker(
        self, config: StoreConnectorConfig, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
    ) -> StoreWorker:
        keys, layers = block_keys(config, vllm_config, kv_cache_config)
        groups = None
        if group_windows(vllm_config, kv_cache_config) is not None:
            n = len(kv_cache_config.kv_cache_groups)
            groups = [block_keys(config, vllm_config, kv_cache_config, g) for g in range(n)]
            layers = [name for _, names in groups for name in names]
        return StoreWorker(
            config,
            keys,
            layers,
            kv_cache_config.num_blocks,
            num_kv_heads(kv_cache_config),
            groups=groups,
        )

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    # -- KV events: the blocks the store holds (store_events) -------------------------------
    def get_kv_connector_kv_cache_events(self) -> StoreKVEvents | None:
        events = self.worker.take_events()
        return StoreKVEvents(events) if events else None

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        events = connector_output.kv_cache_events
        if isinstance(events, StoreKVEvents):
            self.scheduler.add_events(events.get_all_events())

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self.scheduler.take_events()

    # -- worker side -------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        if any(t.device.type == "cpu" for t in kv_caches.values()):
            enable_amx_tiles()
        self.worker.register_kv_caches(kv_caches, get_tensor_model_parallel_rank())

    def wait_for_save(self) -> None:
        self.worker.wait_for_save()

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        assert isinstance(kv_connector_metadata, StoreConnectorMetadata)
        self.worker.handle_preemptions(kv_connector_metadata)
