"""The client's read path: nearest copy first, fail over to the next, SSD loads.

For every stripe the copies are ordered by distance — this process's own segment, then a
segment on this host (the ``shm`` transport maps its memory), then remote — and a segment that
just failed is tried last for a while. All stripes of all keys go out as one transfer batch; the
stripes that failed go out again to their next copy. One attempt
waits ``replica_timeout`` plus time for its bytes at 100 MB/s, so a dead server costs a read
that much, not its full deadline; when the last copy fails the key reads as a miss.
Objects the master spilled to SSD are loaded, stripe by stripe, by the servers holding the
files into registered memory and read from there like any other copy.
"""

from __future__ import annotations

import contextlib
import threading
import time

from ..errors import MooncakeConnectorsError, ReplicaUnavailable, StoreError
from ..transfer_core.descriptor import host_id
from ..transfer_core.engine import TransferEngine, TransferRequest
from ..types import TransferOp, TransferStatus
from .coalesce import coalesce
from .link import MasterLink
from .protocol import Code, Err, Load, Loaded, Loc, Release, stripe_bounds
from .rpc import Channel

SUSPECT_TTL = 5.0  # seconds a failed segment is tried last
_READ = TransferOp.READ
_DONE = TransferStatus.COMPLETED


class _Stripe:
    __slots__ = ("cands", "dest", "i", "item", "n")

    def __init__(self, item: int, dest: int, n: int, cands: list[tuple[str, int]]) -> None:
        self.item = item
        self.dest = dest
        self.n = n
        self.cands = cands
        self.i = 0


