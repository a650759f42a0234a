"""Eviction: which objects make room.

LRU order is the order of the master's ``objects`` dict (a get moves its key to the end). Leased,
hard-pinned, spilling and SSD-only objects are never victims; soft-pinned ones only in a second
pass. A victim whose stripes are held by servers with an SSD is spilled (:mod:`.tier`: the
servers write it; its memory is freed when every write is confirmed) instead of dropped.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING

from . import tier
from .allocator import aligned
from .protocol import stripe_bounds, stripe_count
from .records import HARD, SHIFT, SOFT, SPILLING, Obj

if TYPE_CHECKING:
    from .state import MasterState

EVICT_SCAN = 4096  # objects examined per eviction attempt (bounds one loop iteration)
_FIRST, _MOST = 8, EVICT_SCAN  # keys taken from the LRU front at a time (doubling): most
# evictions need one, and a caller that looks at many (a plan) refills a few times only


def victims(st: MasterState, now: float, soft: bool, limit: int) -> Iterator[str]:
    """LRU-first keys that may be evicted now (not leased, pinned, spilling, disk-only), found
    lazily: the caller may evict each before asking for the next, and only the entries it gets
    that far are examined (at most ``limit``). A list of ``limit`` candidates per eviction made
    every key put past the key budget cost a scan of thousands of entries."""
    objs = st.objects
    stayed: set[str] = set()  # examined and still at the front (soft pass, spilled victims)
    examined = 0
    take = _FIRST
    while examined < limit:
        front = [k for k in itertools.islice(objs, len(stayed) + take) if k not in stayed]
        if not front:
            return
        take = min(2 * take, _MOST)
        for key in front:
            if examined >= limit:
                return
            obj = objs.get(key)
            if obj is None:  # evicted meanwhile (a dropped SSD file's owner)
                continue
            examined += 1
            st.counters["evict_examined"] += 1
            meta = obj.meta
            ex = obj.extra
            if (
                obj.lease > now
                or meta & (HARD | SPILLING)
                or obj.locs == ()
                or (meta & SOFT and not soft and ex is not None and ex.soft_until > now)
            ):
                if soft:
                    stayed.add(key)
                else:  # to the back: not examined again at the front next time
                    del objs[key]
                    objs[key] = obj
                continue
            yield key
            if key in objs:  # not evicted (the caller only planned, or it spilled)
                stayed.add(key)


def evict(st: MasterState, key: str, now: float) -> None:
    obj = st.objects.get(key)
    if obj is None:
        return
    st.counters["evictions"] += 1
    ex = obj.extra
    if ex is not None and ex.disk is not None and all(f >= 0 for _, f in ex.disk):
        # also on SSD already (re-reported both ways to a new master): free the memory only
        st._free_memory(key, obj, now)
        obj.locs = ()
        return
    if tier.start_spill(st, key, obj, mem_bytes(st, obj)):
        return
    st.drop(key, obj, now)


def evict_to_watermark(st: MasterState, now: float) -> int:
    if st.recovering(now):
        return 0
    cap = st.capacity()
    if not cap:
        return 0
    used = st.used() - sum(job.nbytes for job in set(st.spilling.values()))
    if used <= st.cfg.high_watermark * cap:
        return 0
    target = st.cfg.low_watermark * cap
    n = 0
    for soft in (False, True):
        for key in victims(st, now, soft, EVICT_SCAN):
            if used <= target:
                return n
            obj = st.objects.get(key)
            if obj is None:
                continue
            used -= mem_bytes(st, obj)
            evict(st, key, now)
            n += 1
    return n


def mem_bytes(st: MasterState, obj: Obj) -> int:
    locs = obj.locs
    if type(locs) is int:
        return aligned(obj.size)
    nrep = obj.meta >> 8
    if not locs or not nrep:
        return 0
    nst = len(locs) // nrep
    per = aligned(stripe_bounds(obj.size, nst)[0][1])
    return per * sum(1 for x in locs if x >= 0 and (x >> SHIFT) in st.segments)


def fits(st: MasterState, room: dict[int, int], size: int, nrep: int) -> bool:
    """Whether a put of ``size`` bytes and ``nrep`` replicas could be placed given ``room``
    (segment id -> free bytes), counting bytes only: the allocator also needs them contiguous,
    so True is an upper bound. Mirrors ``MasterState._place``: a small one-copy value goes to one
    segment; otherwise every stripe needs its copies on distinct servers."""
    order = [s for s in st._order if s.id in room]
    if not order:
        return False
    if nrep == 1 and size <= st.cfg.stripe_size:
        need = aligned(size)
        return any(room[s.id] >= need for s in order)
    nst = stripe_count(size, st.cfg.stripe_size)
    nrep = min(max(1, nrep), len({s.server for s in order}))
    left = dict(room)
    for _, length in stripe_bounds(size, nst):
        need = aligned(length)
        used_by: set[object] = set()
        for _ in range(nrep):
            best = None
            for s in order:  # the roomiest segment of a server this stripe does not use yet
                if (
                    s.server not in used_by
                    and left[s.id] >= need
                    and (best is None or left[s.id] > left[best.id])
                ):
                    best = s
            if best is None:
                return False
            left[best.id] -= need
            used_by.add(best.server)
    return True


def could_ever_fit(st: MasterState, size: int, nrep: int) -> bool:
    """Whether the put fits the mounted segments were they all empty: if not, no eviction helps."""
    return fits(st, {s.id: s.alloc.size for s in st._order if s.alloc is not None}, size, nrep)


def plan(st: MasterState, size: int, nrep: int, now: float) -> list[str] | None:
    """The fewest least-recently-used victims whose memory, with what is free now, makes room
    for the put (bytes counted per segment); None when even every evictable object examined
    would not, so that nothing is evicted for a put that fails anyway."""
    room = {s.id: s.alloc.free for s in st._order if s.alloc is not None}
    if size <= st.cfg.stripe_size:
        least = aligned(size)
    else:
        nst = stripe_count(size, st.cfg.stripe_size)
        least = sum(aligned(n) for _, n in stripe_bounds(size, nst))
    total = sum(room.values())
    chosen: list[str] = []
    seen: set[str] = set()
    for soft in (False, True):
        for key in victims(st, now, soft, EVICT_SCAN):
            obj = st.objects.get(key)
            if obj is None or key in seen:
                continue
            seen.add(key)
            chosen.append(key)
            for seg_id, n in _seg_bytes(obj):
                if seg_id in room:
                    room[seg_id] += n
                    total += n
            if total >= least and fits(st, room, size, nrep):
                return chosen
    return None


def _seg_bytes(obj: Obj) -> list[tuple[int, int]]:
    """(segment id, bytes) of each memory copy of ``obj``."""
    locs = obj.locs
    if type(locs) is int:
        return [(locs >> SHIFT, aligned(obj.size))] if locs >= 0 else []
    nrep = obj.meta >> 8
    if not locs or not nrep:
        return []
    nst = len(locs) // nrep
    bounds = stripe_bounds(obj.size, nst)
    return [(x >> SHIFT, aligned(bounds[i % nst][1])) for i, x in enumerate(locs) if x >= 0]
