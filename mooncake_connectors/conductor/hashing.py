"""Chained prefix-block hashing of prompts.

Block ``i``'s key hashes block ``i - 1``'s key together with block ``i``'s tokens, so equal keys at
position ``i`` mean the whole prefix up to and including block ``i`` is equal: one key names a
reusable prefix KV, and a prefix match is a walk over leading keys until the first miss. This is
the scheme of the Mooncake paper (§3) and of vLLM's prefix cache; the released traces carry such
ids already (``hash_ids``), remapped to small integers.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Container, Sequence

from ..errors import ConfigError

DEFAULT_BLOCK_TOKENS = 512
_ROOT = 0
_U64 = (1 << 64) - 1


def _pack_tokens(tokens: Sequence[int]) -> bytes:
    try:
        return struct.pack(f"<{len(tokens)}q", *tokens)
    except struct.error as exc:
        raise ConfigError(f"token ids must be 64-bit integers: {exc}") from exc


def block_hash(parent: int, tokens: Sequence[int]) -> int:
    """Key of one block given its parent's key (``0`` for the first block)."""
    if not 0 <= parent <= _U64:
        raise ConfigError("parent hash must be an unsigned 64-bit integer", parent=parent)
    h = hashlib.blake2b(digest_size=8)
    h.update(parent.to_bytes(8, "little"))
    h.update(_pack_tokens(tokens))
    return int.from_bytes(h.digest(), "little")


def prefix_block_hashes(
    tokens: Sequence[int], block_tokens: int = DEFAULT_BLOCK_TOKENS, *, partial: bool = False
) -> list[int]:
    """Chained keys of ``tokens`` cut into blocks of ``block_tokens``.

    The trailing partial block is left out by default: its KV is still growing on the instance
    that computed it, so engines (vLLM among them) only publish full blocks. ``partial=True``
    keys it too, which is how the Mooncake traces count blocks (``ceil(len / 512)``).
    """
    if block_tokens <= 0:
        raise ConfigError("block_tokens must be > 0", block_tokens=block_tokens)
    keys: list[int] = []
    parent = _ROOT
    end = len(tokens) if partial else len(tokens) - len(tokens) % block_tokens
    for start in range(0, end, block_tokens):
        parent = block_hash(parent, tokens[start : min(start + block_tokens, end)])
        keys.append(parent)
    return keys


def prefix_match_blocks(keys: Sequence[int], cached: Container[int]) -> int:
    """Number of leading ``keys`` present in ``cached``; stops at the first miss.

    Chaining makes a later hit after a miss meaningless (a different prefix), so it is not counted.
    """
    n = 0
    for k in keys:
        if k not in cached:
            break
        n += 1
    return n


def cached_tokens(
    matched_blocks: int, prompt_tokens: int, block_tokens: int = DEFAULT_BLOCK_TOKENS
) -> int:
    """Tokens covered by ``matched_blocks`` leading blocks of a ``prompt_tokens`` prompt."""
    if matched_blocks < 0 or prompt_tokens < 0:
        raise ConfigError("matched_blocks and prompt_tokens must be >= 0")
    return min(matched_blocks * block_tokens, prompt_tokens)
