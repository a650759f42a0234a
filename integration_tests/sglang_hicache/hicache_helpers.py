"""Real SGLang host pools on CPU and our backend built the way SGLang builds it.

Imported by the tests after ``pytest.importorskip("sglang")``. Host pools come from
``bench.sglang_pool`` (SGLang's own classes over CPU tensors); the backend comes from
``StorageBackendFactory.create_backend("dynamic", HiCacheStorageConfig(...), pool)``.
"""

from __future__ import annotations

import secrets
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.storage import StorageBackendFactory

from mooncake_connectors.bench.sglang_pool import make_cpu_host_pool

LAYERS, HEADS, HEAD_DIM, PAGE = 2, 2, 16, 4
LORA, ROPE = 24, 8  # MLA row = kv_lora_rank + qk_rope_head_dim
DEVICE_TOKENS = 64  # host pool = 2x this (host_to_device_ratio) + one padding page
CPU = torch.device("cpu")

MODULE = {
    "backend_name": "mooncake_connectors",
    "module_path": "mooncake_connectors.adapters.sglang",
    "class_name": "HiCacheStore",
    "interface_v1": 1,
}


def make_pool(kind: str, layout: str, dtype: torch.dtype = torch.bfloat16) -> Any:
    """A real SGLang host pool ("mha" or "mla") over freshly made CPU 'device' tensors."""
    return make_cpu_host_pool(
        kind,
        layout,
        layers=LAYERS,
        page=PAGE,
        device_tokens=DEVICE_TOKENS,
        heads=HEADS,
        head_dim=HEAD_DIM,
        kv_lora_rank=LORA,
        rope_dim=ROPE,
        dtype=dtype,
    )


def fill_random(pool: Any, seed: int) -> None:
    flat = pool.kv_buffer.view(-1).view(torch.uint8)
    gen = torch.Generator().manual_seed(seed)
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen))


def page_bytes(pool: Any, first_index: int) -> bytes:
    """The bytes of the page starting at this host index (K and V, every layer)."""
    page = pool.get_data_page(first_index, flat=True).contiguous()
    return bytes(page.view(torch.uint8).numpy().tobytes())


def alloc_pages(pool: Any, n: int, skip: int = 0) -> torch.Tensor:
    """Token indices of ``n`` pages; ``skip`` pages are taken first so two pools differ."""
    if skip:
        pool.alloc(skip * PAGE)
    idx = pool.alloc(n * PAGE)
    assert idx is not None
    return idx


def page_keys(n: int) -> list[str]:
    return [secrets.token_hex(32) for _ in range(n)]


def storage_config(
    extra: dict[str, Any],
    *,
    mla: bool = False,
    layout: str = "page_first",
    tp_rank: int = 0,
    tp_size: int = 1,
    model: str = "org/tiny-model",
    metrics: bool = False,
) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=metrics,
        is_page_first_layout=layout == "page_first",
        model_name=model,
        extra_config=dict(extra),
    )


def make_backend(master: str, pool: Any, *, extra: dict[str, Any] | None = None, **kw: Any) -> Any:
    """Our backend as SGLang's cache controller makes it: factory, then the host pool."""
    cfg_extra = {**MODULE, "master": master, "timeout": 3.0, "cooldown": 1.0}
    cfg_extra.update(extra or {})
    cfg = storage_config(cfg_extra, layout=pool.layout, **kw)
    backend = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    backend.register_mem_pool_host(pool)
    return backend
