"""Eviction and the SSD tier: which objects make room, and spilling them to a server's SSD.

LRU order is the order of the master's ``objects`` dict (a get moves its key to the end). Leased,
hard-pinned, spilling and SSD-only objects are never victims; soft-pinned ones only in a second
pass. A victim with a copy on a server that has an SSD is spilled (the server writes it; its
memory is freed when the write is confirmed) instead of dropped; the oldest spilled objects make
room on a full SSD.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from .allocator import aligned
from .protocol import stripe_bounds
from .records import HARD, MASK, SHIFT, SOFT, SPILLING, Extra, Obj, Server

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
    if start_spill(st, key, obj):
        return
    st.drop(key, obj, now)


def evict_to_watermark(st: MasterState, now: float) -> int:
    if st.recovering(now):
        return 0
    cap = st.capacity()
    if not cap:
        return 0
    used = st.used() - sum(e[3] for e in st.spilling.values())
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


def start_spill(st: MasterState, key: str, obj: Obj) -> bool:
    """Spill a single-stripe object to the SSD of a server holding a copy, if one has room."""
    locs = obj.locs
    copies = (locs,) if type(locs) is int else locs
    nrep = obj.meta >> 8
    if not copies or len(copies) != nrep:  # striped objects are dropped, not spilled
        return False
    need = aligned(obj.size)
    for loc in copies:
        seg = st.segments.get(loc >> SHIFT) if loc >= 0 else None
        if seg is None or not seg.server.ssd_size or need > seg.server.ssd_size:
            continue
        rec = seg.server
        while rec.ssd_used + need > rec.ssd_size and rec.disk:
            fid, (victim, _) = next(iter(rec.disk.items()))
            drop_disk_copy(st, rec, fid, victim)
        if rec.ssd_used + need > rec.ssd_size:
            continue
        fid = next(st._file_ids)
        rec.ssd_used += need
        rec.spills.append((fid, seg.base + (loc & MASK), obj.size))
        st.dirty.add(rec)
        obj.meta |= SPILLING
        st.spilling[fid] = (key, obj, rec, mem_bytes(st, obj))
        st.counters["spills"] += 1
        return True
    return False


def drop_disk_copy(st: MasterState, rec: Server, fid: int, key: str) -> None:
    entry = rec.disk.pop(fid, None)
    if entry is not None:
        rec.ssd_used -= entry[1]
    rec.dropfiles.append(fid)
    st.dirty.add(rec)
    st.counters["ssd_drops"] += 1
    obj = st.objects.get(key)
    if obj is not None and obj.extra is not None and obj.extra.disk == (rec.client_id, fid):
        obj.extra.disk = None
        rec.ops.append(key)
        if not obj.locs:
            del st.objects[key]


def spill_done(st: MasterState, rec: Server, fid: int, ok: bool, now: float) -> None:
    entry = st.spilling.pop(fid, None)
    if entry is None:
        return
    key, obj, srv, _ = entry
    obj.meta &= ~SPILLING
    need = aligned(obj.size)
    if st.objects.get(key) is not obj or not ok:
        srv.ssd_used -= need
        srv.dropfiles.append(fid)
        st.dirty.add(srv)
        if ok is False and st.objects.get(key) is obj:
            st.drop(key, obj, now)
        return
    st._free_memory(key, obj, now)
    ex = obj.extra or Extra()
    ex.disk = (srv.client_id, fid)
    obj.extra = ex
    obj.locs = ()
    srv.disk[fid] = (key, need)
    srv.ops.append(st._part(key, obj, 0, 0, "", fid))
    st.dirty.add(srv)
