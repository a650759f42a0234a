"""The rdma transport's direct QPs: a request or a batch posted and waited for in one compiled
call (``run_one`` / ``run_inline``; ``submit`` with ``inline_ok``; an asynchronous ``submit``
from the direct thread).

A rail's QP shares its NIC's CQ with every other rail there, so its work requests are tracked one
by one in Python (rails.py) and completed by the NIC's poller thread or an inline waiter. A
request whose caller waits anyway (``engine.transfer`` of one request up to the engine's slice
size) needs none of that. Each rail gets a *direct QP*: a second RC QP on the same pair of NICs,
with a CQ of its own, used by one caller at a time. The request is cut into one chain per direct
QP used (the rails' spreading: at least one run of ``slice_size`` WRs per rail), posted and
waited for in one compiled call (``_rdma_fast.run_wait``): the last WR of each chain asks for a
completion, RC completes in order, so one completion per chain vouches for all of it. No Slice,
no WR objects, no poller, no lock per WR. A batch (``run_slices``) is coalesced, cut and spread
in C and posted in waves of at most ``max_wr`` WRs per QP (``_rdma_fast.run_blocks``); an
asynchronous one is run so by the transport's direct thread, one at a time (``offer``: while it
is busy, batches take the rails).

Only on the compiled data path (``_rdma_fast`` built, ``MOONCAKE_CONNECTORS_PURE_PYTHON`` unset)
and with the ``direct_qps`` setting on (default). A direct QP is connected on first need, in the
background (the connect exchange with ``direct`` set; the peer keeps it apart from the rail's
QP); until then, while busy with another caller, or while its rail cools down or its NIC is
down, requests take the rails. A failed run takes down every direct QP it used (QP to ERR, then
destroyed: no late bytes), cools the rail down as the rails' failures do (not for an access
error) and is reported to the engine as a first attempt's failure: it retries on the rails or
the next transport within the request's deadline. A peer of an older version refuses the
``direct`` field: its direct QPs stay off (retried after ``_RETRY_MAX``).
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ....errors import AccessViolation, MooncakeConnectorsError, TransferTimeout, TransportBroken
from ....types import TransferOp
from ..fast import spin_us
from .rails import INVALID_REQUEST_CAUSES
from .verbs import GidChanged, QpAddr

if TYPE_CHECKING:
    from ...descriptor import RegionDesc
    from ...transport import Slice
    from .mrs import LocalMr
    from .rails import Rail
    from .transport import RdmaTransport, _Peer

log = logging.getLogger(__name__)
IDLE, CONNECTING, READY = 0, 1, 2
_RETRY_FIRST, _RETRY_MAX = 1.0, 60.0  # seconds before connecting a failed direct QP again


class DirectQp:
    """A rail's direct QP (see the module's docstring): one caller at a time (``lock``)."""

    __slots__ = ("closing", "gen", "lock", "qp", "rail", "retry_at", "retry_in", "state")

    def __init__(self, rail: Rail) -> None:
        self.rail = rail
        self.lock = threading.Lock()
        self.state = IDLE
        self.qp: Any = None
        self.closing = False
        self.gen = 0
        self.retry_at = 0.0
        self.retry_in = _RETRY_FIRST

    def connect_soon(self, owner: RdmaTransport) -> None:
        """Connect in the background, unless connecting already or cooling after a failure."""
        if self.state != IDLE or self.closing or time.monotonic() < self.retry_at:
            return
        if not self.lock.acquire(blocking=False):  # (another caller is deciding it)
            return
        try:
            if self.state != IDLE or self.closing:
                return
            self.state = CONNECTING
        finally:
            self.lock.release()
        threading.Thread(
            target=self._connect, args=(owner,), name="mc-rdma-direct-connect", daemon=True
        ).start()

    def _connect(self, owner: RdmaTransport) -> None:
        rail = self.rail
        nic = rail.nic.nic
        gen = self.gen
        qp: Any = None
        try:
            for again in (True, False):
                qp = nic.create_qp(owner.max_wr, own_cq=True)  # type: ignore[call-arg]
                psn = int.from_bytes(os.urandom(3), "little")
                gid = nic.gid
                ours = QpAddr(int(qp.qp_num), psn, gid, nic.lid, nic.mtu)
                theirs = owner.exchange(rail, ours, direct=True)
                try:
                    nic.connect(qp, theirs, psn, sent_gid=gid)
                    break
                except GidChanged:
                    if not again:
                        raise
                    nic.destroy(qp)
                    qp = None
        except Exception as exc:  # whatever it is, the direct QP must not stay CONNECTING
            if qp is not None:
                nic.destroy(qp)
            with self.lock:
                self.state = IDLE
                self.retry_at = time.monotonic() + self.retry_in
                wait, self.retry_in = self.retry_in, min(_RETRY_MAX, self.retry_in * 2)
            if not self.closing:  # (closing: the transport went away while connecting)
                log.info("rdma direct QP %s not connected (again in %.0fs): %s", rail.path,
                         wait, exc)  # fmt: skip
            return
        with self.lock:
            if self.closing or gen != self.gen:
                nic.destroy(qp)
                return
            self.qp, self.state, self.retry_in = qp, READY, _RETRY_FIRST

    def take_down(self) -> None:
        """After a failed run (caller holds ``lock``): ERR, destroyed; connected again later."""
        qp, self.qp = self.qp, None
        self.gen += 1
        self.state = IDLE
        self.retry_at = time.monotonic() + _RETRY_FIRST
        if qp is not None:
            nic = self.rail.nic.nic
            nic.to_error(qp)
            nic.destroy(qp)

    def close(self) -> None:
        """Destroy the QP now, or (a caller is running on it) when that caller is done. Never
        waits: a run is bounded by its deadline and checks ``closing`` before it lets go."""
        self.closing = True
        if self.lock.acquire(blocking=False):
            try:
                self.take_down()
            finally:
                self.lock.release()


# a direct QP a run may use, with (lkey, local offset, rkey, remote offset) for its NIC pair
_Choice = tuple[DirectQp, int, int, int, int]


class _Remote:
    """The peer's region a run falls in, as the direct way needs it."""

    __slots__ = ("hi", "lo", "near", "region", "rkeys", "shift")

    def __init__(self, region: RegionDesc) -> None:
        self.region = region
        self.lo, self.hi = region.addr, region.addr + region.length
        self.rkeys = region.rdma_rkeys
        self.shift = {n: base - region.addr for n, base in region.rdma_iova.items()}
        self.near = frozenset(region.rdma_near)


