"""The master's state and rules, without I/O: keys, copies, allocation, leases, eviction, liveness.

Everything here runs in the master's one loop thread. Per key the master keeps one small
``Obj``: its size, its copies packed as ints (``segment id << 40 | offset``; one int for the
common one-replica one-stripe object, else a replica-major tuple, ``-1`` for no copy), a word of
flags and replica count, a read-lease deadline, and an ``extra`` record only for the rare (TTL,
soft pin, SSD copy). The ``objects`` dict's order is the LRU order: a get moves its key to the end.

Messages for servers (what they hold, what to spill, which files to drop) collect in each
server's record; the master flushes them before it answers the request that caused them.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import random
import time
from collections.abc import Iterator
from typing import Any, TypeVar

from ..errors import ConfigError
from . import batch, eviction, tier
from .allocator import RangeAllocator, aligned
from .config import MasterConfig
from .protocol import Code, Loc, Part, stripe_bounds, stripe_count
from .records import (
    MASK,
    PIN,
    SHIFT,
    SOFT,
    Extra,
    Obj,
    Pending,
    Segment,
    Server,
    key_cost,
    pack,
)

log = logging.getLogger(__name__)
RECENT_COMMITS = 4096
RESERVE_SHARE = 0.1  # of mounted memory, at most, held by reservations
K = TypeVar("K")


def _held(size: int, nrep: int) -> int:
    return aligned(size) * max(1, nrep)


def _due(leases: dict[K, Pending], now: float) -> list[tuple[K, Pending]]:
    """The entries whose deadline has passed, from a dict kept in deadline order (entries are
    added in start order and every lease of one kind has the same length)."""
    due = []
    for key, p in leases.items():
        if p.deadline > now:
            break
        due.append((key, p))
    return due


class MasterState:
    def __init__(self, config: MasterConfig, now: float | None = None) -> None:
        self.cfg = config
        now = time.monotonic() if now is None else now
        self.objects: dict[str, Obj] = {}
        self.pending: dict[str, Pending] = {}
        # (put id, key) -> when (unix ms) of the latest commits, oldest first: a commit repeated
        # because its reply was lost (or its master failed over) is recognised as done
        self.recent: collections.OrderedDict[tuple[int, str], int] = collections.OrderedDict()
        self.reserved: dict[int, Pending] = {}  # reservation id -> allocation
        self.reserved_bytes = 0  # memory the reservations hold (capped: eviction cannot free it)
        self.key_bytes = 0  # key_cost of every key in objects and pending (cfg.key_budget)
        # seconds of work one put may take before its remaining keys are answered BUSY
        self.work_budget = config.server_ttl / 10
        self.segments: dict[int, Segment] = {}
        self.seg_by_name: dict[str, Segment] = {}
        self.servers: dict[str, Server] = {}
        self.dirty: set[Server] = set()
        self.spilling: dict[int, tier.Job] = {}  # file id -> its object's spill
        self.promoting: dict[int, tier.Job] = {}  # file id -> its object's promotion
        # (drop at, seq, server, file id, bytes): files of promoted objects a reader may still load
        self._late_files: list[tuple[float, int, Server, int, int]] = []
        self._order: list[Segment] = []  # allocatable segments, placement rotates over them
        self._rr = 0
        self._seg_ids = itertools.count(1)
        self._file_ids = itertools.count(random.getrandbits(20) << 32)
        self._seq = itertools.count()
        self._sizes: dict[int, int] = {}
        self._ttl_heap: list[tuple[float, int, str, Obj]] = []
        # (free at, seq, locs, size, stripes): memory a reader's lease still protects
        self._deferred: list[tuple[float, int, list[int], int, int]] = []
        self._sweep: Iterator[str] | None = None
        self.recover_until = now + max(config.read_lease_ttl, 3 * config.heartbeat_interval)
        self.rebuilt = False  # some server re-reported holdings to this master
        self.epoch = random.getrandbits(31)
        self.counters: dict[str, int] = dict.fromkeys(
            (
                "puts",
                "put_failures",
                "gets",
                "hits",
                "removes",
                "evictions",
                "spills",
                "spill_failures",
                "ssd_drops",
                "ssd_damaged",
                "ssd_hits",
                "promotions",
                "promotion_failures",
                "expired_puts",
                "ttl_expired",
                "servers_lost",
                "evict_examined",
            ),
            0,
        )

    # -- servers and segments ---------------------------------------------------------------
    def server(self, client_id: str, conn: Any, now: float) -> Server:
        rec = self.servers.get(client_id)
        if rec is None or not rec.alive:
            rec = Server(client_id, conn, now)
            self.servers[client_id] = rec
        rec.conn = conn
        rec.last_seen = now
        return rec

    def mount(
        self,
        rec: Server,
        name: str,
        base: int,
        size: int,
        host_id: str,
        endpoint: str,
        ssd_size: int,
        recover: bool,
    ) -> Segment:
        old = self.seg_by_name.get(name)
        if old is not None:
            if old.server is rec and old.base == base and old.size == size:
                return old
            raise ConfigError(f"segment {name!r} is already mounted by {old.server.client_id}")
        seg = Segment(next(self._seg_ids), name, base, size, rec)
        seg.host_id = host_id
        rec.segments.append(seg)
        rec.endpoint = endpoint
        rec.ssd_size = ssd_size
        self.segments[seg.id] = seg
        self.seg_by_name[name] = seg
        if recover:
            rec.parts = []
            self.rebuilt = True
        else:
            seg.alloc = RangeAllocator(size)
            self._order.append(seg)
        log.info("mounted %s (%d bytes) of %s", name, size, rec.client_id)
        return seg

    def unmount(self, rec: Server, name: str, now: float) -> bool:
        seg = self.seg_by_name.get(name)
        if seg is None or seg.server is not rec:
            return False
        self._drop_segment(seg)
        rec.segments.remove(seg)
        self._sweep = iter(list(self.objects))
        return True

    def _drop_segment(self, seg: Segment) -> None:
        self.segments.pop(seg.id, None)
        self.seg_by_name.pop(seg.name, None)
        if seg in self._order:
            self._order.remove(seg)

    def server_lost(self, rec: Server) -> None:
        """A server stopped heartbeating: unmount its segments; its copies become misses."""
        log.warning("server %s is gone; unmounting %d segment(s)", rec.client_id, len(rec.segments))
        rec.alive = False
        self.counters["servers_lost"] += 1
        for seg in rec.segments:
            self._drop_segment(seg)
        tier.abandon(self, rec, time.monotonic())
        self.servers.pop(rec.client_id, None)
        self.dirty.discard(rec)
        self._sweep = iter(list(self.objects))  # purge lost objects a slice per tick

    # -- totals -----------------------------------------------------------------------------
    def capacity(self) -> int:
        return sum(s.alloc.size for s in self._order if s.alloc is not None)

    def used(self) -> int:
        return sum(s.alloc.used for s in self._order if s.alloc is not None)

    # -- placement --------------------------------------------------------------------------
    def _place(self, size: int, nrep: int, preferred: str) -> tuple[list[int], int] | None:
        order = self._order
        if not order:
            return None
        if nrep == 1 and size <= self.cfg.stripe_size and not preferred:
            n = len(order)  # the common case, kept lean: one copy, one stripe
            start = self._rr
            for k in range(n):
                one = order[(start + k) % n]
                got = one.alloc.alloc(size)  # type: ignore[union-attr]
                if got is not None:
                    return [one.id << SHIFT | got], 1
            return None
        nst = stripe_count(size, self.cfg.stripe_size)
        bounds = stripe_bounds(size, nst)
        n_servers = len({s.server for s in order})
        nrep = min(nrep, n_servers)
        locs = [-1] * (nrep * nst)
        pref = self.seg_by_name.get(preferred) if preferred else None
        if pref is not None and pref.alloc is None:
            pref = None
        n = len(order)
        start = self._rr
        for s in range(nst):
            length = bounds[s][1]
            used_by: list[Server] = []
            for r in range(nrep):
                off = None
                seg = None
                if r == 0 and pref is not None:
                    seg = pref
                    off = pref.alloc.alloc(length)  # type: ignore[union-attr]
                if off is None:
                    for k in range(n):
                        seg = order[(start + k) % n]
                        if seg.server in used_by:
                            continue
                        off = seg.alloc.alloc(length)  # type: ignore[union-attr]
                        if off is not None:
                            break
                if off is None or seg is None:
                    self._release_locs(locs, size, nst)
                    return None
                used_by.append(seg.server)
                locs[r * nst + s] = pack(seg.id, off)
            start += 1
        return locs, nrep

    def _release_locs(self, locs: Any, size: int, nst: int) -> None:
        if type(locs) is int:
            locs = (locs,)
        bounds = stripe_bounds(size, nst) if nst > 1 else [(0, size)]
        for i, loc in enumerate(locs):
            if loc < 0:
                continue
            seg = self.segments.get(loc >> SHIFT)
            if seg is not None and seg.alloc is not None:
                seg.alloc.release(loc & MASK, bounds[i % nst][1])

    def allocate(
        self, size: int, nrep: int, preferred: str, now: float
    ) -> tuple[list[int], int] | Code:
        placed = self._place(size, nrep, preferred)
        if placed is not None:
            return placed
        if self._order and not eviction.could_ever_fit(self, size, nrep):
            return Code.NO_SPACE  # larger than the segments can hold: no eviction can help
        if self.settling(now):  # servers are (re)registering and re-reporting: room comes soon
            return Code.BUSY
        if not self._order:
            return Code.NO_SPACE
        # Choose LRU victims that make room before evicting any: a put that cannot fit even so
        # evicts nothing. Spilled victims free their memory only once the server wrote them:
        # then the caller should retry.
        chosen = eviction.plan(self, size, nrep, now)
        if chosen is None:
            return Code.BUSY if self.spilling else Code.NO_SPACE
        need = aligned(size) * max(1, nrep)
        spilling = 0
        # The plan counts bytes, not contiguous ranges: when the chosen victims leave holes too
        # scattered for the put, more LRU victims follow (a bounded scan, as the plan's).
        more = (
            k
            for soft in (False, True)
            for k in eviction.victims(self, now, soft, eviction.EVICT_SCAN)
        )
        for key in itertools.chain(chosen, more):
            n_spill = len(self.spilling)
            obj = self.objects.get(key)
            if obj is None:
                continue
            nbytes = eviction.mem_bytes(self, obj)
            eviction.evict(self, key, now)
            if len(self.spilling) > n_spill:
                spilling += nbytes
                if spilling >= need:
                    return Code.BUSY
                continue
            placed = self._place(size, nrep, preferred)
            if placed is not None:
                return placed
        # spills still being written (this call's or earlier ones) free memory soon: retry
        return Code.BUSY if spilling or self.spilling else Code.NO_SPACE

    def evict_to_watermark(self, now: float) -> int:
        return eviction.evict_to_watermark(self, now)

    def spill_done(self, client_id: str, fid: int, ok: bool, now: float) -> None:
        tier.file_done(self, client_id, fid, ok, now, spill=True)

    def file_lost(self, rec: Server, fid: int) -> None:
        """``rec`` found file ``fid`` damaged: its object is gone (reads are plain misses)."""
        if fid in rec.disk:
            tier.drop_file_owner(self, rec, fid, "ssd_damaged")

    def promote_done(self, client_id: str, fid: int, ok: bool, now: float) -> None:
        tier.file_done(self, client_id, fid, ok, now, spill=False)

    def settling(self, now: float) -> bool:
        """Servers may still be (re)registering with this new master: an allocation it does not
        know may yet be re-reported, so a commit of one is 'retry', not 'expired'."""
        return now < self.recover_until or any(r.parts is not None for r in self.servers.values())

    def recovering(self, now: float) -> bool:
        """Servers are re-reporting to this (new) master: readers may hold leases it never
        granted, so nothing is evicted yet."""
        return self.rebuilt and now < self.recover_until

    # -- dropping and freeing ---------------------------------------------------------------
    def _free_memory(
        self, key: str, obj: Obj, now: float, force: bool = False, notify: bool = True
    ) -> None:
        """Release the object's memory copies (later if a reader holds a lease)."""
        locs = obj.locs
        if type(locs) is int:
            locs = [locs]
        if not locs:
            return
        if notify:
            for loc in locs:
                seg = self.segments.get(loc >> SHIFT) if loc >= 0 else None
                if seg is not None and seg.server.alive:
                    seg.server.ops.append(key)
                    self.dirty.add(seg.server)
        nst = max(1, len(locs) // max(1, obj.meta >> 8))
        if obj.lease > now and not force:
            entry = (obj.lease, next(self._seq), list(locs), obj.size, nst)
            heapq.heappush(self._deferred, entry)
            return
        self._release_locs(locs, obj.size, nst)

    def drop(
        self, key: str, obj: Obj, now: float, force: bool = False, notify: bool = True
    ) -> None:
        """Forget ``key`` now; its memory is freed once no read lease protects it."""
        if self.objects.get(key) is obj:
            del self.objects[key]
            self.key_bytes -= key_cost(key)
        self._free_memory(key, obj, now, force, notify)
        ex = obj.extra
        if ex is not None and ex.disk is not None:
            tier.release_disk(self, key, ex.disk, notify)
            ex.disk = None

    def _part(
        self,
        key: str,
        obj: Obj,
        ridx: int,
        sidx: int,
        segment: str,
        offset: int,
        put_id: int = 0,
    ) -> Part:
        ex = obj.extra
        ttl_wall = 0
        if ex is not None and ex.ttl:
            ttl_wall = int((time.time() + ex.ttl - time.monotonic()) * 1000)
        nrep = obj.meta >> 8
        locs = obj.locs
        nst = 1 if type(locs) is int or not locs else len(locs) // max(1, nrep)
        if not locs and ex is not None and ex.disk is not None:
            nst = len(ex.disk)
        flags = obj.meta & PIN
        at_ms = int(time.time() * 1000) if put_id else 0
        return Part(
            key, obj.size, nrep, nst, ridx, sidx, flags, ttl_wall, segment, offset, put_id, at_ms
        )

    def note_holdings(self, key: str, obj: Obj, put_id: int = 0, at_ms: int = 0) -> None:
        """Queue the copies of ``key`` for their servers; with ``put_id``, as committed by that
        put at ``at_ms`` (unix ms; 0: now)."""
        locs = obj.locs
        if type(locs) is int and obj.extra is None:  # the common case, kept lean
            seg = self.segments.get(locs >> SHIFT)
            if seg is not None:
                rec = seg.server
                at_ms = (at_ms or int(time.time() * 1000)) if put_id else 0
                flags = obj.meta & PIN
                part = Part(
                    key, obj.size, 1, 1, 0, 0, flags, 0, seg.name, locs & MASK, put_id, at_ms
                )
                rec.ops.append(part)
                self.dirty.add(rec)
            return
        if type(locs) is int:
            locs = (locs,)
        nrep = obj.meta >> 8
        nst = len(locs) // max(1, nrep) if locs else 1
        for i, loc in enumerate(locs):
            seg = self.segments.get(loc >> SHIFT) if loc >= 0 else None
            if seg is not None:
                rec = seg.server
                part = self._part(key, obj, i // nst, i % nst, seg.name, loc & MASK, put_id)
                rec.ops.append(part)
                self.dirty.add(rec)

    # -- lookups ----------------------------------------------------------------------------
    def loc(self, key: str, obj: Obj, now: float) -> Loc | None:
        """Where ``obj``'s bytes can be read now, or None (then it is gone or expired)."""
        ex = obj.extra
        if ex is not None and ex.ttl and ex.ttl <= now:
            self.counters["ttl_expired"] += 1
            self.drop(key, obj, now)
            return None
        locs = obj.locs
        segs = self.segments
        if type(locs) is int:
            seg = segs.get(locs >> SHIFT)
            if seg is not None:
                return Loc(obj.size, [[(seg.name, seg.base + (locs & MASK))]])
        elif locs:
            nrep = obj.meta >> 8
            nst = len(locs) // nrep
            stripes = []
            for s in range(nst):
                copies = []
                for r in range(nrep):
                    x = locs[r * nst + s]
                    seg = segs.get(x >> SHIFT) if x >= 0 else None
                    if seg is not None:
                        copies.append((seg.name, seg.base + (x & MASK)))
                if not copies:
                    break
                stripes.append(copies)
            else:
                return Loc(obj.size, stripes)
        if ex is not None and ex.disk is not None:
            files = []
            for cid, fid in ex.disk:
                rec = self.servers.get(cid)
                if rec is None or not rec.alive or not rec.segments or fid < 0:
                    break
                files.append((rec.endpoint, rec.segments[0].name, fid))
            else:
                return Loc(obj.size, [], files)
        if now >= self.recover_until:
            self.drop(key, obj, now)
        return None

    def get(self, keys: list[str], now: float) -> list[Loc | None]:
        objs = self.objects
        lease = now + self.cfg.read_lease_ttl
        out: list[Loc | None] = []
        hits = 0
        for key in keys:
            obj = objs.get(key)
            loc = None if obj is None else self.loc(key, obj, now)
            if loc is not None and obj is not None:
                hits += 1
                obj.lease = lease
                del objs[key]  # LRU: to the back
                objs[key] = obj
                if loc.disk is not None and obj.extra is not None and obj.extra.disk is not None:
                    self.counters["ssd_hits"] += 1
                    tier.touch(self, obj.extra.disk)
                    tier.maybe_promote(self, key, obj, now)
            out.append(loc)
        self.counters["gets"] += len(keys)
        self.counters["hits"] += hits
        return out

    def exists(self, keys: list[str], now: float) -> list[bool]:
        objs = self.objects
        out = []
        for key in keys:
            obj = objs.get(key)
            out.append(obj is not None and self.loc(key, obj, now) is not None)
        return out

    # -- puts -------------------------------------------------------------------------------
    def put_start(
        self,
        put_id: int,
        keys: list[str],
        sizes: list[int],
        nrep: int,
        ttl_ms: int,
        flags: int,
        preferred: str,
        now: float,
    ) -> tuple[list[int], list[list[list[tuple[str, int]]]]]:
        codes: list[int] = []
        out: list[list[list[tuple[str, int]]]] = []
        deadline = now + self.cfg.put_lease_ttl
        # One placement start per call, not per key: a batch lands back to back in the same
        # segments (its transfers then merge); successive calls rotate over the segments.
        self._rr = (self._rr + 1) % max(1, len(self._order))
        if nrep == 1 and not preferred:
            fresh = batch.place_fresh(self, put_id, keys, sizes, flags, ttl_ms, deadline)
            if fresh is not None:
                return fresh
        seen: set[str] = set()
        stop = time.perf_counter() + self.work_budget
        for key, size in zip(keys, sizes, strict=True):
            if key in seen:  # a key twice in one put: its first value is stored, later ones are not
                codes.append(Code.EXISTS)
                out.append([])
                continue
            seen.add(key)
            if len(seen) > 1 and time.perf_counter() > stop:
                # The rest is handed back (the client retries BUSY keys): a batch that has to
                # evict or search for each key must not hold the one master thread so long
                # that heartbeats wait past server_ttl and a live server is declared gone.
                codes.append(Code.BUSY)
                out.append([])
                continue
            obj = self.objects.get(key)
            if obj is not None and (
                self.loc(key, obj, now) is not None or self.objects.get(key) is obj
            ):
                # (an object still being re-reported exists too). This very put may have made
                # it: a put retried after its commit's answer was lost in a fail-over.
                mine = (put_id, key) in self.recent
                codes.append(Code.COMMITTED if mine else Code.EXISTS)
                out.append([])
                continue
            p = self.pending.get(key)
            if p is not None:
                if p.put_id == put_id and p.size == size:
                    codes.append(Code.OK)  # a retried request: the same allocation again
                    out.append(self._copies(p.locs, p.nrep))
                    continue
                if p.deadline > now:
                    codes.append(Code.EXISTS)
                    out.append([])
                    continue
                self._expire(key, p)
            if not self.key_room(key, now):
                self.counters["put_failures"] += 1
                codes.append(Code.NO_SPACE)
                out.append([])
                continue
            placed = self.allocate(size, nrep, preferred, now)
            if isinstance(placed, Code):
                self.counters["put_failures"] += 1
                codes.append(placed)
                out.append([])
                continue
            locs, got = placed
            self.pending[key] = Pending(put_id, size, locs, got, flags, ttl_ms, deadline)
            self.key_bytes += key_cost(key)
            codes.append(Code.OK)
            out.append(self._copies(locs, got))
        return codes, out

    def _copies(self, locs: list[int], nrep: int) -> list[list[tuple[str, int]]]:
        nst = len(locs) // nrep
        segs = self.segments
        stripes = []
        for s in range(nst):
            copies = []
            for r in range(nrep):
                x = locs[r * nst + s]
                seg = segs[x >> SHIFT]
                copies.append((seg.name, seg.base + (x & MASK)))
            stripes.append(copies)
        return stripes

    def key_room(self, key: str, now: float) -> bool:
        """Whether ``key`` fits the key budget, evicting LRU objects (bounded) to make it fit.
        A spilled victim keeps its key (its SSD copy), so it frees no key bytes."""
        over = self.key_bytes + key_cost(key) - self.cfg.key_budget
        if over <= 0:
            return True
        if self.recovering(now):
            return False
        for soft in (False, True):
            for victim in eviction.victims(self, now, soft, eviction.EVICT_SCAN):
                before = self.key_bytes
                eviction.evict(self, victim, now)
                over -= before - self.key_bytes
                if over <= 0:
                    return True
        return False

    def _expire(self, key: str, p: Pending) -> None:
        del self.pending[key]
        self.key_bytes -= key_cost(key)
        self.counters["expired_puts"] += 1
        self._release_locs(p.locs, p.size, len(p.locs) // p.nrep)

    def put_end(self, put_id: int, commit: list[str], revoke: list[str], now: float) -> list[int]:
        for key in revoke:
            p = self.pending.get(key)
            if p is not None and p.put_id == put_id:
                del self.pending[key]
                self.key_bytes -= key_cost(key)
                self._release_locs(p.locs, p.size, len(p.locs) // p.nrep)
        codes: list[int] = []
        pending = self.pending
        at_ms = int(time.time() * 1000)  # one commit time for the batch
        for key in commit:
            p = pending.get(key)
            if p is None or p.put_id != put_id:
                codes.append(Code.PUT_EXPIRED)
                continue
            del pending[key]
            self.key_bytes -= key_cost(key)
            codes.append(self._commit(key, p, now, at_ms))
        return codes

    def _commit(self, key: str, p: Pending, now: float, at_ms: int = 0) -> int:
        """Make an allocation whose bytes were written visible as ``key`` (committed at
        ``at_ms``, unix ms; 0: now)."""
        at_ms = at_ms or int(time.time() * 1000)
        nst = len(p.locs) // p.nrep
        if len(p.locs) == 1:
            live = p.locs if (p.locs[0] >> SHIFT) in self.segments else [-1]
            lost = live[0] < 0
        else:
            live = [x if (x >> SHIFT) in self.segments else -1 for x in p.locs]
            lost = any(all(live[r * nst + s] < 0 for r in range(p.nrep)) for s in range(nst))
        if key in self.objects:  # re-reported to a new leader meanwhile
            self._release_locs(live, p.size, nst)
            # ... maybe as this put's own earlier commit (on the old leader): then it is done
            return Code.OK if (p.put_id, key) in self.recent else Code.EXISTS
        if lost:
            self._release_locs(live, p.size, nst)
            return Code.UNAVAILABLE
        locs: Any = live[0] if len(live) == 1 else tuple(live)
        size = p.size
        if size > 256:  # share one int object per distinct size (most values repeat sizes)
            size = self._sizes.get(size, size)
            if len(self._sizes) < 65536:
                self._sizes.setdefault(size, size)
        obj = Obj(size, locs, p.nrep << 8 | p.flags)
        if p.ttl_ms or p.flags & SOFT:
            obj.extra = Extra(
                ttl=now + p.ttl_ms / 1000 if p.ttl_ms else 0.0,
                soft_until=now + self.cfg.soft_pin_ttl if p.flags & SOFT else 0.0,
            )
            if p.ttl_ms:
                heapq.heappush(self._ttl_heap, (obj.extra.ttl, next(self._seq), key, obj))
        self.objects[key] = obj
        self.key_bytes += key_cost(key)
        self.note_holdings(key, obj, p.put_id, at_ms)
        self.counters["puts"] += 1
        self.committed(p.put_id, key, at_ms)
        return Code.OK

    def committed(self, put_id: int, key: str, at_ms: int = 0) -> None:
        recent = self.recent
        recent[(put_id, key)] = at_ms or int(time.time() * 1000)
        if len(recent) > RECENT_COMMITS:
            recent.popitem(last=False)

    def recall(self, commits: dict[tuple[int, str], int]) -> None:
        """Merge commits re-reported by a server ((put id, key) -> unix ms) into ``recent``:
        the newest ``RECENT_COMMITS`` of them and of those already known are kept, whichever
        server reported them first. A retried commit can reach a new leader long after the
        put lease (the client's link retries until its own deadline), so age alone is no
        reason to forget one."""
        merged = dict(self.recent)
        for k, at in commits.items():
            if merged.get(k, -1) < at:
                merged[k] = at
        if len(merged) > RECENT_COMMITS:
            merged = dict(heapq.nlargest(RECENT_COMMITS, merged.items(), key=lambda kv: kv[1]))
        self.recent = collections.OrderedDict(sorted(merged.items(), key=lambda kv: kv[1]))

    # -- reservations: a client's next put of the same size, allocated one round trip early --
    def reserve(
        self, size: int, nrep: int, now: float
    ) -> tuple[int, list[list[tuple[str, int]]]] | None:
        """Allocate room for a future put (no eviction for it); None when there is none, or
        when memory is tight: a reservation cannot be evicted (its client may be writing into it
        until it expires), so reservations stay below the low watermark and a tenth of memory."""
        cap = self.capacity()
        need = aligned(size) * max(1, nrep)
        if (
            self.reserved_bytes + need > RESERVE_SHARE * cap
            or self.used() + need > self.cfg.low_watermark * cap
        ):
            return None
        self._rr = (self._rr + 1) % max(1, len(self._order))
        placed = self._place(size, nrep, "")
        if placed is None:
            return None
        locs, got = placed
        self.reserved_bytes += _held(size, got)
        rid = random.getrandbits(62) + 1
        self.reserved[rid] = Pending(rid, size, locs, got, 0, 0, now + self.cfg.put_lease_ttl)
        return rid, self._copies(locs, got)

    def commit_reserved(
        self, rid: int, key: str, size: int, flags: int, ttl_ms: int, now: float
    ) -> tuple[int, int]:
        """Commit reservation ``rid`` (whose bytes the client wrote) as ``key``: (code, nrep).
        A key that exists leaves the reservation in place for the client's next put."""
        p = self.reserved.get(rid)
        if p is None or p.size != size:
            return Code.PUT_EXPIRED, 0
        obj = self.objects.get(key)
        if key in self.pending or (
            obj is not None and (self.loc(key, obj, now) is not None or key in self.objects)
        ):
            if (rid, key) in self.recent:
                return Code.OK, p.nrep  # (defensive: a reservation commits once, then is gone)
            return Code.EXISTS, p.nrep
        if not self.key_room(key, now):
            return Code.NO_SPACE, p.nrep  # the reservation stays for the client's next put
        del self.reserved[rid]
        self.reserved_bytes -= _held(p.size, p.nrep)
        p.flags, p.ttl_ms = flags, ttl_ms
        return self._commit(key, p, now), p.nrep

    # -- removal ----------------------------------------------------------------------------
    def remove(self, keys: list[str], force: bool, now: float) -> list[int]:
        codes: list[int] = []
        for key in keys:
            obj = self.objects.get(key)
            if obj is None:
                codes.append(Code.NOT_FOUND)
                continue
            self.drop(key, obj, now, force)
            self.counters["removes"] += 1
            codes.append(Code.OK)
        return codes

    def remove_all(self, force: bool, now: float) -> int:
        """Remove every object (pins protect from eviction, not from removal)."""
        for rec in self.servers.values():
            if rec.alive:
                rec.ops.append("")  # "" is no valid key: the server forgets all it holds
                self.dirty.add(rec)
        n = 0
        for key, obj in list(self.objects.items()):
            self.drop(key, obj, now, force, notify=False)
            n += 1
        self.counters["removes"] += n
        return n

    # -- housekeeping -----------------------------------------------------------------------
    def tick(self, now: float) -> None:
        for key, p in _due(self.pending, now):
            self._expire(key, p)
        for rid, p in _due(self.reserved, now):
            del self.reserved[rid]
            self.reserved_bytes -= _held(p.size, p.nrep)
            self._release_locs(p.locs, p.size, len(p.locs) // p.nrep)
        tier.drop_late_files(self, now)
        while self._deferred and self._deferred[0][0] <= now:
            _, _, locs, size, nst = heapq.heappop(self._deferred)
            self._release_locs(locs, size, nst)
        while self._ttl_heap and self._ttl_heap[0][0] <= now:
            _, _, key, obj = heapq.heappop(self._ttl_heap)
            if self.objects.get(key) is obj:
                self.counters["ttl_expired"] += 1
                self.drop(key, obj, now)
        dead_before = now - self.cfg.server_ttl
        for rec in [r for r in self.servers.values() if r.alive and r.last_seen < dead_before]:
            self.server_lost(rec)
        if self._sweep is not None and now >= self.recover_until:
            n = 0
            for key in itertools.islice(self._sweep, 20000):
                n += 1
                found = self.objects.get(key)
                if found is not None:
                    self.loc(key, found, now)
            if n < 20000:
                self._sweep = None
        eviction.evict_to_watermark(self, now)

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = {k: float(v) for k, v in self.counters.items()}
        out.update(
            keys=len(self.objects),
            pending_puts=len(self.pending),
            reserved=len(self.reserved),
            key_bytes=self.key_bytes,
            capacity_bytes=self.capacity(),
            used_bytes=self.used(),
            segments=len(self.segments),
            servers=sum(1 for r in self.servers.values() if r.alive and r.segments),
            ssd_capacity_bytes=sum(r.ssd_size for r in self.servers.values()),
            ssd_used_bytes=sum(r.ssd_used for r in self.servers.values()),
            spilling=len(set(self.spilling.values())),
            promoting=len(set(self.promoting.values())),
            holdings_unsent=sum(len(r.ops) for r in self.servers.values()),
        )
        return out
