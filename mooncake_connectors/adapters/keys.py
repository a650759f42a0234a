"""Store-key parts shared by the store-backed adapters (SGLang HiCache, vLLM store connector).

Pure Python. A key must differ whenever the bytes behind it could: the model, the slice of the
model's KV one rank holds (:class:`Shard`), the byte layout, and the content (a hash,
:mod:`mooncake_connectors.kv_keys`).
"""

from __future__ import annotations

import dataclasses
import urllib.parse

from ..errors import ConfigError


def quote_model(model: str) -> str:
    """The model name as one key part (its slashes percent-quoted)."""
    return urllib.parse.quote(model, safe="")


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
