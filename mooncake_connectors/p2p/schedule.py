"""The pure parts of a swarm: which chunk from which holder, and how a holder rations its egress.

Nothing here does I/O, so the policies are tested on their own (tests/test_p2p_schedule.py).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from .records import has


@dataclass
class PeerView:
    """What a fetcher knows of one holder."""

    holder: str
    endpoint: str
    segment: str
    have: bytes = b""
    bad: set[int] = field(default_factory=set)  # chunks whose bytes from it failed their hash
    inflight: int = 0
    busy_until: float = 0.0  # it asked us to wait (its egress budget) until then
    dead_until: float = 0.0  # it did not answer; skipped until then (or until its lease renews)
    capped: bool = False  # it served us its per-peer cap
    renewed: float = 0.0
    renewed_at_death: float = 0.0  # its record's renewal when it last failed us
    answered: bool = False  # it answered a grant request once (a record alone proves nothing)

    def usable(self, now: float) -> bool:
        return not self.capped and now >= self.busy_until and now >= self.dead_until

    def offers(self, chunk: int) -> bool:
        return chunk not in self.bad and has(self.have, chunk)


def rarity(chunks: Iterable[int], peers: Iterable[PeerView]) -> dict[int, int]:
    """How many holders (alive, not capped, not known bad for it) offer each chunk."""
    live = [p for p in peers if not p.capped and p.dead_until <= time.monotonic()]
    return {c: sum(p.offers(c) for p in live) for c in chunks}


def pick(
    needed: Iterable[int],
    peers: dict[str, PeerView],
    k: int,
    *,
    limit: int,
    rng: random.Random,
    now: float | None = None,
) -> list[tuple[int, str]]:
    """Up to ``limit`` (chunk, holder) pairs: rarest chunk first, random among equally rare.

    A holder gets at most ``k`` requests in flight; among the holders that offer a chunk the
    least busy one wins, ties broken at random. Chunks no usable holder offers are left for later.
    """
    now = time.monotonic() if now is None else now
    ready = [p for p in peers.values() if p.usable(now)]
    if not ready or limit <= 0:
        return []
    count = rarity(needed, peers.values())
    order = sorted((c for c, n in count.items() if n > 0), key=lambda c: (count[c], rng.random()))
    load = {p.holder: p.inflight for p in ready}
    out: list[tuple[int, str]] = []
    for c in order:
        best: list[PeerView] = []
        for p in ready:
            if load[p.holder] >= k or not p.offers(c):
                continue
            if not best or load[p.holder] < load[best[0].holder]:
                best = [p]
            elif load[p.holder] == load[best[0].holder]:
                best.append(p)
        if not best:
            continue
        chosen = rng.choice(best)
        load[chosen.holder] += 1
        out.append((c, chosen.holder))
        if len(out) >= limit:
            break
    return out


class TokenBucket:
    """Egress budget in bytes per second; a grant may overdraw it, later grants then wait.

    Overdrawing by one chunk keeps the long-run rate exact without splitting chunks, and a
    holder's first grant never waits (``burst`` is the credit it starts with and saves up to).
    """

    def __init__(
        self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.rate = float(rate)
        self.burst = float(burst)
        self.clock = clock
        self.tokens = float(burst)
        self.at = clock()

    def take(self, n: int) -> float:
        """Charge ``n`` bytes and return 0, or return the seconds until a grant is possible."""
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens <= 0:
            return -self.tokens / self.rate + 1e-3
        self.tokens -= n
        return 0.0


class ServeLedger:
    """Bytes served to each peer, against an optional per-peer cap."""

    def __init__(self, cap: int | None) -> None:
        self.cap = cap
        self.served: dict[str, int] = {}

    def room(self, peer: str, n: int) -> bool:
        return self.cap is None or self.served.get(peer, 0) + n <= self.cap

    def charge(self, peer: str, n: int) -> None:
        self.served[peer] = self.served.get(peer, 0) + n


__all__ = ["PeerView", "ServeLedger", "TokenBucket", "pick", "rarity"]
