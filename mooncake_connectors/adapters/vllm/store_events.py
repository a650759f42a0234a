"""KV events for the blocks the store holds, in vLLM's own event classes.

A worker that saved a request's blocks (or found them stored already) reports one ``BlockStored``
for the leading run of blocks now held for every layer of its TP rank. vLLM gathers the workers'
events into the scheduler-side connector (``KVConnectorOutput.kv_cache_events``); there a block
is announced once every TP rank has reported it, since a load needs all ranks' objects, and
vLLM's publisher sends it to KV-aware routers next to its own GPU-block events.

``medium`` is ``CPU``: a save lands in the store servers' memory. The store's later moves
(eviction, demotion to SSD) are not reported (no ``BlockRemoved``): the master does not tell
clients, so a router may still route to a block the store has dropped, and then the lookup
misses and the prompt is computed, as without events.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from vllm.distributed.kv_events import MEDIUM_CPU, BlockStored, KVCacheEvent, KVConnectorKVEvents

if TYPE_CHECKING:
    from .store_scheduler import BlockSpec

# Events waiting for the other TP ranks; beyond this many the oldest are dropped (a rank whose
# save failed never reports its part, and its peers' events must not pile up).
MAX_PENDING = 4096


def stored_event(spec: BlockSpec, held: int) -> BlockStored | None:
    """The event for the first ``held`` blocks of a save, None if it carries no event data."""
    if held <= 0 or not spec.token_ids:
        return None
    block_size = len(spec.token_ids) // len(spec.hashes)
    extra = spec.extra_keys[:held] if spec.extra_keys else None
    return BlockStored(
        block_hashes=[bytes.fromhex(h) for h in spec.hashes[:held]],
        # a save from the prompt's first block, or a step save chained to the one before
        parent_block_hash=bytes.fromhex(spec.parent) if spec.parent else None,
        token_ids=list(spec.token_ids[: held * block_size]),
        block_size=block_size,
        lora_id=None,
        medium=MEDIUM_CPU,
        lora_name=spec.lora_name,
        extra_keys=extra if extra and any(e is not None for e in extra) else None,
    )


class StoreKVEvents(KVConnectorKVEvents):  # type: ignore[misc]  # Any without vLLM
    """One step's events of one or more workers (vLLM's aggregator adds the others')."""

    def __init__(self, events: list[KVCacheEvent] | None = None) -> None:
        self._events = list(events or ())
        self._workers = 1

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._events.extend(events)

    def aggregate(self) -> StoreKVEvents:
        return self  # counted across steps by StoreEventLog, where ranks report at any step

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self._events)

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._events = []
        self._workers = 1


class StoreEventLog:
    """Scheduler side: events held until all ``tp_size`` ranks reported them."""

    def __init__(self, tp_size: int) -> None:
        self.tp_size = tp_size
        self._pending: Counter[KVCacheEvent] = Counter()
        self._ready: list[KVCacheEvent] = []

    def add(self, events: list[KVCacheEvent]) -> None:
        for event in events:
            self._pending[event] += 1
            if self._pending[event] >= self.tp_size:
                del self._pending[event]
                self._ready.append(event)
        while len(self._pending) > MAX_PENDING:  # insertion order: oldest first
            del self._pending[next(iter(self._pending))]

    def take(self) -> list[KVCacheEvent]:
        ready, self._ready = self._ready, []
        return ready
