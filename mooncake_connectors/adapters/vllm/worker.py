"""Worker side of the PD connector in vLLM: a :class:`~mooncake_connectors.pd.session.
TransferSession` fed the three integers it needs from vLLM (block size, TP size, TP rank)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...cpu_amx import enable_amx_tiles
from ...pd.plan import StepPlan
from ...pd.session import TransferSession
from .config import PDConfig
from .metadata import PDHandshake
from .stats import PDStats

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig


class PDWorker(TransferSession):
    stats: PDStats

    def __init__(
        self,
        config: PDConfig,
        vllm_config: VllmConfig,
        engine_id: str,
        num_blocks: int,
        num_kv_heads: int = 0,
    ) -> None:
        super().__init__(
            config,
            engine_id,
            block_size=vllm_config.cache_config.block_size,
            tp_size=vllm_config.parallel_config.tensor_parallel_size,
            num_blocks=num_blocks,
            num_kv_heads=num_kv_heads,
            stats=PDStats(),
        )
        self._on_gpu = False

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        if any(t.device.type == "cpu" for t in kv_caches.values()):
            enable_amx_tiles()
        self._on_gpu = any(t.device.type == "cuda" for t in kv_caches.values())
        self.register(kv_caches, get_tensor_model_parallel_rank())

    def save_kv_layer(self, layer_name: str, meta: StepPlan) -> None:
        # A GPU forward runs on torch's stream; our copies run on streams of their own, so the
        # layer's KV must be written before a push reads it. Waiting for the stream here costs
        # the push its overlap with the rest of this layer's kernels, not with later layers.
        if self._on_gpu and (meta.push_send or self._step):
            import torch

            torch.cuda.current_stream().synchronize()
        super().save_kv_layer(layer_name, meta)

    def handshake(self) -> PDHandshake | None:
        endpoint = self.side_channel
        return None if endpoint is None else PDHandshake(self.tp_rank, endpoint)
