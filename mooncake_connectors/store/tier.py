"""The SSD tier, master side: spilling evicted objects to the servers' SSDs stripe by stripe,
keeping every SSD within its budget (least recently read files go first) and promoting objects
read from SSD back into memory.

Each stripe is spilled by a server that holds a copy of it in memory, to that server's own SSD,
rather than gathered on one server: no byte crosses the network to spill, the stripes of one
object are written (and later loaded) by all its servers in parallel, SSD capacity adds up over
the servers, and a file is never larger than one stripe, so it fits the bounce buffer it is
served through. The price is that a striped object on SSD needs each of its servers alive, as it
did in memory. A promotion is a spill backwards: each server reads its stripe's file into memory
the master allocated in that server's own segment, checks its checksum, and reports; only when
every stripe is back does the object switch to its memory copy.

A spill or promotion of one object is a :class:`Job` over its stripes' files; it completes when
every file reported. A failed spill drops the object (the other outcome of an eviction); a failed
promotion frees its memory and leaves the object on SSD.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from .allocator import aligned
from .protocol import SSD_HEADER, stripe_bounds
from .records import MASK, PROMOTING, SHIFT, SPILLING, Extra, Obj, Server, key_cost, pack

if TYPE_CHECKING:
    from .state import MasterState

NO_FILE = ("", -1)  # a stripe whose disk copy was not re-reported (yet)


class Job:
    """One object's spill or promotion: a file per stripe, done when every file reported."""

    __slots__ = ("failed", "files", "key", "locs", "nbytes", "obj", "pending")

    def __init__(self, key: str, obj: Obj, nbytes: int) -> None:
        self.key = key
        self.obj = obj
        self.nbytes = nbytes  # memory the spill frees (eviction counts it as freed already)
        self.files: list[tuple[Server, int, int]] = []  # per stripe: server, file id, SSD bytes
        self.locs: list[int] = []  # a promotion's memory, per stripe
        self.pending = 0
        self.failed = False


def ssd_bytes(length: int) -> int:
    """What a stripe of ``length`` bytes counts against a server's SSD budget."""
    return aligned(length) + SSD_HEADER


# -- spilling -------------------------------------------------------------------------------
def start_spill(st: MasterState, key: str, obj: Obj, mem_bytes: int) -> bool:
    """Spill every stripe of ``obj`` to the SSD of a server holding a copy; False when some
    stripe has no server with an SSD that can take it (then the object is dropped)."""
    locs = obj.locs
    copies = (locs,) if type(locs) is int else locs
    nrep = obj.meta >> 8
    if not copies or not nrep:
        return False
    nst = len(copies) // nrep
    bounds = stripe_bounds(obj.size, nst)
    planned: dict[Server, int] = {}
    plan: list[tuple[Server, int, int, int]] = []  # server, address, length, SSD bytes
    for s in range(nst):
        need = ssd_bytes(bounds[s][1])
        for r in range(nrep):
            loc = copies[r * nst + s]
            seg = st.segments.get(loc >> SHIFT) if loc >= 0 else None
            if seg is None or not seg.server.ssd_size:
                continue
            rec = seg.server
            more = planned.get(rec, 0) + need
            if more > rec.ssd_size:
                continue
            while rec.ssd_used + more > rec.ssd_size and rec.disk:
                fid = next(iter(rec.disk))  # the least recently read file on this SSD
                drop_file_owner(st, rec, fid)
            if rec.ssd_used + more > rec.ssd_size:
                continue  # the rest of its budget is in spills still being written
            planned[rec] = more
            plan.append((rec, seg.base + (loc & MASK), bounds[s][1], need))
            break
        else:
            return False
    job = Job(key, obj, mem_bytes)
    for rec, addr, length, need in plan:
        fid = next(st._file_ids)
        rec.ssd_used += need
        rec.spills.append((fid, addr, length))
        st.dirty.add(rec)
        st.spilling[fid] = job
        job.files.append((rec, fid, need))
    job.pending = len(plan)
    obj.meta |= SPILLING
    st.counters["spills"] += 1
    return True


