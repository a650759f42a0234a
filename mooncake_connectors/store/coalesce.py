"""Merge transfer requests that touch adjacent memory on both sides into one.

A batch of small values placed together by the master lies back to back in one segment, and the
client stages (or the caller keeps) them back to back too: 64 reads of 4 KiB become one read of
256 KiB, which the engine moves for the cost of one request. Only exact adjacency on both sides
is merged, so no byte outside the requests is touched.
"""

from __future__ import annotations

from ..transfer_core.engine import TransferRequest


def coalesce(reqs: list[TransferRequest]) -> list[TransferRequest]:
    if len(reqs) < 2:
        return reqs
    ordered = sorted(reqs, key=lambda r: (r.target, r.remote_addr))
    out: list[TransferRequest] = []
    cur = ordered[0]
    for r in ordered[1:]:
        if (
            r.target == cur.target
            and r.op is cur.op
            and cur.remote_addr + cur.length == r.remote_addr
            and cur.local_addr + cur.length == r.local_addr
        ):
            cur = cur._replace(length=cur.length + r.length)
        else:
            out.append(cur)
            cur = r
    out.append(cur)
    return out
