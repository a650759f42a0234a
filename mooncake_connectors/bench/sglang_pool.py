"""Real SGLang host pools on CPU, for the benchmark and the tests.

SGLang's own host-pool classes over CPU tensors with ``pin_memory=False`` (no cudaHostRegister),
built from the same ``MHABufferInfo`` / ``MLABufferInfo`` the engine hands them. Importing this
module imports SGLang and torch.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.mem_cache.device_pool_info import (
    KVBufferLayout,
    KVBuffers,
    MHABufferInfo,
    MLABufferInfo,
)
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost


def make_cpu_host_pool(
    kind: str,
    layout: str,
    *,
    layers: int,
    page: int,
    device_tokens: int,
    heads: int = 1,
    head_dim: int = 0,
    kv_lora_rank: int = 0,
    rope_dim: int = 0,
    host_to_device_ratio: float = 2.0,
    host_token_capacity: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> Any:
    """A host pool of ``kind`` "mha" (``heads`` x ``head_dim`` per token for K and for V) or
    "mla" (one row of ``kv_lora_rank + rope_dim`` per token) over fresh zeroed CPU 'device'
    tensors of ``device_tokens`` tokens per layer; SGLang sizes the host side from
    ``host_to_device_ratio`` unless ``host_token_capacity`` is given."""
    cpu = torch.device("cpu")
    common: dict[str, Any] = dict(
        host_to_device_ratio=host_to_device_ratio,
        host_size=0,
        page_size=page,
        layout=layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=device_tokens,
        start_layer=0,
        end_layer=layers,
    )
    if host_token_capacity is not None:
        common["host_token_capacity"] = host_token_capacity
    if kind == "mha":
        k = tuple(torch.zeros(device_tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
        v = tuple(torch.zeros(device_tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
        info = MHABufferInfo(
            buffers=KVBuffers(
                k=k,
                v=v,
                k_data_ptrs=torch.tensor([t.data_ptr() for t in k], dtype=torch.uint64),
                v_data_ptrs=torch.tensor([t.data_ptr() for t in v], dtype=torch.uint64),
                layout=KVBufferLayout.NHD,
            ),
            page_size=page,
            head_num=heads,
            head_dim=head_dim,
            v_head_dim=head_dim,
            dtype=dtype,
            device=cpu,
        )
        return MHATokenToKVPoolHost(info, **common)
    if kind != "mla":
        raise ValueError(f"pool kind must be 'mha' or 'mla', got {kind!r}")
    dim = kv_lora_rank + rope_dim
    rows = tuple(torch.zeros(device_tokens, 1, dim, dtype=dtype) for _ in range(layers))
    minfo = MLABufferInfo(
        buffers=rows,
        data_ptrs=torch.tensor([t.data_ptr() for t in rows], dtype=torch.uint64),
        layer_indices=tuple(range(layers)),
        device_layer_num=layers,
        page_size=page,
        kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=rope_dim,
        kv_cache_dim=dim,
        dtype=dtype,
        device=cpu,
    )
    return MLATokenToKVPoolHost(minfo, target_layer_num=layers, **common)
