from __future__ import annotations

import pytest

from mooncake_connectors.conductor.hashing import (
    block_hash,
    cached_tokens,
    prefix_block_hashes,
    prefix_match_blocks,
)
from mooncake_connectors.errors import ConfigError


def test_full_blocks_only_by_default() -> None:
    assert len(prefix_block_hashes(list(range(10)), 4)) == 2
    assert len(prefix_block_hashes(list(range(10)), 4, partial=True)) == 3
    assert prefix_block_hashes(list(range(3)), 4) == []


def test_keys_are_chained() -> None:
    a = prefix_block_hashes([1, 2, 3, 4, 5, 6], 2)
    assert a[0] == block_hash(0, [1, 2])
    assert a[1] == block_hash(a[0], [3, 4])
    assert a[2] == block_hash(a[1], [5, 6])


def test_shared_prefix_shares_keys_and_diverges_after() -> None:
    a = prefix_block_hashes([1, 2, 3, 4, 5, 6], 2)
    b = prefix_block_hashes([1, 2, 3, 4, 9, 9], 2)
    assert a[:2] == b[:2]
    assert a[2] != b[2]


def test_same_block_after_different_prefix_differs() -> None:
    # Block [5, 6] at position 2 must not match when what precedes it differs.
    a = prefix_block_hashes([1, 2, 3, 4, 5, 6], 2)
    b = prefix_block_hashes([7, 7, 3, 4, 5, 6], 2)
    assert not set(a) & set(b)


def test_match_stops_at_first_miss() -> None:
    keys = [10, 11, 12, 13]
    assert prefix_match_blocks(keys, {10, 11, 13}) == 2
    assert prefix_match_blocks(keys, {11, 12, 13}) == 0
    assert prefix_match_blocks(keys, set(keys)) == 4


def test_cached_tokens_caps_at_prompt() -> None:
    assert cached_tokens(3, 1200, 512) == 1200
    assert cached_tokens(2, 1200, 512) == 1024


@pytest.mark.parametrize("bad", [0, -5])
def test_bad_block_size_raises(bad: int) -> None:
    with pytest.raises(ConfigError):
        prefix_block_hashes([1, 2, 3], bad)


def test_bad_token_raises() -> None:
    with pytest.raises(ConfigError):
        prefix_block_hashes([1 << 70, 2], 2)
