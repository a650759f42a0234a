"""Store keys of HiCache pages: what must differ for two pages' bytes to differ.

    {namespace}[.{tenant}][.{tag}]/{model}/{shard}/{format}/{page hash}/{part}

shard — MHA: ``tp{rank}-{size}.pp{rank}-{size}`` (each TP rank holds its own heads; PP stages
    their own layers); MLA: ``mla.pp{rank}-{size}`` (every TP rank holds the same latent cache,
    so one object per page is written by the storage-writer rank and read by all).
    ``.cp{rank}-{size}`` is added when attention context parallelism is on.
format — the byte order of one page, its dtype and page size: ``tl`` (token-major, SGLang's
    ``page_first``), ``lt`` (layer-major: ``layer_first`` pages are gathered into this order,
    which ``page_first_direct`` holds natively, so the two share objects), ``htl``
    (``page_head``), e.g. ``lt.bfloat16.p64``; a pool's own ``storage_format_tag`` is appended.
part — MHA zero-copy objects: ``k`` and ``v``; MLA: ``kv``; the non-zero-copy get/set calls:
    ``page`` (SGLang's flat page, K then V).

The model name is percent-quoted so its slashes do not read as separators.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ...errors import ConfigError
from ..keys import Shard, quote_model

__all__ = ["KeyScheme", "Shard", "page_format"]

# SGLang host-pool layout -> byte order of one page in the store.
LAYOUT_ORDER = {
    "page_first": "tl",
    "layer_first": "lt",
    "page_first_direct": "lt",
    "page_head": "htl",
}
MHA_PARTS = ("k", "v")
MLA_PARTS = ("kv",)
FLAT_PART = "page"


def page_format(layout: str, dtype: str, page_size: int, pool_tag: str | None = None) -> str:
    order = LAYOUT_ORDER.get(layout)
    if order is None:
        raise ConfigError(
            f"host pool layout {layout!r} is not supported; use one of {sorted(LAYOUT_ORDER)}"
        )
    if page_size <= 0:
        raise ConfigError(f"page size must be > 0, got {page_size}")
    out = f"{order}.{dtype.removeprefix('torch.')}.p{page_size}"
    return f"{out}.{pool_tag}" if pool_tag else out


@dataclasses.dataclass(frozen=True)
class KeyScheme:
    namespace: str
    model: str
    shard: Shard
    fmt: str
    tenant: str = "default"
    tag: str = ""

    @property
    def parts(self) -> tuple[str, ...]:
        return MLA_PARTS if self.shard.is_mla else MHA_PARTS

    @property
    def prefix(self) -> str:
        ns = self.namespace
        if self.tenant and self.tenant != "default":
            ns += f".{self.tenant}"
        if self.tag:
            ns += f".{self.tag}"
        return f"{ns}/{quote_model(self.model)}/{self.shard.tag()}/{self.fmt}"

    def objects(self, page_keys: Sequence[str]) -> list[str]:
        """The zero-copy objects of these pages, page by page, parts in ``parts`` order."""
        p = self.prefix
        return [f"{p}/{k}/{part}" for k in page_keys for part in self.parts]

    def flat(self, page_keys: Sequence[str]) -> list[str]:
        """One object per page for the non-zero-copy calls."""
        p = self.prefix
        return [f"{p}/{k}/{FLAT_PART}" for k in page_keys]
