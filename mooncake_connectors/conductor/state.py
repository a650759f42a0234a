"""The conductor's running picture of each instance's load, kept from its own decisions.

Queue time is "queued work" as in the paper (§6.1): the estimated prefill seconds of every
request placed on an instance and not yet reported finished, run in order. Decode load is the set
of requests sent to a decode instance, with when they are expected to join and leave its batch.
Reports of real progress (prefill finished, decode started/finished) replace estimates as they
come, so errors do not accumulate.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections import OrderedDict

from .estimators import DecodeModel


@dataclasses.dataclass
class _Queued:
    ready_at: float  # earliest start: a prefix fetch must land first
    est_s: float
    block_hashes: tuple[int, ...]


class PrefillView:
    """Outstanding prefill work of one instance, FIFO."""

    def __init__(self) -> None:
        self._anchor = 0.0  # when the head of the queue could start (last finish or first add)
        self._queue: OrderedDict[int, _Queued] = OrderedDict()
        # Blocks that queued requests will have stored by the time a request placed now starts
        # (FIFO), with how many queued requests will produce each.
        self._pending: dict[int, int] = {}
        # Work the instance has that this conductor did not place (a live proxy learns it from
        # the instance's metrics), run before anything placed now.
        self.external_s = 0.0
        # How much slower than the prefill model this instance really runs (a live proxy learns
        # it from finished prefill legs; 1.0 in a replay).
        self.slowdown = 1.0

    def __len__(self) -> int:
        return len(self._queue)

    def drain_time(self, now: float) -> float:
        """When the instance is expected to be free of everything queued."""
        t = self._anchor
        first = True
        for item in self._queue.values():
            t = max(t, item.ready_at) + item.est_s
            if first:
                # A head running past its estimate is assumed to finish now, not in the past.
                t = max(t, now)
                first = False
        return max(t, now) + self.external_s

    def queue_time(self, now: float) -> float:
        return self.drain_time(now) - now

    def add(
        self,
        request_id: int,
        now: float,
        ready_at: float,
        est_s: float,
        block_hashes: tuple[int, ...] = (),
    ) -> None:
        if not self._queue:
            self._anchor = now
        self._queue[request_id] = _Queued(ready_at, est_s, block_hashes)
        for k in block_hashes:
            self._pending[k] = self._pending.get(k, 0) + 1

    @property
    def anchor(self) -> float:
        return self._anchor

    def finish(self, request_id: int, now: float) -> bool:
        """Drop a finished request; False when it was not queued here."""
        return self.finish_keys(request_id, now) is not None

    def finish_keys(self, request_id: int, now: float) -> tuple[int, ...] | None:
        """Drop a finished request; its block keys, or None when it was not queued here."""
        item = self._queue.pop(request_id, None)
        if item is None:
            return None
        for k in item.block_hashes:
            left = self._pending[k] - 1
            if left:
                self._pending[k] = left
            else:
                del self._pending[k]
        self._anchor = now
        return item.block_hashes

    def pending_match(self, keys: tuple[int, ...], start: int) -> int:
        """Extend a cached prefix of ``start`` blocks with blocks queued requests will store."""
        n = start
        pending = self._pending
        while n < len(keys) and keys[n] in pending:
            n += 1
        return n


@dataclasses.dataclass
class _Running:
    join_s: float  # expected (until reported) time the request joins the decode batch
    prompt_tokens: int
    started: bool = False


class DecodeView:
    """Requests sent to one decode instance, current and predicted batch."""

    def __init__(self, model: DecodeModel) -> None:
        self.model = model
        self._reqs: dict[int, _Running] = {}
        # Sequences decoding there that this conductor did not send (a live proxy reads them
        # from the instance's metrics), with their KV tokens.
        self.external_requests = 0
        self.external_kv_tokens = 0.0

    def __len__(self) -> int:
        return len(self._reqs)

    def add(self, request_id: int, join_s: float, prompt_tokens: int) -> None:
        self._reqs[request_id] = _Running(join_s, prompt_tokens)

    def started(self, request_id: int, now: float) -> None:
        r = self._reqs.get(request_id)
        if r is not None:
            r.join_s = now
            r.started = True

    def finish(self, request_id: int) -> bool:
        return self._reqs.pop(request_id, None) is not None

    def current_tbt(self, extra_tokens: int, out_tokens: float) -> float:
        """Step time now, with one more sequence of ``extra_tokens`` added (Algorithm 1's view)."""
        batch = 1 + self.external_requests
        kv = float(extra_tokens) + self.external_kv_tokens
        for r in self._reqs.values():
            if r.started:
                batch += 1
                kv += r.prompt_tokens + out_tokens / 2
        return self.model.step_time(batch, kv)

    def predicted(
        self, now: float, at: float, decode_s: float, out_tokens: float
    ) -> tuple[int, float, float]:
        """(batch, kv tokens in use, kv tokens reserved) expected at time ``at``.

        Every request is assumed to decode for ``decode_s`` seconds after joining (the paper's
        system-level prediction, §7.3). Reserved counts each one's whole expected output.
        """
        batch = self.external_requests
        kv = self.external_kv_tokens
        reserved = self.external_kv_tokens
        for r in self._reqs.values():
            end = r.join_s + decode_s
            # One that already overran the typical duration (not reported done) is still there.
            if r.join_s <= at and (end > at or (r.started and end <= now)):
                batch += 1
                kv += r.prompt_tokens + out_tokens / 2
                reserved += r.prompt_tokens + out_tokens
        return batch, kv, reserved


class LoadOrder:
    """Prefill instances ordered by a lower bound of when each is free of its queued work.

    A large pool's placement looks at the instances that hold part of the prompt, then at the
    least loaded others in this order, and stops as soon as the bound says no further instance
    can beat the best plan so far. The bound is the drain time computed at the instance's last
    change: drain time never decreases while the queue is unchanged, so it stays a lower bound.
    A min-heap with stale entries skipped (each change pushes a new entry), rebuilt when stale
    entries outnumber live ones.
    """

    def __init__(self, names: tuple[str, ...]) -> None:
        self._rank = {n: i for i, n in enumerate(names)}
        self._version = dict.fromkeys(names, 0)
        self._heap: list[tuple[float, int, int, str]] = [
            (0.0, i, 0, n) for i, n in enumerate(names)
        ]
        heapq.heapify(self._heap)
        self._bound = dict.fromkeys(names, 0.0)

    def update(self, name: str, free_at: float) -> None:
        v = self._version[name] + 1
        self._version[name] = v
        self._bound[name] = free_at
        heapq.heappush(self._heap, (free_at, self._rank[name], v, name))
        if len(self._heap) > 2 * len(self._version) + 64:
            self._heap = [(self._bound[n], self._rank[n], v, n) for n, v in self._version.items()]
            heapq.heapify(self._heap)

    def bound(self, name: str) -> float:
        return self._bound[name]

    def pop(self) -> tuple[float, int, int, str] | None:
        """The next live entry (lowest bound first); give it back with :meth:`restore`."""
        heap = self._heap
        while heap:
            item = heapq.heappop(heap)
            if self._version[item[3]] == item[2]:
                return item
        return None

    def restore(self, items: list[tuple[float, int, int, str]]) -> None:
        for item in items:
            heapq.heappush(self._heap, item)
