"""Which prefix blocks each prefill instance holds, kept from the instances' own events.

The conductor never guesses cache contents: instances (or the replay's instance models) report
``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``, the same three events vLLM publishes
(``vllm.distributed.kv_events``), converted at the proxy boundary. An instance with a finite
``capacity_blocks`` here evicts least-recently-used blocks itself; that is how the replay models a
node's DRAM pool. A live deployment leaves capacity unbounded and lets the engine's removal events
do the evicting.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from ..errors import ConfigError


@dataclasses.dataclass(frozen=True)
class BlockStored:
    instance: str
    block_hashes: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class BlockRemoved:
    instance: str
    block_hashes: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class AllBlocksCleared:
    instance: str


CacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class BlockCache:
    """One instance's set of cached block keys in LRU order (oldest first)."""

    def __init__(self, capacity_blocks: int | None = None) -> None:
        if capacity_blocks is not None and capacity_blocks <= 0:
            raise ConfigError(
                "capacity_blocks must be > 0 or None", capacity_blocks=capacity_blocks
            )
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, key: object) -> bool:
        return key in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, keys: Sequence[int]) -> int:
        """Leading blocks of ``keys`` held here (does not touch LRU order)."""
        n = 0
        blocks = self._blocks
        for k in keys:
            if k not in blocks:
                break
            n += 1
        return n

    def touch(self, keys: Iterable[int]) -> None:
        """Mark held ``keys`` as just used, so a prefix being reused is evicted last."""
        for k in keys:
            if k in self._blocks:
                self._blocks.move_to_end(k)

    def store(self, keys: Iterable[int]) -> list[int]:
        """Insert (or refresh) ``keys``; returns the keys evicted to stay within capacity."""
        blocks = self._blocks
        for k in keys:
            if k in blocks:
                blocks.move_to_end(k)
            else:
                blocks[k] = None
        evicted: list[int] = []
        if self.capacity_blocks is not None:
            while len(blocks) > self.capacity_blocks:
                evicted.append(blocks.popitem(last=False)[0])
        return evicted

    def remove(self, keys: Iterable[int]) -> None:
        for k in keys:
            self._blocks.pop(k, None)

    def clear(self) -> None:
        self._blocks.clear()


class CacheIndex:
    """Per-instance block caches plus prefix matching across all of them."""

    def __init__(self, instances: Sequence[str], capacity_blocks: int | None = None) -> None:
        if not instances:
            raise ConfigError("a cache index needs at least one instance")
        if len(set(instances)) != len(instances):
            raise ConfigError("instance names must be unique", instances=list(instances))
        self._caches = {name: BlockCache(capacity_blocks) for name in instances}

    @property
    def instances(self) -> list[str]:
        return list(self._caches)

    def cache(self, instance: str) -> BlockCache:
        try:
            return self._caches[instance]
        except KeyError:
            raise ConfigError(f"unknown prefill instance {instance!r}", instance=instance) from None

    def apply(self, event: CacheEvent) -> list[int]:
        """Apply one instance event; returns keys evicted by this index's own capacity limit."""
        cache = self.cache(event.instance)
        if isinstance(event, BlockStored):
            return cache.store(event.block_hashes)
        if isinstance(event, BlockRemoved):
            cache.remove(event.block_hashes)
        else:
            cache.clear()
        return []

    def match(self, instance: str, keys: Sequence[int]) -> int:
        return self.cache(instance).match(keys)

    def matches(self, keys: Sequence[int]) -> dict[str, int]:
        """Leading blocks of ``keys`` held by each instance."""
        return {name: c.match(keys) for name, c in self._caches.items()}

    def best_match(self, keys: Sequence[int]) -> tuple[int, str | None]:
        """Longest prefix held anywhere and one holder (first in instance order on ties)."""
        best, holder = 0, None
        for name, c in self._caches.items():
            m = c.match(keys)
            if m > best:
                best, holder = m, name
        return best, holder
