"""Store-key parts shared by the store-backed adapters (SGLang HiCache, vLLM store connector).

Pure Python. A key must differ whenever the bytes behind it could: the model, the slice of the
model's KV one rank holds (:class:`Shard`), the byte layout, and the content (a hash).
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
import urllib.parse
from array import array
from collections.abc import Sequence

from ..errors import ConfigError


def quote_model(model: str) -> str:
    """The model name as one key part (its slashes percent-quoted)."""
    return urllib.parse.quote(model, safe="")


def chained_block_hashes(
    token_ids: Sequence[int], block_size: int, start: bytes = b"", limit: int | None = None
) -> list[bytes]:
    """One digest per full block of ``block_size`` tokens, each covering every token before it.

    Digest i = blake2b(digest i-1 + tokens of block i), so equal digests mean equal prefixes,
    and any process computes the same values (no per-process seed, unlike Python's ``hash``).
    ``limit`` caps the number of blocks.
    """
    if block_size <= 0:
        raise ConfigError(f"block size must be > 0, got {block_size}")
    n = len(token_ids) // block_size
    if limit is not None:
        n = min(n, limit)
    out: list[bytes] = []
    prev = start
    for i in range(n):
        block = array("q", token_ids[i * block_size : (i + 1) * block_size])
        if sys.byteorder != "little":
            block.byteswap()  # the same key on every host
        prev = hashlib.blake2b(prev + block.tobytes(), digest_size=16).digest()
        out.append(prev)
    return out


@dataclasses.dataclass(frozen=True)
class Shard:
    """Which slice of a model's KV cache one rank holds."""

    is_mla: bool
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1

    def __post_init__(self) -> None:
        for rank, size, what in (
            (self.tp_rank, self.tp_size, "tp"),
            (self.pp_rank, self.pp_size, "pp"),
            (self.cp_rank, self.cp_size, "cp"),
        ):
            if not 0 <= rank < size:
                raise ConfigError(f"{what} rank {rank} is outside 0..{size - 1}")

    def tag(self) -> str:
        head = "mla" if self.is_mla else f"tp{self.tp_rank}-{self.tp_size}"
        out = f"{head}.pp{self.pp_rank}-{self.pp_size}"
        if self.cp_size > 1:
            out += f".cp{self.cp_rank}-{self.cp_size}"
        return out
