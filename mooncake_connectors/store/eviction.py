"""Eviction: which objects make room.

LRU order is the order of the master's ``objects`` dict (a get moves its key to the end). Leased,
hard-pinned, spilling and SSD-only objects are never victims; soft-pinned ones only in a second
pass. A victim whose stripes are held by servers with an SSD is spilled (:mod:`.tier`: the
servers write it; its memory is freed when every write is confirmed) instead of dropped.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from . import tier
from .allocator import aligned
from .protocol import stripe_bounds
from .records import HARD, SHIFT, SOFT, SPILLING, Obj

if TYPE_CHECKING:
    from .state import MasterState

EVICT_SCAN = 4096  # objects examined per eviction attempt (bounds one loop iteration)


def victims(st: MasterState, now: float, soft: bool, limit: int) -> list[str]:
    """LRU-first keys that may be evicted now (not leased, pinned, spilling, disk-only)."""
    out: list[str] = []
    touched: list[str] = []
    objs = st.objects
    for key, obj in itertools.islice(objs.items(), limit):
        meta = obj.meta
        ex = obj.extra
        if (
            obj.lease > now
            or meta & (HARD | SPILLING)
            or obj.locs == ()
            or (meta & SOFT and not soft and ex is not None and ex.soft_until > now)
        ):
            touched.append(key)
            continue
        out.append(key)
    if not soft:
        for key in touched:  # do not rescan them at the front next time
            obj = objs.pop(key)
            objs[key] = obj
    return out


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
