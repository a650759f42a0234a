"""Rebuilding the master's state from what servers re-report (a new leader, a restarted master,
or a server that came back after being declared dead).

A server that mounts with ``recover=True`` sends its holdings (one ``Part`` per stripe copy, in
chunks); when the last chunk arrives the parts are merged into ``objects`` and the segment's
allocator is built with exactly the accepted ranges in use. An object is readable as soon as
every stripe has a copy; until the recovery window ends an incomplete object is kept (its other
stripes may still be reported by another server), afterwards it is dropped like a lost one.
"""

from __future__ import annotations

import heapq
import logging
import time

from .allocator import RangeAllocator, aligned
from .protocol import Part, stripe_bounds
from .records import PIN, SHIFT, SOFT, Extra, Obj, Segment, Server, key_cost, pack
from .state import MasterState
from .tier import NO_FILE, ssd_bytes

log = logging.getLogger(__name__)


def collect(state: MasterState, rec: Server, parts: list[Part], done: bool, now: float) -> None:
    if rec.parts is None:
        rec.parts = []
    rec.parts.extend(parts)
    if done:
        rebuild(state, rec, now)


def rebuild(state: MasterState, rec: Server, now: float) -> int:
    """Merge ``rec``'s reported parts; returns how many parts were accepted."""
    parts, rec.parts = rec.parts or [], None
    segs = {s.name: s for s in rec.segments}
    used: dict[Segment, list[tuple[int, int]]] = {s: [] for s in rec.segments}
    wall_ms = time.time() * 1000
    accepted = 0
    commits: dict[tuple[int, str], int] = {}  # (put id, key) -> unix ms of the accepted objects
    for p in parts:
        if p.nrep < 1 or p.nst < 1 or not 0 <= p.ridx < p.nrep or not 0 <= p.sidx < p.nst:
            continue
        if p.ttl_wall_ms and p.ttl_wall_ms <= wall_ms:
            continue  # expired while no master was looking
        seg = None
        length = 0
        if p.segment:
            seg = segs.get(p.segment)
            length = stripe_bounds(p.size, p.nst)[p.sidx][1]
            if seg is None or p.offset < 0 or p.offset + aligned(length) > seg.size:
                continue
        obj = state.objects.get(p.key)
        if obj is None:
            obj = _new_obj(state, p, now, wall_ms, disk_only=seg is None)
        elif obj.size != p.size or obj.meta >> 8 != p.nrep:
            continue  # another object took this key meanwhile; this copy is garbage
        if seg is not None:
            if not _set_copy(state, obj, p, pack(seg.id, p.offset)):
                continue
            used[seg].append((p.offset, length))
        else:
            fid = p.offset
            ex = obj.extra or Extra()
            disk = ex.disk if ex.disk is not None else (NO_FILE,) * p.nst
            if len(disk) != p.nst:
                continue
            cid, had = disk[p.sidx]
            if had >= 0 and (had != fid or cid == rec.client_id):
                continue
            if had == fid:  # file ids are unique: this is the same file, from a restarted server
                _disown(state, cid, fid)
            ex.disk = (*disk[: p.sidx], (rec.client_id, fid), *disk[p.sidx + 1 :])
            obj.extra = ex
            need = ssd_bytes(stripe_bounds(p.size, p.nst)[p.sidx][1])
            rec.disk[fid] = (p.key, need)
            rec.ssd_used += need
        accepted += 1
        if p.put_id:
            commits[(p.put_id, p.key)] = p.at_ms
    # Their puts may be retried across the fail-over, to be told OK, not EXISTS. Not only those
    # of the last put lease: a client retries a lost commit until its call's deadline, and the
    # fail-over itself can take longer than a (short) put lease.
    state.recall(commits)
    for seg in rec.segments:
        if seg.alloc is None:
            seg.alloc = RangeAllocator.with_used(seg.size, used[seg])
            state._order.append(seg)
    log.info(
        "%s re-reported %d part(s), %d accepted; %d keys known",
        rec.client_id,
        len(parts),
        accepted,
        len(state.objects),
    )
    return accepted


def _disown(state: MasterState, client_id: str, fid: int) -> None:
    """Forget that ``client_id`` (an earlier run of the server now reporting ``fid``) holds it."""
    old = state.servers.get(client_id)
    entry = old.disk.pop(fid, None) if old is not None else None
    if old is not None and entry is not None:
        old.ssd_used -= entry[1]


def _new_obj(state: MasterState, p: Part, now: float, wall_ms: float, disk_only: bool) -> Obj:
    n = p.nrep * p.nst
    locs: object = () if disk_only else (-1 if n == 1 else tuple([-1] * n))
    obj = Obj(p.size, locs, p.nrep << 8 | (p.flags & PIN))
    if p.ttl_wall_ms or p.flags & SOFT:
        obj.extra = Extra(
            ttl=now + (p.ttl_wall_ms - wall_ms) / 1000 if p.ttl_wall_ms else 0.0,
            soft_until=now + state.cfg.soft_pin_ttl if p.flags & SOFT else 0.0,
        )
        if p.ttl_wall_ms:
            heapq.heappush(state._ttl_heap, (obj.extra.ttl, next(state._seq), p.key, obj))
    state.objects[p.key] = obj
    state.key_bytes += key_cost(p.key)
    return obj


def _set_copy(state: MasterState, obj: Obj, p: Part, packed: int) -> bool:
    """Put a reported copy into its slot unless a live copy is already there."""
    i = p.ridx * p.nst + p.sidx
    locs = obj.locs
    if type(locs) is int:
        if i != 0 or (locs >= 0 and (locs >> SHIFT) in state.segments):
            return False
        obj.locs = packed
        return True
    if not isinstance(locs, tuple) or len(locs) != p.nrep * p.nst:
        return False  # a disk-only object, or another layout
    cur = locs[i]
    if cur >= 0 and (cur >> SHIFT) in state.segments:
        return False
    lst = list(locs)
    lst[i] = packed
    obj.locs = tuple(lst)
    return True
