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

    def held(self) -> list[int]:
        return list(self._blocks)


class CacheIndex:
    """Per-instance block caches plus prefix matching across all of them.

    Besides each instance's cache it keeps, per block key, which instances hold it, so that the
    instances holding any prefix of a prompt are found in time proportional to the prompt's
    blocks and their holders, whatever the number of instances (:meth:`holder_matches`). A key
    with one holder maps to that name, with more to a set (most keys have one: a set per key
    would triple the index's memory).
    """

    def __init__(self, instances: Sequence[str], capacity_blocks: int | None = None) -> None:
        if not instances:
            raise ConfigError("a cache index needs at least one instance")
        if len(set(instances)) != len(instances):
            raise ConfigError("instance names must be unique", instances=list(instances))
        self._caches = {name: BlockCache(capacity_blocks) for name in instances}
        self._holders: dict[int, str | set[str]] = {}

    @property
    def instances(self) -> list[str]:
        return list(self._caches)

    def cache(self, instance: str) -> BlockCache:
        try:
            return self._caches[instance]
        except KeyError:
            raise ConfigError(f"unknown prefill instance {instance!r}", instance=instance) from None

    def _hold(self, key: int, instance: str) -> None:
        h = self._holders.get(key)
        if h is None:
            self._holders[key] = instance
        elif isinstance(h, str):
            if h != instance:
                self._holders[key] = {h, instance}
        else:
            h.add(instance)

    def _drop(self, key: int, instance: str) -> None:
        h = self._holders.get(key)
        if h is None:
            return
        if isinstance(h, str):
            if h == instance:
                del self._holders[key]
            return
        h.discard(instance)
        if len(h) == 1:
            self._holders[key] = next(iter(h))

    def apply(self, event: CacheEvent) -> list[int]:
        """Apply one instance event; returns keys evicted by this index's own capacity limit."""
        name = event.instance
        cache = self.cache(name)
        if isinstance(event, BlockStored):
            evicted = cache.store(event.block_hashes)
            for k in event.block_hashes:
                self._hold(k, name)
            for k in evicted:
                self._drop(k, name)
            return evicted
        if isinstance(event, BlockRemoved):
            cache.remove(event.block_hashes)
            for k in event.block_hashes:
                self._drop(k, name)
        else:
            for k in cache.held():
                self._drop(k, name)
            cache.clear()
        return []

    def match(self, instance: str, keys: Sequence[int]) -> int:
        return self.cache(instance).match(keys)

    def matches(self, keys: Sequence[int]) -> dict[str, int]:
        """Leading blocks of ``keys`` held by each instance."""
        return {name: c.match(keys) for name, c in self._caches.items()}

    def holder_matches(self, keys: Sequence[int]) -> dict[str, int]:
        """Leading blocks of ``keys`` held, for the instances that hold at least one.

        Walks the prompt's blocks once, narrowing the set of instances that still match; the
        others (most, in a large pool) are never looked at.
        """
        out: dict[str, int] = {}
        if not keys:
            return out
        first = self._holders.get(keys[0])
        if first is None:
            return out
        alive = {first} if isinstance(first, str) else set(first)
        for i in range(1, len(keys)):
            h = self._holders.get(keys[i])
            if h is None:
                nxt: set[str] | frozenset[str] = frozenset()
            elif isinstance(h, str):
                nxt = {h} if h in alive else frozenset()
            else:
                nxt = alive & h
            for name in alive.difference(nxt):
                out[name] = i
            if not nxt:
                return out
            alive = set(nxt)
        for name in alive:
            out[name] = len(keys)
        return out

    def best_match(self, keys: Sequence[int]) -> tuple[int, str | None]:
        """Longest prefix held anywhere and one holder (first in instance order on ties)."""
        best, holder = 0, None
        for name, c in self._caches.items():
            m = c.match(keys)
            if m > best:
                best, holder = m, name
        return best, holder

    def holder_count(self, key: int) -> int:
        h = self._holders.get(key)
        return 0 if h is None else 1 if isinstance(h, str) else len(h)

    def prefix_upper_bound(self, keys: Sequence[int]) -> int:
        """Leading ``keys`` each held by some instance: no instance matches more."""
        n = 0
        for k in keys:
            if k not in self._holders:
                break
            n += 1
        return n

    @property
    def indexed_keys(self) -> int:
        """Distinct block keys held by at least one instance."""
        return len(self._holders)
