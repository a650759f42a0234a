"""``MooncakeConnectorsPD``: vLLM's connector interface, delegating to one core object per role.

The scheduler-role instance owns a :class:`PDScheduler`, the worker-role instance a
:class:`PDWorker`; every method here only converts vLLM's arguments and forwards.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from .base_connector import DelegatingConnector, num_kv_heads
from .config import PDConfig
from .metadata import PDConnectorMetadata
from .scheduler import PDScheduler, kv_groups
from .stats import PDPromMetrics, PDStats
from .worker import PDWorker

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


class MooncakeConnectorsPD(
    DelegatingConnector[PDScheduler, PDWorker, PDConfig],
    SupportsHMA,  # type: ignore[misc]  # Any without vLLM
):
    """Prefill → decode KV transfer over mooncake-connectors' transfer engine (decode pulls, or
    the prefill pushes layer by layer when the proxy runs both legs at once). With vLLM's
    hybrid KV cache manager (``SupportsHMA``: full and sliding-window attention groups) each
    group's blocks are handed over and pulled for that group's layers (no push then)."""

    _cache_hit_source = CacheHitSource.P2P
    METADATA = PDConnectorMetadata
    STATS = PDStats
    PROM = PDPromMetrics

    @classmethod
    def _parse_config(cls, extra: Mapping[str, Any] | None) -> PDConfig:
        return PDConfig.from_extra_config(extra)

    def _build_scheduler(
        self, config: PDConfig, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
    ) -> PDScheduler:
        return PDScheduler(
            config, vllm_config, str(self._kv_transfer_config.engine_id), kv_cache_config
        )

    def _build_worker(
        self, config: PDConfig, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
    ) -> PDWorker:
        return PDWorker(
            config,
            vllm_config,
            str(self._kv_transfer_config.engine_id),
            kv_cache_config.num_blocks,
            num_kv_heads(kv_cache_config),
            kv_groups(vllm_config, kv_cache_config),
        )

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    # -- scheduler side ----------------------------------------------------------------------
    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        self.scheduler.set_handshakes(dict(metadata))

    # -- worker side -------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return None if self._worker is None else self._worker.handshake()

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        # Layer-wise push: write this layer's completed blocks of pushing requests (no-op
        # otherwise; the pull model needs nothing here).
        meta = self._get_connector_metadata()
        assert isinstance(meta, PDConnectorMetadata)
        self.worker.save_kv_layer(layer_name, meta)

    def wait_for_save(self) -> None:
        self.worker.wait_for_save()
