"""``MooncakeConnectorsPD``: vLLM's connector interface, delegating to one core object per role.

The scheduler-role instance owns a :class:`PDScheduler`, the worker-role instance a
:class:`PDWorker`; every method here only converts vLLM's arguments and forwards.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from .base_connector import DelegatingConnector
from .config import PDConfig
from .metadata import PDConnectorMetadata
from .scheduler import PDScheduler
from .stats import PDPromMetrics, PDStats
from .worker import PDWorker

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.kv_cache_interface import KVCacheConfig


class MooncakeConnectorsPD(DelegatingConnector[PDScheduler, PDWorker]):
    """Prefill → decode KV transfer over mooncake-connectors' transfer engine (decode pulls, or
    the prefill pushes layer by layer when the proxy runs both legs at once)."""

    _cache_hit_source = CacheHitSource.P2P
    METADATA = PDConnectorMetadata
    STATS = PDStats
    PROM = PDPromMetrics

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = self._kv_transfer_config  # the base class checked it is set
        config = PDConfig.from_extra_config(ktc.kv_connector_extra_config)
        engine_id = str(ktc.engine_id)
        self._scheduler: PDScheduler | None = None
        self._worker: PDWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = PDScheduler(config, vllm_config, engine_id)
        else:
            spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
            self._worker = PDWorker(
                config,
                vllm_config,
                engine_id,
                kv_cache_config.num_blocks,
                int(getattr(spec, "num_kv_heads", 0) or 0),
            )

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

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete before vLLM schedules the request (asynchronous loading)

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
