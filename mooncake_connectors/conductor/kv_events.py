"""vLLM's KV cache events, turned into the conductor's cache-index events.

vLLM (``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'``)
publishes msgpack ``EventBatch`` messages ``[ts, [event, ...], dp_rank]`` as three ZMQ frames
``(topic, seq as 8 bytes big-endian, payload)``. Each event is a map tagged by ``"type"``:

- ``BlockStored``: ``block_hashes`` (vLLM's own, bytes or int), ``parent_block_hash`` (or nil
  for a prompt's first block), ``token_ids`` of all those blocks, ``block_size``, plus ``medium``,
  ``group_idx``, LoRA and ``extra_keys`` fields;
- ``BlockRemoved``: ``block_hashes``;
- ``AllBlocksCleared``.

vLLM's hashes depend on its hash function and seed, which the proxy does not know; the tokens do
not. :class:`VllmEventTranslator` therefore recomputes our chained key of every stored block from
its tokens and its parent's key (:func:`~.hashing.block_hash`), remembers vLLM hash → our key for
the blocks the instance holds, and maps removals through that table. A proxy then keys a prompt
with :func:`~.hashing.prefix_block_hashes` and matches the same keys.

SGLang publishes the same events in the same encoding (its ``--kv-events-config``; pages of
``page_size`` tokens as blocks), so one translator serves both engines.

Blocks whose KV depends on more than the tokens (LoRA, multimodal inputs, ``cache_salt``: any
``extra_keys`` entry, or SGLang's ``cache_salt`` field), blocks of another KV group or tier than
the primary one, blocks of a size other than the proxy's, and blocks whose parent is unknown (an
event missed) are skipped and counted: the index then under-reports what is cached, which costs
a recompute, never a wrong answer (the engine checks its own cache).

Pure and I/O-free; the ZMQ socket that feeds it lives in :mod:`.live`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from ..errors import ConfigError
from .cache_index import AllBlocksCleared, BlockRemoved, BlockStored, CacheEvent
from .hashing import block_hash

log = logging.getLogger(__name__)

_ROOT = 0
# vLLM marks its primary KV pool "GPU" even on the CPU backend; other media are offload tiers.
_PRIMARY_MEDIA = (None, "GPU")
VllmHash = bytes | int


@dataclasses.dataclass
class TranslatorStats:
    stored_blocks: int = 0
    removed_blocks: int = 0
    cleared: int = 0
    skipped_extra_keys: int = 0  # LoRA / multimodal / cache_salt blocks
    skipped_other_tier: int = 0  # another medium or KV cache group
    skipped_block_size: int = 0  # engine block size differs from the proxy's
    skipped_orphan: int = 0  # parent block never seen (missed event or skipped parent)
    malformed: int = 0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


class VllmEventTranslator:
    """One prefill instance's vLLM events → :mod:`.cache_index` events with our block keys."""

    def __init__(self, instance: str, block_tokens: int) -> None:
        if block_tokens <= 0:
            raise ConfigError("block_tokens must be > 0", block_tokens=block_tokens)
        self.instance = instance
        self.block_tokens = block_tokens
        self.stats = TranslatorStats()
        self._ours: dict[VllmHash, int] = {}
        self._warned_size = False

    def __len__(self) -> int:
        """vLLM blocks currently known to be held by the instance."""
        return len(self._ours)

    def reset(self) -> AllBlocksCleared:
        """Forget everything (the instance restarted); the index must be cleared too."""
        self._ours.clear()
        return AllBlocksCleared(self.instance)

    def translate(self, event: Mapping[str, Any]) -> CacheEvent | None:
        """One decoded vLLM event; None when it says nothing the index can use."""
        kind = event.get("type")
        try:
            if kind == "BlockStored":
                return self._stored(event)
            if kind == "BlockRemoved":
                return self._removed(event)
            if kind == "AllBlocksCleared":
                self.stats.cleared += 1
                return self.reset()
        except (TypeError, ValueError, KeyError, ConfigError) as exc:
            self.stats.malformed += 1
            log.warning("malformed %s event from %s: %r", kind, self.instance, exc)
            return None
        self.stats.malformed += 1
        log.warning("unknown KV event type %r from %s", kind, self.instance)
        return None

    def translate_batch(self, payload: bytes) -> list[CacheEvent]:
        """One msgpack ``EventBatch`` payload → the index events it implies, in order."""
        try:
            batch = msgspec.msgpack.decode(payload)
        except msgspec.DecodeError as exc:
            self.stats.malformed += 1
            log.warning("undecodable KV event batch from %s: %r", self.instance, exc)
            return []
        if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
            self.stats.malformed += 1
            log.warning("KV event batch from %s is not [ts, events, ...]", self.instance)
            return []
        out: list[CacheEvent] = []
        for raw in batch[1]:
            if not isinstance(raw, dict):
                self.stats.malformed += 1
                continue
            ev = self.translate(raw)
            if ev is not None:
                out.append(ev)
        return out

    def _primary(self, event: Mapping[str, Any]) -> bool:
        return event.get("medium") in _PRIMARY_MEDIA and event.get("group_idx") in (None, 0)

    def _stored(self, event: Mapping[str, Any]) -> BlockStored | None:
        hashes: Sequence[VllmHash] = event["block_hashes"]
        tokens: Sequence[int] = event["token_ids"]
        size = int(event["block_size"])
        n = len(hashes)
        if not self._primary(event):
            self.stats.skipped_other_tier += n
            return None
        extra = event.get("extra_keys")
        lora = event.get("lora_name") is not None or event.get("lora_id") is not None
        salted = event.get("cache_salt") is not None  # SGLang: its KV depends on the salt
        if lora or salted or (extra and any(e is not None for e in extra)):
            self.stats.skipped_extra_keys += n
            return None
        if size != self.block_tokens or len(tokens) != n * size:
            self.stats.skipped_block_size += n
            if not self._warned_size:
                self._warned_size = True
                log.warning(
                    "%s publishes %d-token blocks (%d tokens for %d blocks), the proxy keys "
                    "%d-token blocks: set the proxy's block size to the engine's",
                    self.instance, size, len(tokens), n, self.block_tokens,
                )  # fmt: skip
            return None
        parent_hash = event.get("parent_block_hash")
        if parent_hash is None:
            parent = _ROOT
        else:
            found = self._ours.get(parent_hash)
            if found is None:
                self.stats.skipped_orphan += n
                return None
            parent = found
        keys: list[int] = []
        for i, h in enumerate(hashes):
            parent = block_hash(parent, tokens[i * size : (i + 1) * size])
            self._ours[h] = parent
            keys.append(parent)
        self.stats.stored_blocks += n
        return BlockStored(self.instance, tuple(keys))

    def _removed(self, event: Mapping[str, Any]) -> BlockRemoved | None:
        hashes: Sequence[VllmHash] = event["block_hashes"]
        if not self._primary(event):
            return None
        keys = tuple(k for k in (self._ours.pop(h, None) for h in hashes) if k is not None)
        if not keys:
            return None
        self.stats.removed_blocks += len(keys)
        return BlockRemoved(self.instance, keys)