class _Local:
    """The local registration a run falls in: its MRs and the NICs nearest its memory."""

    __slots__ = ("epoch", "hi", "lo", "mr", "near")

    def __init__(self, epoch: int, lo: int, hi: int, mr: LocalMr, near: frozenset[str]) -> None:
        self.epoch, self.lo, self.hi, self.mr, self.near = epoch, lo, hi, mr, near


class Direct:
    """The transport's direct way (see the module's docstring)."""

    def __init__(self, owner: RdmaTransport, fast: Any) -> None:
        self.owner = owner
        self.fast = fast
        # asynchronous batches: run from a thread of ours, one at a time (``offer``)
        self._idle = threading.Lock()  # held while a batch is queued or running
        self._jobs: queue.SimpleQueue[tuple[_Peer, Sequence[Slice]] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.spin = spin_us() * 1e-6
        self.size = owner.settings.slice_size
        self._local: _Local | None = None
        self._rr = 0
        ws = [st.nic for st in owner.nics.values()]
        self.max_parts = min([owner.max_wr, *(n.max_qp_wr for n in ws)])

    def local_changed(self) -> None:
        self._local = None

    def finish(self, slices: Sequence[Slice], got: MooncakeConnectorsError | bool) -> bool:
        """Report a direct run's outcome to every slice; False (nothing reported) when the
        run did not take them."""
        if got is False:
            return False
        err = None if got is True else got
        for s in slices:
            s.path = "rdma"
            s.complete(err)
        return True

    def offer(self, p: _Peer, slices: Sequence[Slice]) -> bool:
        """An asynchronous batch (``submit`` without ``inline_ok``): run on the direct QPs by
        this transport's direct thread, which posts, waits and reports it. False, taking
        nothing, while that thread has a batch already (this one goes on the rails)."""
        first = slices[0]
        if first.local_device >= 0 or first.region is None:  # (the rails' without a hop)
            return False
        if self._closed or not self._idle.acquire(blocking=False):
            return False
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="mc-rdma-direct", daemon=True)
            self._thread.start()
        self._jobs.put((p, slices))
        return True

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            p, slices = job
            try:
                if not self.finish(slices, self.run_slices(p, slices)):
                    self.owner._rails(p, slices)
            except Exception as exc:  # a slice must never be left without an outcome
                log.exception("rdma direct thread: unexpected error")
                self.finish(slices, TransportBroken(f"direct QPs: {type(exc).__name__}: {exc}"))
            finally:
                self._idle.release()

    def close(self) -> None:
        """Stop the direct thread after its batch, if any (never waited for here: a batch is
        bounded by its deadline, and the transport's close waits for its QPs)."""
        self._closed = True
        self._jobs.put(None)

    def _local_for(self, addr: int, n: int) -> _Local | None:
        o = self.owner
        epoch = o.ctx.local.epoch
        lc = self._local
        if lc is not None and lc.epoch == epoch and lc.lo <= addr and addr + n <= lc.hi:
            return lc
        region = o.ctx.local.find(addr, n)
        if region is None or o.registry is None or region.device >= 0:
            return None
        mr = o.registry.get(region)
        near = frozenset(o.topology.preferred(mr.where(), list(o.nics)))
        lc = self._local = _Local(epoch, region.addr, region.addr + region.length, mr, near)
        return lc

    def _choices(self, p: _Peer, rm: _Remote, lc: _Local) -> list[_Choice]:
        """The direct QPs a run of ``rm`` and ``lc`` may use, in the rails' order of preference,
        each with (lkey, local offset, rkey, remote offset): cached on the peer."""
        got = p.direct_pick
        if got is not None and got[0] is rm and got[1] is lc:
            return got[2]  # type: ignore[no-any-return]
        rails = [r for r in p.rails if r.remote_nic in rm.rkeys]
        near = [r for r in rails if r.nic.nic.name in lc.near]
        pool = near or rails
        if rm.near:
            pool = [r for r in pool if r.remote_nic in rm.near] or pool
        out: list[_Choice] = []
        mr = lc.mr
        for r in pool:
            name = r.nic.nic.name
            if r.direct is None:
                r.direct = DirectQp(r)
            loff = mr.local_addr(name, 0)  # (0 unless a dma-buf MR's iova)
            out.append((r.direct, mr.lkey(name), loff, rm.rkeys[r.remote_nic],
                        rm.shift.get(r.remote_nic, 0)))  # fmt: skip
        p.direct_pick = (rm, lc, out)
        return out

    def run(
        self,
        p: _Peer,
        op: TransferOp,
        remote: int,
        local: int,
        n: int,
        deadline: float,
        region: RegionDesc | None = None,
    ) -> MooncakeConnectorsError | bool:
        """Move one host-memory request on direct QPs from this thread: True when done, the
        error of the attempt, or False, having done nothing, when the rails must take it."""
        rm = p.direct_remote
        if rm is None or not (rm.lo <= remote and remote + n <= rm.hi):
            rd = region if region is not None else p.desc.find_region(remote, n)
            if rd is None or not rd.rdma_rkeys:
                return False
            rm = p.direct_remote = _Remote(rd)
        lc = self._local_for(local, n)
        if lc is None:
            return False
        choices = self._choices(p, rm, lc)
        if not choices:
            return False
        size = self.size
        # per QP: whole WRs, at least one (-(-a // b): a / b rounded up)
        per = -(-n // len(choices))
        share = max(size, -(-per // size) * size)
        held = self._take(choices, -(-n // share))
        if not held:
            return False
        if len(held) * share < n:
            per = -(-n // len(held))
            share = -(-per // size) * size
        if share // size > self.max_parts:
            for c in held:
                c[0].lock.release()
            return False
        used = held[: -(-n // share)]
        for c in held[len(used) :]:
            c[0].lock.release()
        plan = []
        for i, (d, lkey, loff, rkey, roff) in enumerate(used):
            o_ = i * share
            plan.append((d.qp, local + o_ + loff, lkey, remote + o_ + roff, rkey,
                         min(share, n - o_), size))  # fmt: skip
        mr = lc.mr
        mr.acquire(len(used))
        limit = min(deadline, time.monotonic() + self.owner.rail_timeout)
        try:
            rc, which = self.fast.run_wait(op is TransferOp.WRITE, plan, limit, self.spin)
        except (OSError, ValueError) as exc:
            rc, which = -(getattr(exc, "errno", None) or errno.EINVAL), 0
        err = None if rc == 0 else self._error(rc, used[which][0].rail, deadline)
        if err is None:
            for c, chain in zip(used, plan, strict=True):
                c[0].rail.direct_carried += -(-chain[5] // size)
        self._let_go(used, mr, err)
        return True if err is None else err

    def run_slices(self, p: _Peer, slices: Sequence[Slice]) -> MooncakeConnectorsError | bool:
        """A batch whose caller waits for it (``submit(..., inline_ok=True)``: the engine's
        ``run``, e.g. a PD decode's KV load), of one op, in one local registration of host
        memory and one region of the peer: coalesced, cut and spread over the direct QPs in one
        compiled call. True when every slice is done, the attempt's error (for every slice),
        or False, having done nothing, when the rails must take it."""
        o = self.owner
        first = slices[0]
        region = first.region
        if region is None or not region.rdma_rkeys or any(s.local_device >= 0 for s in slices):
            return False
        rm = p.direct_remote
        if rm is None or (rm.region is not region and rm.region != region):
            rm = p.direct_remote = _Remote(region)
        if len(slices) == 1:
            lo, hi = first.local_addr, first.local_addr + first.length
        else:
            lo = min(s.local_addr for s in slices)
            hi = max(s.local_addr + s.length for s in slices)
        lc = self._local_for(lo, hi - lo)
        if lc is None:
            return False
        choices = self._choices(p, rm, lc)
        held = self._take(choices, min(len(choices), _up(hi - lo, self.size)))
        if not held:
            return False
        mr = lc.mr
        lanes = [(d.qp, lkey, loff, rkey, roff) for d, lkey, loff, rkey, roff in held]
        deadline = min(s.deadline for s in slices)
        limit = min(deadline, time.monotonic() + o.rail_timeout * max(1, len(slices) // 4096))
        mr.acquire(len(held))
        try:
            rc, which, wrs = self.fast.run_blocks(
                first.op is TransferOp.WRITE, slices, first.op, lanes, lc.lo, lc.hi,
                rm.lo, rm.hi, self.size, limit, self.spin,
            )  # fmt: skip
        except (OSError, ValueError) as exc:
            rc, which, wrs = -(getattr(exc, "errno", None) or errno.EINVAL), 0, []
        if rc == -errno.EINVAL and not wrs:  # a slice it does not take: nothing was posted
            self._let_go(held, mr, None)
            return False
        err = None if rc == 0 else self._error(rc, held[which][0].rail, deadline)
        for (d, *_), n in zip(held, wrs, strict=False):
            d.rail.direct_carried += n if err is None else 0
        self._let_go(held, mr, err)
        return True if err is None else err

    def _take(self, choices: list[_Choice], want: int) -> list[_Choice]:
        """Up to ``want`` of ``choices`` that are connected, usable and free, locked for this
        caller, starting at the next in turn; connects the others in the background."""
        o = self.owner
        health = o.health
        check = health.any_recorded()
        now = time.monotonic()
        k = len(choices)
        start = self._rr
        self._rr = start + 1
        held: list[_Choice] = []
        for i in range(k):
            c = choices[(start + i) % k]
            d = c[0]
            if d.state != READY:
                d.connect_soon(o)
                continue
            st = d.rail.nic
            if st.dead is not None or st.down or (check and not health.usable(d.rail.key, now)):
                continue
            if not d.lock.acquire(blocking=False):
                continue
            if d.state != READY or d.closing:
                d.lock.release()
                continue
            held.append(c)
            if len(held) == want:
                break
        return held

    def _let_go(
        self, held: list[_Choice], mr: LocalMr, err: MooncakeConnectorsError | None
    ) -> None:
        for d, *_ in held:
            if err is not None or d.closing:
                d.take_down()
            d.lock.release()
        mr.release(len(held))
        if err is None and self.owner.health.any_recorded():
            for d, *_ in held:
                self.owner.health.succeeded(d.rail.key)

    def _error(self, rc: int, rail: Rail, deadline: float) -> MooncakeConnectorsError:
        o = self.owner
        verbs = rail.nic.nic.verbs
        if rc > 0 and rc in verbs.ACCESS_ERRORS:
            # the peer's NIC refused the rkey or the bounds: final, and not the rail's fault
            return AccessViolation(
                f"the peer's NIC refused access (completion status {rc})",
                peer=rail.peer,
                path=rail.path,
            )
        if rc == -errno.ETIMEDOUT and time.monotonic() >= deadline:
            return TransferTimeout("the request's deadline passed on rdma", peer=rail.peer)
        if rc == -errno.ETIMEDOUT:
            why = f"no completion within {o.rail_timeout}s on a direct QP"
        elif rc < 0:
            why = f"posting or polling a direct QP failed: {os.strerror(-rc)}"
        elif rc == verbs.INVALID_REQUEST:
            why = f"{INVALID_REQUEST_CAUSES} (completion status {rc})"
            log.warning("rdma rail %s: %s", rail.path, why)
        else:
            why = f"completion status {rc} on a direct QP"
        err = TransportBroken(why, peer=rail.peer, path=rail.path)
        o.rail_failed(rail, err)
        return err


def _up(a: int, b: int) -> int:
    return -(-a // b)


__all__ = ["Direct", "DirectQp"]
