from __future__ import annotations

import pytest

from mooncake_connectors.conductor.cache_index import (
    AllBlocksCleared,
    BlockCache,
    BlockRemoved,
    BlockStored,
    CacheIndex,
)
from mooncake_connectors.errors import ConfigError


def test_events_update_matches() -> None:
    idx = CacheIndex(["a", "b"])
    idx.apply(BlockStored("a", (1, 2, 3)))
    idx.apply(BlockStored("b", (1, 2)))
    assert idx.matches((1, 2, 3, 4)) == {"a": 3, "b": 2}
    idx.apply(BlockRemoved("a", (2,)))
    assert idx.match("a", (1, 2, 3)) == 1  # a hole breaks the chain
    idx.apply(AllBlocksCleared("b"))
    assert idx.match("b", (1, 2)) == 0


def test_best_match_and_ties() -> None:
    idx = CacheIndex(["a", "b", "c"])
    assert idx.best_match((1, 2)) == (0, None)
    idx.apply(BlockStored("b", (1, 2)))
    idx.apply(BlockStored("c", (1, 2)))
    assert idx.best_match((1, 2, 3)) == (2, "b")


def test_lru_eviction_order_and_touch() -> None:
    c = BlockCache(capacity_blocks=3)
    assert c.store([1, 2, 3]) == []
    c.touch([1])  # 1 becomes the most recent
    assert c.store([4]) == [2]
    assert c.store([5, 6]) == [3, 1]
    assert len(c) == 3 and 4 in c and 5 in c and 6 in c


def test_index_capacity_reports_evictions() -> None:
    idx = CacheIndex(["a"], capacity_blocks=2)
    assert idx.apply(BlockStored("a", (1, 2, 3))) == [1]


def test_bad_inputs() -> None:
    with pytest.raises(ConfigError):
        CacheIndex([])
    with pytest.raises(ConfigError):
        CacheIndex(["a", "a"])
    with pytest.raises(ConfigError):
        BlockCache(0)
    with pytest.raises(ConfigError):
        CacheIndex(["a"]).apply(BlockStored("zz", (1,)))
