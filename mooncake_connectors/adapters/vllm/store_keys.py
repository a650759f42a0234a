"""Store keys of vLLM KV blocks (pure Python, no vLLM import).

    {namespace}/{model}/{layout}/{shard}/{chained block hash}/{layer}

layout — what fixes the bytes of one block of one layer: KV dtype, block size, this rank's KV
    heads and head size, e.g. ``bfloat16.b16.h2x64``.
shard — ``tp{rank}-{size}.pp{rank}-{size}`` (:class:`..keys.Shard`): each TP rank holds its own
    heads, so each rank saves and loads its own objects.
chained block hash — blake2b over the block's token ids and the previous block's hash
    (:func:`..keys.chained_block_hashes`): the same prompt prefix gives the same keys on any
    instance, and a block's key also names everything before it.
layer — vLLM's layer name; one object per block per layer, because one block of one layer is one
    contiguous range of vLLM's CPU KV cache, which the store reads into and writes from in place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ...errors import ConfigError
from ..keys import Shard, chained_block_hashes, quote_model


def layout_tag(dtype: str, block_size: int, num_kv_heads: int, head_size: int) -> str:
    if min(block_size, num_kv_heads, head_size) <= 0:
        raise ConfigError(
            f"KV layout needs positive sizes: block {block_size}, heads {num_kv_heads}, "
            f"head size {head_size}"
        )
    return f"{dtype.removeprefix('torch.')}.b{block_size}.h{num_kv_heads}x{head_size}"


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[str]:
    """Hex digests of the prompt's full blocks, except that the last prompt token is never in
    one: vLLM computes at least one prompt token itself, so that block is never loaded."""
    limit = max(0, len(token_ids) - 1) // block_size
    return [h.hex() for h in chained_block_hashes(token_ids, block_size, limit=limit)]


@dataclasses.dataclass(frozen=True)
class BlockKeys:
    namespace: str
    model: str
    layout: str
    shard: Shard

    @property
    def prefix(self) -> str:
        return f"{self.namespace}/{quote_model(self.model)}/{self.layout}/{self.shard.tag()}"

    def keys(self, hashes: Sequence[str], layers: Sequence[str]) -> list[str]:
        """Block by block, each block's layers in ``layers`` order."""
        p = self.prefix
        return [f"{p}/{h}/{layer}" for h in hashes for layer in layers]

    def for_rank(self, tp_rank: int) -> BlockKeys:
        shard = dataclasses.replace(self.shard, tp_rank=tp_rank)
        return dataclasses.replace(self, shard=shard)
