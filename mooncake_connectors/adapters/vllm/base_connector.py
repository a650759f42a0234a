"""What our vLLM connectors share: one core object per role, thin forwarding, stats.

A connector subclass names its configuration, metadata, stats and Prometheus classes and says
how to build its scheduler-side and worker-side cores; ``__init__`` here parses the extra config
and builds the core of the instance's role, and everything vLLM calls that only forwards lives
here.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from .stats import ListStats, PromMetrics

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


class SchedulerCore(Protocol):
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]: ...
    def update_state_after_alloc(
        self, request: Any, blocks: Any, num_external_tokens: int
    ) -> None: ...
    def build_connector_meta(self, out: Any) -> Any: ...
    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]: ...


class WorkerCore(Protocol):
    stats: ListStats

    def start_load_kv(self, meta: Any) -> None: ...
    def get_finished(self) -> tuple[set[str] | None, set[str] | None]: ...
    def take_load_errors(self) -> set[int]: ...
    def shutdown(self) -> None: ...


S = TypeVar("S", bound=SchedulerCore)
W = TypeVar("W", bound=WorkerCore)
C = TypeVar("C")


def num_kv_heads(kv_cache_config: KVCacheConfig) -> int:
    """This rank's KV heads, from the engine's KV cache spec (0 where the spec has none)."""
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    return int(getattr(spec, "num_kv_heads", 0) or 0)


class DelegatingConnector(KVConnectorBase_V1, Generic[S, W, C]):  # type: ignore[misc]  # Any without vLLM
    """vLLM's connector interface forwarding to ``scheduler`` or ``worker``, whichever this
    role has. Loads complete before vLLM schedules a request, and nothing is sent layer by layer,
    so the per-layer hooks do nothing."""

    METADATA: ClassVar[type[KVConnectorMetadata]]
    STATS: ClassVar[type[ListStats]]
    PROM: ClassVar[type[PromMetrics]]

    _scheduler: S | None = None
    _worker: W | None = None

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = self._kv_transfer_config  # the base class checked it is set
        config = self._parse_config(ktc.kv_connector_extra_config)
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = self._build_scheduler(config, vllm_config, kv_cache_config)
        else:
            self._worker = self._build_worker(config, vllm_config, kv_cache_config)

    @classmethod
    @abc.abstractmethod
    def _parse_config(cls, extra: Mapping[str, Any] | None) -> C:
        """The connector's settings from ``kv_connector_extra_config``."""

    @abc.abstractmethod
    def _build_scheduler(
        self, config: C, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
    ) -> S: ...

    @abc.abstractmethod
    def _build_worker(
        self, config: C, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
    ) -> W: ...

    @property
    def scheduler(self) -> S:
        if self._scheduler is None:
            raise RuntimeError("scheduler-side method called on a worker-role connector")
        return self._scheduler

    @property
    def worker(self) -> W:
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
        return self.scheduler.build_connector_meta(scheduler_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    # -- worker side -------------------------------------------------------------------------
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, self.METADATA)
        self.worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return

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
        return cls.STATS(data=dict(data)) if data is not None else cls.STATS()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> PromMetrics:
        # Also required under vLLM's MultiConnector, which refuses stats without it.
        return cls.PROM(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        shutdown = getattr(self._scheduler, "shutdown", None)
        if shutdown is not None:
            shutdown()