def _job_after_report(jobs: dict[int, Job], client_id: str, fid: int, ok: bool) -> Job | None:
    """Count a server's report on one file of a job: the job once its last file is reported,
    else None."""
    job = jobs.get(fid)
    if job is None or not any(r.client_id == client_id and f == fid for r, f, _ in job.files):
        return None  # not a file this server was asked about (a stale or foreign report)
    del jobs[fid]
    job.failed |= not ok
    job.pending -= 1
    return job if job.pending <= 0 else None


def file_done(
    st: MasterState, client_id: str, fid: int, ok: bool, now: float, *, spill: bool
) -> None:
    """A server's report on one file of a spill (``spill``) or a promotion; the job finishes
    once its last file is reported."""
    jobs, finish = (st.spilling, _finish_spill) if spill else (st.promoting, _finish_promote)
    job = _job_after_report(jobs, client_id, fid, ok)
    if job is not None:
        finish(st, job, now)


def _finish_spill(st: MasterState, job: Job, now: float) -> None:
    key, obj = job.key, job.obj
    obj.meta &= ~SPILLING
    current = st.objects.get(key) is obj
    if job.failed or not current:
        for rec, fid, need in job.files:
            rec.ssd_used -= need
            rec.dropfiles.append(fid)
            st.dirty.add(rec)
        if current:
            st.counters["spill_failures"] += 1
            st.drop(key, obj, now)
        return
    st._free_memory(key, obj, now)  # tells the memory holders they no longer hold it
    ex = obj.extra or Extra()
    ex.disk = tuple((rec.client_id, fid) for rec, fid, _ in job.files)
    ex.ssd_hits = 0
    obj.extra = ex
    obj.locs = ()
    obj.meta = (obj.meta & 0xFF) | 1 << 8  # one copy of each stripe now
    for s, (rec, fid, need) in enumerate(job.files):
        rec.disk[fid] = (key, need)
        rec.ops.append(st._part(key, obj, 0, s, "", fid))
        st.dirty.add(rec)


def abandon(st: MasterState, lost: Server, now: float) -> None:
    """``lost`` died: its unfinished spills and promotions fail."""
    for table, finish in ((st.spilling, _finish_spill), (st.promoting, _finish_promote)):
        for fid, job in list(table.items()):
            if any(rec is lost and f == fid for rec, f, _ in job.files):
                del table[fid]
                job.failed = True
                job.pending -= 1
                if job.pending <= 0:
                    finish(st, job, now)


# -- dropping disk copies -------------------------------------------------------------------
def release_disk(
    st: MasterState, key: str, disk: tuple[tuple[str, int], ...], notify: bool
) -> None:
    """Delete an object's SSD files (the caller forgets them in the object)."""
    for cid, fid in disk:
        rec = st.servers.get(cid) if fid >= 0 else None
        if rec is None:
            continue
        entry = rec.disk.pop(fid, None)
        if entry is not None:
            rec.ssd_used -= entry[1]
        rec.dropfiles.append(fid)
        if notify:
            rec.ops.append(key)
        st.dirty.add(rec)


def drop_file_owner(st: MasterState, rec: Server, fid: int, counter: str = "ssd_drops") -> None:
    """Drop the object owning file ``fid`` on ``rec``'s SSD from SSD (all stripes: without one
    of them the others are useless): to make room, or because the file is damaged."""
    key = rec.disk[fid][0]
    st.counters[counter] += 1
    obj = st.objects.get(key)
    ex = obj.extra if obj is not None else None
    if obj is None or ex is None or ex.disk is None or (rec.client_id, fid) not in ex.disk:
        entry = rec.disk.pop(fid)  # no object claims it (cannot happen; never leak budget)
        rec.ssd_used -= entry[1]
        rec.dropfiles.append(fid)
        st.dirty.add(rec)
        return
    release_disk(st, key, ex.disk, notify=True)
    ex.disk = None
    if not obj.locs:
        del st.objects[key]
        st.key_bytes -= key_cost(key)


