"""The master's fast path for a batch put of fresh small keys: one allocation for the batch.

The common batch (new keys, one copy, each at most a stripe, no preferred segment, room in one
segment's free run and in the key budget) is placed as one contiguous block carved into the
keys' slots: one allocator search instead of one per key, and the batch's writes merge into
one transfer. Anything else (a key that exists or is being written, a key twice, eviction
needed) returns None and goes through :meth:`.state.MasterState.put_start` key by key.

Freeing stays per key: the allocator tracks free runs only, so one slot of the block is
released like any allocation of its size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .allocator import aligned
from .protocol import Code
from .records import KEY_OVERHEAD, SHIFT, Pending

if TYPE_CHECKING:
    from .state import MasterState

Stripes = list[list[tuple[str, int]]]


def place_fresh(
    st: MasterState,
    put_id: int,
    keys: list[str],
    sizes: list[int],
    flags: int,
    ttl_ms: int,
    deadline: float,
) -> tuple[list[int], list[Stripes]] | None:
    """Place every key of the batch in one block, or None (then place them one by one)."""
    n = len(keys)
    order = st._order
    if n < 2 or not order or len(sizes) != n:
        return None
    objects, pending, stripe = st.objects, st.pending, st.cfg.stripe_size
    chars = 0
    total = 0
    for key, size in zip(keys, sizes, strict=True):
        if key in objects or key in pending or size > stripe:
            return None
        chars += len(key)
        total += aligned(size)
    cost = chars + KEY_OVERHEAD * n  # key_cost of every key, summed
    if st.key_bytes + cost > st.cfg.key_budget or len(set(keys)) != n:
        return None
    start = st._rr
    count = len(order)
    for k in range(count):
        seg = order[(start + k) % count]
        off = seg.alloc.alloc(total) if seg.alloc is not None else None
        if off is not None:
            break
    else:
        return None
    packed = seg.id << SHIFT
    name, base = seg.name, seg.base
    out: list[Stripes] = []
    for key, size in zip(keys, sizes, strict=True):
        pending[key] = Pending(put_id, size, [packed | off], 1, flags, ttl_ms, deadline)
        out.append([[(name, base + off)]])
        off += aligned(size)
    st.key_bytes += cost
    return [int(Code.OK)] * n, out
