"""The client's write path: two-phase puts, and one-round-trip puts into reservations.

A put asks the master to place every key (``PutStart``), writes every stripe of every replica of
every key in one transfer batch, then commits (``PutEnd``); a key becomes visible only at commit.
A single put also reserves room for the client's next put of the same size and replica count;
that next put writes straight into the reservation and commits it, which reserves again
(``PutReserved``): one control round trip instead of two. An unused reservation expires on the
master with the put lease, so a client that dies leaks nothing. ``BUSY`` answers (an eviction
spilling to SSD, a new master still hearing from its servers) are retried until the deadline.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

from ..errors import (
    CapacityExceeded,
    MooncakeConnectorsError,
    ObjectExists,
    PutExpired,
    ReplicaUnavailable,
    StoreError,
)
from ..transfer_core.engine import TransferEngine, TransferRequest
from ..transfer_core.memory import unmapped, view
from ..types import Access, TransferOp, TransferStatus
from .coalesce import coalesce
from .link import MasterLink
from .protocol import (
    Allocs,
    Code,
    Codes,
    Committed,
    Err,
    Msg,
    PutEnd,
    PutReserved,
    PutStart,
    Spare,
    stripe_bounds,
)
from .staging import Staging

log = logging.getLogger(__name__)
Result = MooncakeConnectorsError | None


class Raw:
    """Unregistered memory to copy through staging (touched only once the put is placed)."""

    __slots__ = ("addr", "size")

    def __init__(self, addr: int, size: int) -> None:
        self.addr = addr
        self.size = size


# (registered address, size, what to stage instead: a view of the bytes or raw memory)
Source = tuple[int, int, "memoryview | Raw | None"]
_BUSY_PAUSE = 0.02
_WRITE = TransferOp.WRITE
_SPARE_MAX = 64 << 20  # puts up to this size reserve room for the next one
_DIRECT_MIN = 1 << 20
_MAYBE_REGISTERED = 64 << 10


def _buffer_address(mv: memoryview) -> int:
    import numpy as np

    return int(np.frombuffer(mv, dtype=np.uint8).ctypes.data)


def _unmapped(srcs: list[Source], which: list[int]) -> dict[int, MooncakeConnectorsError]:
    """The raw (unregistered) sources among ``which`` that are not readable memory: refused
    with AccessViolation rather than copied (and crashing the process)."""
    raws = [i for i in which if isinstance(srcs[i][2], Raw)]
    bad = unmapped([(srcs[i][0], srcs[i][1]) for i in raws])
    return {raws[k]: exc for k, exc in bad.items()}


def error_for(code: int, key: str, what: str = "") -> StoreError:
    """The exception for a master result code (its ``code`` field keeps the number)."""
    detail = f"{key!r}: {what}" if what else repr(key)
    if code == Code.EXISTS:
        return ObjectExists(f"key exists or is being written: {detail}", key=key, code=code)
    if code in (Code.NO_SPACE, Code.BUSY):
        return CapacityExceeded(
            f"no room for {detail} even after eviction (or larger than any segment)",
            key=key,
            code=int(Code.NO_SPACE),
        )
    if code == Code.PUT_EXPIRED:
        return PutExpired(f"put lease expired before commit: {detail}", key=key, code=code)
    if code == Code.UNAVAILABLE:
        return ReplicaUnavailable(f"no live copy: {detail}", key=key, code=code)
    return StoreError(f"store error {code}: {detail}", key=key, code=code)


def reply_error(reply: Msg, key: str) -> StoreError:
    if isinstance(reply, Err):
        return error_for(reply.code, key, reply.message)
    return StoreError(f"unexpected reply {type(reply).__name__}", key=key, code=-1)


class Writer:
    def __init__(
        self,
        engine: TransferEngine,
        link: MasterLink,
        staging: Staging,
        put_lease: float,
        timeout: float,
        direct: bool = False,
    ) -> None:
        self.engine = engine
        self.direct = direct  # may register large values for the call instead of staging them
        self._held: dict[tuple[int, int], list[int]] = {}  # range -> [users, region address]
        self._held_lock = threading.Lock()
        self.link = link
        self.staging = staging
        self.put_lease = put_lease
        self.timeout = timeout
        # (size, replicas) -> [(reservation id, stripes, use before)]
        self._spares: dict[
            tuple[int, int], list[tuple[int, list[list[tuple[str, int]]], float]]
        ] = {}

    def put(self, keys: list[str], srcs: list[Source], **opts: Any) -> list[Result]:
        put_id = 0
        if len(keys) == 1 and not opts.get("preferred_segment") and srcs[0][1] <= _SPARE_MAX:
            r = self._put_reserved(keys[0], srcs[0], **opts)
            if not isinstance(r, int):
                return [r]
            put_id = r
        put_id = put_id or random.getrandbits(62) + 1
        results = self._put_once(keys, srcs, put_id=put_id, **opts)
        # A leader change between allocation and commit loses the allocation (the new master
        # never made it): put those keys again, once, from the same source bytes. Under the same
        # put id: if the old leader did commit one (the answer was lost), the new one knows the
        # id from the servers' re-reports and answers COMMITTED instead of EXISTS.
        again = [i for i, r in enumerate(results) if isinstance(r, PutExpired)]
        if again:
            log.info("%d put(s) expired before commit (a master fail-over?); retrying", len(again))
            retried = self._put_once(
                [keys[i] for i in again], [srcs[i] for i in again], put_id=put_id, **opts
            )
            for i, r in zip(again, retried, strict=True):
                results[i] = r
        return results

    def _put_once(
        self,
        keys: list[str],
        srcs: list[Source],
        *,
        replicas: int = 1,
        ttl: float | None = None,
        soft_pin: bool = False,
        hard_pin: bool = False,
        preferred_segment: str = "",
        put_id: int = 0,
    ) -> list[Result]:
        assert self.engine is not None
        if not keys:
            return []
        deadline = time.monotonic() + self.timeout
        put_id = put_id or random.getrandbits(62) + 1
        results: list[Result] = [None] * len(keys)
        allocs: dict[int, list[list[tuple[str, int]]]] = {}
        todo = list(range(len(keys)))
        while todo:
            reply = self.link.call(
                PutStart(
                    put_id,
                    [keys[i] for i in todo],
                    [srcs[i][1] for i in todo],
                    replicas,
                    int(ttl * 1000) if ttl else 0,
                    soft_pin,
                    hard_pin,
                    preferred_segment,
                    reserve=len(keys) == 1 and not preferred_segment and srcs[0][1] <= _SPARE_MAX,
                ),
                deadline,
            )
            if isinstance(reply, Allocs) and reply.spare is not None:
                self._keep_spare(srcs[0][1], replicas, reply.spare)
            if not isinstance(reply, Allocs):
                err = reply_error(reply, keys[todo[0]])
                for i in todo:
                    results[i] = err
                break
            busy = []
            for i, code, stripes in zip(todo, reply.codes, reply.stripes, strict=True):
                if code == Code.OK:
                    allocs[i] = stripes
                elif code == Code.COMMITTED:
                    results[i] = None  # this put id's earlier attempt committed it: done
                elif code == Code.BUSY and time.monotonic() < deadline:
                    busy.append(i)  # eviction is spilling to SSD; room comes shortly
                else:
                    results[i] = error_for(code, keys[i])
            todo = busy
            if todo:
                time.sleep(_BUSY_PAUSE)
        refused = _unmapped(srcs, list(allocs))  # checked once placed: touched only then
        for i in refused:
            del allocs[i]
        placed = sorted(allocs)
        with self._materialize([srcs[i] for i in placed]) as where:
            addrs = [a for a, _, _ in srcs]
            for i, addr in zip(placed, where, strict=True):
                addrs[i] = addr
            return self._write_and_commit(
                keys, srcs, addrs, allocs, put_id, results, deadline, refused
            )

    @contextlib.contextmanager
    def _materialize(self, srcs: list[Source]) -> Iterator[list[int]]:
        """Registered addresses holding each source's bytes, inside the ``with``: registered
        memory as is; large Python buffers registered for the call (``direct``); the rest
        copied into staging."""
        if len(srcs) == 1 and srcs[0][1] < _MAYBE_REGISTERED:  # one small value (most puts)
            a, n, what = srcs[0]
            if what is None or not n:
                yield [a]
                return
            with self.staging.stage([n]) as (addr,):
                if isinstance(what, Raw):
                    ctypes.memmove(addr, what.addr, n)
                else:
                    view(addr, n)[:] = what  # type: ignore[index,assignment]
                yield [addr]
            return
        where = [a for a, _, _ in srcs]
        direct: list[int] = []
        held: list[tuple[int, int]] = []
        mine = []  # large Python buffers that already lie in registered memory: no copy
        for k, (_, n, what) in enumerate(srcs):
            if n >= _MAYBE_REGISTERED and isinstance(what, memoryview):
                addr = _buffer_address(what)
                if self.engine.local.find(addr, n) is not None:
                    where[k] = addr
                    mine.append(k)
        if mine:
            srcs = [
                (where[k], n, None) if k in mine else (a, n, w) for k, (a, n, w) in enumerate(srcs)
            ]
        if self.direct:
            direct = [
                k
                for k, (_, n, what) in enumerate(srcs)
                if n >= _DIRECT_MIN and isinstance(what, memoryview)
            ]
            for k in direct:
                where[k] = _buffer_address(srcs[k][2])  # type: ignore[arg-type]
            held = sorted({(where[k], srcs[k][1]) for k in direct})
            if not self._hold(held):
                direct, held = [], []
        skip = set(direct)
        staged = [
            k for k, (_, n, what) in enumerate(srcs) if what is not None and n and k not in skip
        ]
        try:
            with self.staging.stage([srcs[k][1] for k in staged]) as tmp:
                # The staged slots lie in order in one range: one view over it serves them all.
                base = tmp[0] if tmp else 0
                span = view(base, tmp[-1] + srcs[staged[-1]][1] - base) if tmp else None
                for k, addr in zip(staged, tmp, strict=True):
                    what, n = srcs[k][2], srcs[k][1]
                    if isinstance(what, Raw):
                        ctypes.memmove(addr, what.addr, n)
                    else:
                        span[addr - base : addr - base + n] = what  # type: ignore[index,assignment]
                    where[k] = addr
                yield where
        finally:
            self._let_go(held)

    def _hold(self, ranges: list[tuple[int, int]]) -> bool:
        """Register ``ranges`` (sorted, distinct) for a call, counted: the same buffer put by
        several calls at once is registered once. False: use staging instead."""
        if any(a + n > b for (a, n), (b, _) in itertools.pairwise(ranges)):
            return False  # overlapping slices of one buffer
        with self._held_lock:
            fresh = [r for r in ranges if r not in self._held]
            local = self.engine.local
            if any(local.find(a, 1) or local.find(a + n - 1, 1) for a, n in fresh):
                return False  # overlaps memory registered otherwise
            if fresh:
                try:
                    regions = self.engine.register_many(fresh, access=Access.READ, check=False)
                except MooncakeConnectorsError as exc:
                    log.debug("direct put unavailable (%s); staging instead", exc)
                    return False
                for r, region in zip(fresh, regions, strict=True):
                    self._held[r] = [0, region.addr]
            for r in ranges:
                self._held[r][0] += 1
        return True

    def _let_go(self, ranges: list[tuple[int, int]]) -> None:
        with self._held_lock:
            for r in ranges:
                entry = self._held[r]
                entry[0] -= 1
                if entry[0] == 0:
                    del self._held[r]
                    self.engine.unregister(entry[1])

    # -- one-round-trip puts ------------------------------------------------------------------
    # A single put also reserves room for this client's next put of the same size and replica
    # count; that next put writes straight into the reservation and commits it (which reserves
    # again): one control round trip instead of two. An unused reservation expires on the
    # master with the put lease, so a client that dies leaks nothing.
    def _keep_spare(self, size: int, replicas: int, spare: Spare) -> None:
        pool = self._spares.setdefault((size, replicas), [])
        if len(pool) < 4:
            pool.append((spare[0], spare[1], time.monotonic() + self.put_lease * 0.5))

    def _put_reserved(
        self,
        key: str,
        src: Source,
        *,
        replicas: int = 1,
        ttl: float | None = None,
        soft_pin: bool = False,
        hard_pin: bool = False,
        preferred_segment: str = "",
    ) -> Result | int:
        """The put's result, or an int: put it plainly instead, under that put id (0: a new
        one; a reservation id when the commit of the reservation may have happened on a master
        that failed over, so that a new leader recognises it)."""
        assert self.engine is not None
        size = src[1]
        pool = self._spares.get((size, replicas))
        try:
            rid, stripes, until = pool.pop() if pool else (0, [], 0.0)
        except IndexError:  # another thread took the last one
            return 0
        if not rid or until < time.monotonic():
            return 0
        bad = _unmapped([src], [0])
        if bad:
            self._keep_spare(size, replicas, (rid, stripes))  # unused: still ours
            return bad[0]
        deadline = time.monotonic() + self.timeout
        with self._materialize([src]) as (addr,):
            reqs = [
                TransferRequest(TransferOp.WRITE, seg, addr + off, remote, n)
                for (off, n), copies in zip(stripe_bounds(size, len(stripes)), stripes, strict=True)
                if n
                for seg, remote in copies
            ]
            if reqs:
                left = min(deadline - time.monotonic(), self.put_lease * 0.4)
                try:  # transfer() copies in this thread: no hand-off for the caller who waits
                    self.engine.transfer(reqs, timeout=max(0.001, left))
                except MooncakeConnectorsError as exc:
                    log.info("write into a reservation failed (%s); a plain put follows", exc)
                    return 0  # the reservation expires on the master
        msg = PutReserved(rid, key, size, int(ttl * 1000) if ttl else 0, soft_pin, hard_pin)
        reply = self.link.call(msg, deadline)
        while (
            isinstance(reply, Committed) and reply.code == Code.BUSY and time.monotonic() < deadline
        ):
            time.sleep(_BUSY_PAUSE)  # a new master still hearing from its servers
            reply = self.link.call(msg, deadline)
        if not isinstance(reply, Committed):
            return reply_error(reply, key)
        if reply.spare is not None:
            self._keep_spare(size, replicas, reply.spare)
        if reply.code == Code.OK:
            return None
        if reply.code == Code.EXISTS:
            self._keep_spare(size, replicas, (rid, stripes))  # still ours
            return error_for(reply.code, key)
        if reply.code == Code.PUT_EXPIRED:
            self._spares.clear()  # a new master, or expired: these are gone
            return rid
        return error_for(reply.code, key)

    def _write_and_commit(
        self,
        keys: list[str],
        srcs: list[Source],
        addrs: list[int],
        allocs: dict[int, list[list[tuple[str, int]]]],
        put_id: int,
        results: list[Result],
        deadline: float,
        refused: dict[int, MooncakeConnectorsError],
    ) -> list[Result]:
        """Write the placed keys, then commit them; ``refused`` keys' allocations are revoked."""
        assert self.engine is not None
        reqs: list[TransferRequest] = []
        owner: list[int] = []
        for i, stripes in allocs.items():
            addr, size = addrs[i], srcs[i][1]
            if len(stripes) == 1:  # (most keys: one stripe, no bounds to compute)
                if size:
                    for seg, remote in stripes[0]:
                        reqs.append(TransferRequest(_WRITE, seg, addr, remote, size))
                        owner.append(i)
                continue
            bounds = stripe_bounds(size, len(stripes))
            for (off, n), copies in zip(bounds, stripes, strict=True):
                if n:
                    for seg, remote in copies:
                        reqs.append(TransferRequest(TransferOp.WRITE, seg, addr + off, remote, n))
                        owner.append(i)
        failed = dict(refused)
        if reqs:
            left = max(0.001, min(deadline - time.monotonic(), self.put_lease * 0.4))
            try:  # transfer() copies in this thread when it can: no hand-off for the waiter
                self.engine.transfer(coalesce(reqs), timeout=left)
                reqs = []
            except MooncakeConnectorsError as exc:
                log.info("put batch write failed (%s); finding which keys", exc)
        if reqs:  # writes are idempotent: again, per request, to see which keys failed
            left = max(0.001, min(deadline - time.monotonic(), self.put_lease * 0.4))
            batch = self.engine.submit(reqs, timeout=left)
            batch.wait()
            for j, st in enumerate(batch.statuses):
                if st is not TransferStatus.COMPLETED and owner[j] not in failed:
                    e = batch.errors[j]
                    failed[owner[j]] = StoreError(
                        f"writing {keys[owner[j]]!r} failed: {e}",
                        key=keys[owner[j]],
                        code=int(Code.TRANSFER_FAIL),
                    )
        commit = [i for i in allocs if i not in failed]
        revoke = [keys[i] for i in failed]
        while commit or revoke:
            reply = self.link.call(PutEnd(put_id, [keys[i] for i in commit], revoke), deadline)
            revoke = []
            if not isinstance(reply, Codes):
                for i in commit:
                    results[i] = reply_error(reply, keys[i])
                break
            busy = []
            for i, code in zip(commit, reply.codes, strict=True):
                if code == Code.BUSY and time.monotonic() < deadline:
                    busy.append(i)  # a new master still hearing from its servers
                else:
                    results[i] = None if code == Code.OK else error_for(code, keys[i])
            commit = busy
            if commit:
                time.sleep(_BUSY_PAUSE)
        for i, e in failed.items():
            results[i] = e
        return results