def touch(st: MasterState, disk: tuple[tuple[str, int], ...]) -> None:
    """An SSD hit: its files become the most recently read on their SSDs."""
    for cid, fid in disk:
        rec = st.servers.get(cid)
        if rec is not None:
            entry = rec.disk.pop(fid, None)
            if entry is not None:
                rec.disk[fid] = entry


# -- promotion ------------------------------------------------------------------------------
def maybe_promote(st: MasterState, key: str, obj: Obj, now: float) -> bool:
    """After an SSD hit: bring the object back into memory if it is hot enough and there is
    room below the high watermark (a promotion never evicts)."""
    ex = obj.extra
    hits = st.cfg.promote_hits
    if not hits or ex is None or ex.disk is None or obj.meta & (PROMOTING | SPILLING):
        return False
    ex.ssd_hits += 1
    if ex.ssd_hits < hits or st.recovering(now):
        return False
    nst = len(ex.disk)
    bounds = stripe_bounds(obj.size, nst)
    cap = st.capacity()
    if not cap or st.used() + sum(aligned(n) for _, n in bounds) > st.cfg.high_watermark * cap:
        return False
    locs: list[int] = []
    for s, (cid, _) in enumerate(ex.disk):
        rec = st.servers.get(cid)
        off = None
        for seg in rec.segments if rec is not None else ():
            if seg.alloc is not None and seg in st._order:
                off = seg.alloc.alloc(bounds[s][1])
                if off is not None:
                    locs.append(pack(seg.id, off))
                    break
        if off is None:
            st._release_locs(locs, obj.size, nst)
            return False
    job = Job(key, obj, 0)
    job.locs = locs
    for s, (cid, fid) in enumerate(ex.disk):
        rec = st.servers[cid]
        seg = st.segments[locs[s] >> SHIFT]
        rec.promotes.append((fid, seg.base + (locs[s] & MASK), bounds[s][1]))
        st.dirty.add(rec)
        st.promoting[fid] = job
        job.files.append((rec, fid, 0))
    job.pending = nst
    obj.meta |= PROMOTING
    return True


def _finish_promote(st: MasterState, job: Job, now: float) -> None:
    key, obj = job.key, job.obj
    obj.meta &= ~PROMOTING
    ex = obj.extra
    disk = tuple((rec.client_id, fid) for rec, fid, _ in job.files)
    if (
        job.failed
        or st.objects.get(key) is not obj
        or ex is None
        or ex.disk != disk
        or obj.locs != ()
    ):
        st._release_locs(job.locs, obj.size, len(job.locs))
        st.counters["promotion_failures"] += 1
        return
    for cid, fid in disk:  # the files go once no reader can still be loading them
        rec = st.servers.get(cid)
        if rec is None:
            continue
        entry = rec.disk.pop(fid, None)
        rec.ops.append(key)
        st.dirty.add(rec)
        if entry is not None:
            heapq.heappush(st._late_files, (obj.lease, next(st._seq), rec, fid, entry[1]))
    ex.disk = None
    ex.ssd_hits = 0
    obj.locs = job.locs[0] if len(job.locs) == 1 else tuple(job.locs)
    obj.meta = (obj.meta & 0xFF) | 1 << 8
    st.note_holdings(key, obj)
    st.counters["promotions"] += 1


def drop_late_files(st: MasterState, now: float) -> None:
    late = st._late_files
    while late and late[0][0] <= now:
        _, _, rec, fid, need = heapq.heappop(late)
        rec.ssd_used -= need
        rec.dropfiles.append(fid)
        st.dirty.add(rec)
