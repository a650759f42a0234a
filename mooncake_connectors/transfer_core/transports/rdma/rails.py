"""Rails: one RC QP per (local NIC, remote NIC) pair, the work requests posted on it, and the
poller that turns completions into slice outcomes.

A rail posts at most ``max_wr`` work requests; the rest wait in its queue. Only every
``signal_every``-th request, and the last one posted while the queue is empty, asks for a
completion: RC completes in order per QP, so a completion vouches for every request posted
before it on that QP. An error completion fails its request and breaks the rail (the QP is in
ERR): every request behind it moves to another rail, and the rail cools down.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ....errors import (
    AccessViolation,
    MooncakeConnectorsError,
    TransferTimeout,
    TransportBroken,
)
from ....types import TransferOp
from ...transport import Slice
from .verbs import Completion, GidChanged, QpAddr

if TYPE_CHECKING:
    from .direct import DirectQp
    from .mrs import LocalMr
    from .nicstate import NicState

log = logging.getLogger(__name__)
_ids = itertools.count(1)
IDLE, CONNECTING, READY = 0, 1, 2
INVALID_REQUEST_CAUSES = (
    "the peer's NIC refused a request as invalid (IBV_WC_REM_INV_REQ_ERR), which on first "
    "contact means the two ends of this rail disagree: usually the path MTU (the netdevs' MTUs "
    "differ, e.g. 9000 and 1500, and the peer does not negotiate it), else a RoCE/InfiniBand "
    "setting (link layer, GID type, partition) or a firmware limit on this port pair; the rail "
    "is left out for a while and other rails or transports carry the data"
)


class Work:
    """One attempt of one engine slice, or of adjacent slices coalesced into one range
    (``more``: the others, completed with it): done when all its work requests are."""

    __slots__ = ("done", "left", "lock", "more", "peer", "preferred", "remote_near", "slice")

    def __init__(
        self,
        s: Slice,
        n: int,
        preferred: frozenset[str],
        peer: Any,
        remote_near: frozenset[str] = frozenset(),
    ) -> None:
        self.slice = s
        self.peer = peer  # the transport's view of the peer (its rails)
        self.left = n
        self.done = False
        self.lock = threading.Lock()
        self.preferred = preferred  # local NICs nearest the local memory
        self.remote_near = remote_near  # the peer's NICs nearest the remote memory (or none)
        self.more: tuple[Slice, ...] = ()

    def finish_one(self, err: MooncakeConnectorsError | None) -> None:
        with self.lock:
            if self.done:
                return
            self.left -= 1
            if err is None and self.left:
                return
            self.done = True
        self.slice.complete(err)
        for s in self.more:
            s.complete(err)


@dataclasses.dataclass(slots=True, eq=False)
class WR:
    """One RDMA READ or WRITE of at most the rdma slice size, or (``part`` > 0, the compiled
    path) a run of ``parts`` of them, ``part`` bytes each, posted as one chain."""

    work: Work
    laddr: int
    raddr: int
    length: int
    mr: LocalMr
    rkeys: dict[str, int]
    shift: dict[str, int]  # remote NIC -> what to add to raddr (a dma-buf MR's iova)
    tried: set[int] = dataclasses.field(default_factory=set)  # rails it was posted on (ids)
    wr_id: int = 0
    posted_at: float = 0.0
    part: int = 0  # bytes per WR of a run; 0: one WR of ``length``
    parts: int = 1  # WRs (send queue and CQ slots) it takes

    def end(self, err: MooncakeConnectorsError | None) -> None:
        self.mr.release()
        self.work.finish_one(err)


class Rail:
    """A (local NIC, remote NIC) pair to one peer, with its QP (made on first use)."""

    def __init__(
        self,
        owner: RailOwner,
        peer: str,
        nic: NicState,
        remote_nic: str,
        initial_bw: float,
    ) -> None:
        self.owner = owner
        self.peer = peer
        self.nic = nic
        self.remote_nic = remote_nic
        self.id = next(_ids)
        self.key = (peer, f"rdma {nic.nic.name}>{remote_nic}", 0)
        self.path = f"rdma {nic.nic.name}>{peer}/{remote_nic}"
        self.lock = threading.Lock()
        self.state = IDLE
        self.qp: Any = None
        self.qpn = -1
        self.outstanding: collections.deque[WR] = collections.deque()
        self.held = 0  # send queue slots of the outstanding requests (a run takes its parts)
        self.queue: collections.deque[WR] = collections.deque()
        self.queued_bytes = 0  # posted or waiting
        self.bw = initial_bw  # bytes/s, measured
        self.measured = False
        self.busy_since = 0.0
        self.posts = 0
        self.carried = 0  # WRs completed on this rail (for tests and stats)
        self.direct: DirectQp | None = None  # its direct QP (direct.py), made on first need
        self.direct_carried = 0  # WRs completed on the direct QP
        self.closed = False
        self.gen = 0  # bumped when the rail breaks: a connect begun before it is stale

    # -- scheduling -------------------------------------------------------------------------
    def predicted(self, length: int) -> float:
        """Seconds until ``length`` more bytes would be through, at the measured rate."""
        return (self.queued_bytes + length) / self.bw

    def enqueue(self, wrs: list[WR]) -> None:
        with self.lock:
            for wr in wrs:
                wr.tried.add(self.id)
                self.queue.append(wr)
                self.queued_bytes += wr.length
            if self.state == READY:
                failed = self._pump()
            elif self.state == IDLE:
                self.state = CONNECTING
                threading.Thread(target=self._connect, name="mc-rdma-connect", daemon=True).start()
                return
            else:
                return
        if failed is not None:
            self.broke(failed, cool=True)

    def _pump(self) -> MooncakeConnectorsError | None:
        # caller holds self.lock
        o = self.owner
        nic = self.nic.nic
        name, remote = nic.name, self.remote_nic
        limit = min(o.max_wr, nic.max_qp_wr)
        batch: list[tuple[bool, tuple[int, ...]]] = []
        now = time.monotonic()
        queue = self.queue
        while queue and self.held + queue[0].parts <= limit and self.nic.take(queue[0].parts):
            wr = queue.popleft()
            p = wr.parts
            before = self.posts
            self.posts += p
            self.held += p
            # The last request posted for now asks for a completion, or nothing would free its
            # slots: the queue is empty, the next does not fit the QP or the CQ's free slots.
            signaled = (
                self.posts // o.signal_every != before // o.signal_every
                or not queue
                or self.held + queue[0].parts > limit
                or self.nic.credits < queue[0].parts
            )
            wr.wr_id = next(_ids)
            wr.posted_at = now
            if not self.outstanding:
                self.busy_since = now
            self.outstanding.append(wr)
            batch.append(
                (
                    wr.work.slice.op is TransferOp.WRITE,
                    (
                        wr.wr_id,
                        wr.mr.local_addr(name, wr.laddr),
                        wr.mr.lkey(name),
                        wr.raddr + wr.shift.get(remote, 0),
                        wr.rkeys[remote],
                        wr.length,
                        wr.part or max(wr.length, 1),
                        signaled,
                    ),
                )
            )
        if not batch:
            return None
        # one chain (one doorbell on the compiled path) per run of requests of the same op
        i = 0
        while i < len(batch):
            write = batch[i][0]
            j = i
            while j < len(batch) and batch[j][0] is write:
                j += 1
            runs = [r for _, r in batch[i:j]]
            try:
                n = nic.post_runs(self.qp, write, runs)
            except MooncakeConnectorsError as exc:
                return exc  # broke() gives its slots back with the other outstanding ones
            if n < len(runs):
                return TransportBroken(f"post_send on {name} refused a work request")
            i = j
        self.nic.wake.set()
        return None

    def kick(self) -> None:
        """Post what waits in the queue (CQ slots came free on this NIC)."""
        with self.lock:
            failed = self._pump() if self.state == READY else None
        if failed is not None:
            self.broke(failed, cool=True)

    # -- connection -------------------------------------------------------------------------
    def _connect(self) -> None:
        nic = self.nic.nic
        gen = self.gen
        qp: Any = None
        try:
            for again in (True, False):
                qp = nic.create_qp(self.owner.max_wr)
                psn = int.from_bytes(os.urandom(3), "little")
                gid = nic.gid
                theirs = self.owner.exchange(
                    self, QpAddr(int(qp.qp_num), psn, gid, nic.lid, nic.mtu)
                )
                try:
                    nic.connect(qp, theirs, psn, sent_gid=gid)
                    break
                except GidChanged as exc:
                    if not again:
                        raise
                    log.info("rdma rail %s connects again: %s", self.path, exc)
                    nic.destroy(qp)
                    qp = None  # the peer's QP for the old GID is replaced by the next exchange
        except Exception as exc:  # whatever it is, the rail must fail, never stay CONNECTING
            if isinstance(exc, MooncakeConnectorsError):
                err: MooncakeConnectorsError = exc
            else:
                log.exception("rdma rail %s: unexpected error while connecting", self.path)
                err = TransportBroken(f"connecting failed: {type(exc).__name__}: {exc}")
            if qp is not None:
                nic.destroy(qp)
            log.info("rdma rail %s cannot connect: %s", self.path, err)
            if gen == self.gen:
                self.broke(err, cool=True)
            return
        with self.lock:
            if self.closed or gen != self.gen:
                nic.destroy(qp)
                return
            self.qp, self.qpn, self.state = qp, int(qp.qp_num), READY
            self.nic.rails[self.qpn] = self
            failed = self._pump()
        if failed is not None:
            self.broke(failed, cool=True)

    # -- completions ------------------------------------------------------------------------
    def completed(self, comps: list[Completion]) -> None:
        ok: list[WR] = []
        bad: WR | None = None
        status = 0
        now = time.monotonic()
        with self.lock:
            for c in comps:
                if bad is not None:
                    break
                if not self.outstanding or c.wr_id < self.outstanding[0].wr_id:
                    continue  # already vouched for by a later completion another thread took
                while self.outstanding:
                    wr = self.outstanding.popleft()
                    self.queued_bytes -= wr.length
                    self.held -= wr.parts
                    if wr.wr_id != c.wr_id:
                        ok.append(wr)
                        continue
                    if c.ok:
                        ok.append(wr)
                    else:
                        bad, status = wr, c.status
                    break
            moved = sum(w.length for w in ok)
            if moved and now > self.busy_since:
                # One sample per batch of completions: bytes over the time the rail was busy.
                sample = moved / (now - self.busy_since)
                # The first measurement replaces the guess the rail started with.
                self.bw = sample if not self.measured else 0.7 * self.bw + 0.3 * sample
                self.measured = True
                self.busy_since = now
            self.carried += sum(w.parts for w in ok)  # WRs, a run counting its parts
            freed = sum(w.parts for w in ok) + (bad.parts if bad is not None else 0)
            self.nic.give(freed, kick=False)  # this rail posts again just below, others after
            failed = self._pump() if bad is None and self.state == READY else None
        if freed:
            self._kick_others()
        for wr in ok:
            wr.end(None)
        if ok:
            self.owner.rail_ok(self)
        if failed is not None:
            self.broke(failed, cool=True)
        if bad is None:
            return
        if status in self.nic.nic.verbs.ACCESS_ERRORS:
            # The peer's NIC refused the rkey or the bounds: final for this request. The QP is
            # in ERR, so the rail reconnects, but it is not at fault and does not cool down.
            bad.end(
                AccessViolation(
                    f"the peer's NIC refused access (completion status {status})",
                    peer=self.peer,
                    path=self.path,
                )
            )
            self.broke(TransportBroken("QP left in ERR by an access error"), cool=False)
            return
        why = f"completion status {status}"
        if status == self.nic.nic.verbs.INVALID_REQUEST:
            why = f"{INVALID_REQUEST_CAUSES} (completion status {status})"
            log.warning("rdma rail %s: %s", self.path, why)
        err = TransportBroken(why, peer=self.peer, path=self.path)
        self.broke(err, cool=True, first=bad)

    def _kick_others(self) -> None:
        for rail in list(self.nic.rails.values()):
            if rail is not self and rail.queue:
                rail.kick()

    def check_timeout(self, now: float) -> None:
        with self.lock:
            late = bool(self.outstanding) and now - self.outstanding[0].posted_at > (
                self.owner.rail_timeout
            )
        if late:
            self.broke(
                TransportBroken(
                    f"no completion within {self.owner.rail_timeout}s",
                    peer=self.peer,
                    path=self.path,
                ),
                cool=True,
            )

    # -- failure ----------------------------------------------------------------------------
    def broke(self, err: MooncakeConnectorsError, *, cool: bool, first: WR | None = None) -> None:
        """Take the QP down (ERR, so no late bytes land), and move every request it held."""
        with self.lock:
            qp, self.qp = self.qp, None
            self.gen += 1
            self.nic.rails.pop(self.qpn, None)
            self.qpn = -1
            self.state = IDLE
            held = self.held  # ``first`` gave its slots back in completed()
            self.held = 0
            orphans = ([first] if first is not None else []) + list(self.outstanding)
            orphans += list(self.queue)
            self.outstanding.clear()
            self.queue.clear()
            self.queued_bytes = 0
        if qp is not None:
            self.nic.nic.to_error(qp)
            self.nic.nic.destroy(qp)  # its CQEs leave the CQ with it: their slots are free
        self.nic.give(held)
        if cool:
            self.owner.rail_failed(self, err)
        for wr in orphans:
            self.owner.reroute(wr, err)

    def close(self, err: MooncakeConnectorsError) -> None:
        with self.lock:
            self.closed = True
        if self.direct is not None:
            self.direct.close()
        self.broke(err, cool=False)


class RailOwner:
    """What a rail needs from the transport (kept small so rails are testable alone)."""

    max_wr: int
    signal_every: int
    rail_timeout: float
    exchange: Callable[..., QpAddr]  # (rail, our QP's address, direct=False)

    def rail_ok(self, rail: Rail) -> None:
        raise NotImplementedError

    def rail_failed(self, rail: Rail, err: MooncakeConnectorsError) -> None:
        raise NotImplementedError

    def reroute(self, wr: WR, err: MooncakeConnectorsError) -> None:
        raise NotImplementedError


def too_late(wr: WR) -> TransferTimeout | None:
    if time.monotonic() >= wr.work.slice.deadline:
        return TransferTimeout("the request's deadline passed on rdma", peer=None)
    return None
