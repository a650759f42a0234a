"""Merge transfer requests that touch adjacent memory on both sides into one.

A batch of small values placed together by the master lies back to back in one segment, and the
client stages (or the caller keeps) them back to back too: 64 reads of 4 KiB become one read of
256 KiB, which the engine moves for the cost of one request. Only exact adjacency on both sides
is merged, so no byte outside the requests is touched.
"""

from __future__ import annotations

import itertools

from ..transfer_core.engine import TransferRequest


def _in_order(reqs: list[TransferRequest]) -> bool:
    """Whether ``reqs`` are already sorted by (target, remote address): a batch the master
    placed back to back usually is, and then it needs no sort."""
    _, pt, _, pr, _ = reqs[0]
    for _, t, _, r, _ in reqs:
        if t != pt:
            if t < pt:
                return False
            pt = t
        elif r < pr:
            return False
        pr = r
    return True


def coalesce(reqs: list[TransferRequest]) -> list[TransferRequest]:
    if len(reqs) < 2:
        return reqs
    ordered = reqs if _in_order(reqs) else sorted(reqs, key=lambda r: (r.target, r.remote_addr))
    out: list[TransferRequest] = []
    first = ordered[0]
    op, target, local, remote, length = first
    for r in itertools.islice(ordered, 1, None):
        r_op, r_target, r_local, r_remote, r_length = r
        if (
            r_target == target
            and r_op is op
            and remote + length == r_remote
            and local + length == r_local
        ):
            length += r_length
            continue
        out.append(first if length == first.length else first._replace(length=length))
        first = r
        op, target, local, remote, length = r
    out.append(first if length == first.length else first._replace(length=length))
    return out
