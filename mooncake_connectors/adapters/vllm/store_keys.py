"""Store keys of vLLM KV blocks (pure Python, no vLLM import).

    {namespace}/{version}/{model}/{layout}/{shard}/{chained block hash}/{layer}

version — :data:`~mooncake_connectors.kv_keys.KEY_VERSION`, bumped whenever the hash changes
    meaning, so objects saved under an older scheme are never read.

layout — what fixes the bytes of one block of one layer: KV dtype, block size, this rank's KV
    heads and head size, e.g. ``bfloat16.b16.h2x64``.
shard — ``tp{rank}-{size}.pp{rank}-{size}`` (:class:`..keys.Shard`): each TP rank holds its own
    heads, so each rank saves and loads its own objects.
chained block hash — :func:`mooncake_connectors.kv_keys.block_hashes`: the block's token ids,
    the previous block's hash, and what else the KV depends on (LoRA adapter, multimodal inputs,
    ``cache_salt``, prompt embeddings; :func:`.store_inputs.key_inputs` reads them off vLLM's
    request): the same prompt gives the same keys on any instance, and a block's key also names
    everything before it.
layer — vLLM's layer name; one object per block per layer, because one block of one layer is one
    contiguous range of vLLM's CPU KV cache, which the store reads into and writes from in place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ...errors import ConfigError
from ...kv_keys import KEY_VERSION, prompt_block_hashes
from ..keys import Shard, quote_model

__all__ = ["BlockKeys", "layout_tag", "prompt_block_hashes"]


def layout_tag(dtype: str, block_size: int, num_kv_heads: int, head_size: int) -> str:
    if min(block_size, num_kv_heads, head_size) <= 0:
        raise ConfigError(
            f"KV layout needs positive sizes: block {block_size}, heads {num_kv_heads}, "
            f"head size {head_size}"
        )
    return f"{dtype.removeprefix('torch.')}.b{block_size}.h{num_kv_heads}x{head_size}"


@dataclasses.dataclass(frozen=True)
class BlockKeys:
    namespace: str
    model: str
    layout: str
    shard: Shard

    @property
    def prefix(self) -> str:
        m = quote_model(self.model)
        return f"{self.namespace}/{KEY_VERSION}/{m}/{self.layout}/{self.shard.tag()}"

    def keys(self, hashes: Sequence[str], layers: Sequence[str]) -> list[str]:
        """Block by block, each block's layers in ``layers`` order."""
        p = self.prefix
        return [f"{p}/{h}/{layer}" for h in hashes for layer in layers]

    def for_rank(self, tp_rank: int) -> BlockKeys:
        shard = dataclasses.replace(self.shard, tp_rank=tp_rank)
        return dataclasses.replace(self, shard=shard)
