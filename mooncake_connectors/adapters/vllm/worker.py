"""Worker side of the PD connector in vLLM: a :class:`~mooncake_connectors.pd.session.
TransferSession` fed the three integers it needs from vLLM (block size, TP size, TP rank)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...cpu_amx import enable_amx_tiles
from ...pd.session import TransferSession
from ..cuda_streams import stream_fence
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
        groups: tuple[list[list[str]], list[str]] | None = None,
    ) -> None:
        super().__init__(
            config,
            engine_id,
            block_size=vllm_config.cache_config.block_size,
            tp_size=vllm_config.parallel_config.tensor_parallel_size,
            num_blocks=num_blocks,
            num_kv_heads=num_kv_heads,
            stats=PDStats(),
            groups=None if groups is None else groups[0],
            group_kinds=None if groups is None else groups[1],
        )

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        if any(t.device.type == "cpu" for t in kv_caches.values()):
            enable_amx_tiles()
        gpu = next((t.device for t in kv_caches.values() if t.device.type == "cuda"), None)
        if gpu is not None:
            # A GPU forward runs on torch's stream of the KV cache's device; push writes run
            # on streams of our own, which wait on the GPU for a fence recorded on that stream
            # (each layer's, and each forward's end): no host sync, no device switch.
            self.producer = stream_fence(gpu)
        self.register(kv_caches, get_tensor_model_parallel_rank())

    def handshake(self) -> PDHandshake | None:
        endpoint = self.side_channel
        return None if endpoint is None else PDHandshake(self.tp_rank, endpoint)