class Reader:
    def __init__(
        self,
        engine: TransferEngine,
        replica_timeout: float,
        link: MasterLink,
        rpc_timeout: float,
    ) -> None:
        self.engine = engine
        self.dial = link.dial  # the servers' load ports take what the master takes
        self.replica_timeout = replica_timeout
        self.rpc_timeout = rpc_timeout
        self._host = host_id()
        self._rank: dict[str, int] = {}
        self._suspect: dict[str, float] = {}
        self._local = threading.local()
        self._lock = threading.Lock()
        self._channels: list[Channel] = []

    def rank(self, segment: str) -> int:
        r = self._rank.get(segment)
        if r is None:
            if segment == self.engine.segment_name:
                r = 0
            else:
                try:
                    peer = self.engine.peer(segment, self.replica_timeout)
                    r = 1 if peer.host_id == self._host else 2
                except MooncakeConnectorsError:
                    return 12  # unknown now; do not cache
            self._rank[segment] = r
        until = self._suspect.get(segment)
        if until is not None:
            if until > time.monotonic():
                return r + 10
            self._suspect.pop(segment, None)
        return r

    def read(self, items: list[tuple[Loc, int]], deadline: float) -> list[StoreError | None]:
        """Read each (location, destination address); per item None or the error."""
        errors: list[StoreError | None] = [None] * len(items)
        reqs: list[TransferRequest] = []
        timeout = 0.0
        first: MooncakeConnectorsError | None = None  # the outcome of a first attempt made
        left = deadline - time.monotonic()
        if left > 0 and all(
            loc.disk is None and len(loc.stripes) == 1 and len(loc.stripes[0]) == 1
            for loc, _ in items
        ):
            # Every item one stripe of one copy (the common case): the first attempt needs no
            # per-stripe bookkeeping; it is built only if that attempt fails.
            reqs = [
                TransferRequest(_READ, loc.stripes[0][0][0], dest, loc.stripes[0][0][1], loc.size)
                for loc, dest in items
                if loc.size
            ]
            if not reqs:
                return errors
            timeout = min(left, self.replica_timeout + sum(r.length for r in reqs) / 1e8)
            try:
                self.engine.transfer(coalesce(reqs), timeout=timeout)
                return errors
            except MooncakeConnectorsError as exc:
                first = exc
        active: list[_Stripe] = []
        for k, (loc, dest) in enumerate(items):
            if loc.disk is not None:
                errors[k] = self._load(loc, dest, deadline)
                continue
            bounds = stripe_bounds(loc.size, len(loc.stripes))
            for (off, n), copies in zip(bounds, loc.stripes, strict=True):
                if n:
                    cands = copies if len(copies) == 1 else sorted(copies, key=self._key)
                    active.append(_Stripe(k, dest + off, n, cands))
        while active:
            if first is not None:  # that attempt was this loop's first: take its outcome
                why, first = first, None
            else:
                left = deadline - time.monotonic()
                if left <= 0:
                    for s in active:
                        errors[s.item] = ReplicaUnavailable("read deadline passed", code=-800)
                    break
                reqs = [
                    TransferRequest(_READ, s.cands[s.i][0], s.dest, s.cands[s.i][1], s.n)
                    for s in active
                ]
                # One attempt gets replica_timeout plus time for its bytes at a slow 100 MB/s:
                # a dead server then costs that much, a copy that is merely far still arrives.
                timeout = min(left, self.replica_timeout + sum(s.n for s in active) / 1e8)
                try:  # the common case, in this thread: every stripe from its first choice
                    self.engine.transfer(coalesce(reqs), timeout=timeout)
                    break
                except MooncakeConnectorsError as exc:
                    why = exc
            bad = getattr(why, "peer", None)  # only peer errors name one
            if isinstance(bad, str) and any(s.cands[s.i][0] == bad for s in active):
                # The error names the copy's segment: move its stripes on, read all again.
                self._suspect[bad] = time.monotonic() + SUSPECT_TTL
                retry = []
                for s in active:
                    if s.cands[s.i][0] == bad:
                        s.i += 1
                        if s.i == len(s.cands):
                            errors[s.item] = ReplicaUnavailable(
                                f"every copy failed; last: {why}", code=int(Code.TRANSFER_FAIL)
                            )
                            continue
                    retry.append(s)
                active = retry
                continue
            # Which stripes failed? Ask the engine per request (reads are idempotent).
            left = deadline - time.monotonic()
            batch = self.engine.submit(reqs, timeout=max(0.001, min(left, timeout)))
            batch.wait()
            retry = []
            for s, st, err in zip(active, batch.statuses, batch.errors, strict=True):
                if st is _DONE:
                    continue
                self._suspect[s.cands[s.i][0]] = time.monotonic() + SUSPECT_TTL
                s.i += 1
                if s.i < len(s.cands):
                    retry.append(s)
                elif errors[s.item] is None:
                    errors[s.item] = ReplicaUnavailable(
                        f"every copy failed; last: {err}", code=int(Code.TRANSFER_FAIL)
                    )
            active = retry
        return errors

    def _key(self, copy: tuple[str, int]) -> int:
        return self.rank(copy[0])

    def _channel(self, endpoint: str) -> Channel:
        chans: dict[str, Channel] | None = getattr(self._local, "chans", None)
        if chans is None:
            chans = self._local.chans = {}
        ch = chans.get(endpoint)
        if ch is None or ch.closed:
            ch = chans[endpoint] = self.dial.channel(endpoint, self.rpc_timeout)
            with self._lock:
                self._channels.append(ch)
        return ch

    def _load(self, loc: Loc, dest: int, deadline: float) -> StoreError | None:
        """Have each stripe's server read its SSD file into registered memory (checking the
        file's checksum), then read every stripe from there in one batch. The load requests of
        all stripes are in flight at once, so a striped object's servers read in parallel."""
        assert loc.disk is not None
        bounds = stripe_bounds(loc.size, len(loc.disk))
        loans: list[tuple[Channel, int]] = []
        reqs: list[TransferRequest] = []
        error: StoreError | None = None
        try:
            todo = list(range(len(loc.disk)))
            while todo and error is None:
                if deadline <= time.monotonic():
                    error = ReplicaUnavailable("SSD load deadline passed", code=-800)
                    break
                sent = []
                for s in todo:
                    endpoint, _, fid = loc.disk[s]
                    ch = self._channel(endpoint)
                    sent.append((s, ch, ch.send(Load(fid, bounds[s][1]), self.rpc_timeout)))
                busy = []
                for s, ch, rid in sent:  # collect every reply: a loan must not be left behind
                    reply = ch.wait(rid, min(deadline, time.monotonic() + self.rpc_timeout))
                    if isinstance(reply, Loaded):
                        loans.append((ch, reply.token))
                        off, n = bounds[s]
                        if n:
                            seg = loc.disk[s][1]
                            reqs.append(TransferRequest(_READ, seg, dest + off, reply.addr, n))
                    elif isinstance(reply, Err) and reply.code == Code.BUSY:
                        busy.append(s)
                    elif error is None:
                        why = reply.message if isinstance(reply, Err) else type(reply).__name__
                        error = ReplicaUnavailable(f"SSD copy unavailable: {why}", code=-704)
                todo = busy
                if busy and error is None:
                    time.sleep(0.01)  # a bounce buffer is full; loans end within milliseconds
            if reqs and error is None:
                left = max(0.001, deadline - time.monotonic())
                self.engine.transfer(coalesce(reqs), timeout=left)
        except (OSError, MooncakeConnectorsError) as exc:
            error = ReplicaUnavailable(f"SSD copy unreadable: {exc}", code=-800)
        finally:
            for ch, token in loans:
                with contextlib.suppress(OSError):  # else the loan expires on the server
                    ch.notify(Release(token))
            for ch in {ch for _, ch in self._local_channels()}:
                if ch.in_flight:  # replies nobody will collect: start that channel afresh
                    ch.close()
        return error

    def _local_channels(self) -> list[tuple[str, Channel]]:
        chans: dict[str, Channel] | None = getattr(self._local, "chans", None)
        return list(chans.items()) if chans else []

    def close(self) -> None:
        with self._lock:
            for ch in self._channels:
                ch.close()
            self._channels.clear()
