"""Mooncake's multi-buffer store calls over our client: one value from (into) several buffers.

``batch_put_from_multi_buffers`` stores, per key, the concatenation of its buffers;
``batch_get_into_multi_buffers`` reads each value and splits it over its buffers in order (vLLM's
``MooncakeStoreConnector`` keeps one buffer per layer of a block). As in Mooncake 0.3.13, the
buffers of a get must add up to the value's size exactly: fewer bytes than the value is -600,
more is -800 (a transfer failure, as Mooncake reports it). A key with as many pointers as sizes
is required (-600). Buffers need not be registered; memory that is not this process's (or is
GPU memory) is refused with -600 rather than read or written. A value of several buffers is
gathered (put) or scattered (get) through one host copy; a single buffer moves as ``put_from``
and ``get_into`` do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .errors import AccessViolation, ConfigError, MooncakeConnectorsError, StoreError
from .store.protocol import Code
from .transfer_core.memory import unmapped, view

Outcome = int | MooncakeConnectorsError | None  # bytes read (get) / None: stored or a miss


def _shape(
    keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
) -> list[MooncakeConnectorsError | None]:
    """Per key: None, or the error of a key whose pointers and sizes do not pair up."""
    if not len(keys) == len(ptrs) == len(sizes):
        raise ConfigError("keys, buffer lists and size lists differ in length")
    return [
        None
        if len(p) == len(n) and all(int(s) >= 0 for s in n)
        else ConfigError("pointers and sizes do not pair up", key=k, code=int(Code.INVALID))
        for k, p, n in zip(keys, ptrs, sizes, strict=True)
    ]


def host_views(
    engine: Any, ptrs: Sequence[int], sizes: Sequence[int], *, write: bool
) -> list[memoryview]:
    """Byte views of the buffers: registered host memory, or memory mapped in this process
    (checked first, so a bad address is an AccessViolation, never a crash)."""
    unchecked = []
    for i, (p, n) in enumerate(zip(ptrs, sizes, strict=True)):
        region = engine.local.find(p, n) if n else None
        if region is None:
            unchecked.append(i)
        elif region.device >= 0 or (write and not region.writable):
            raise AccessViolation(f"{p:#x}+{n} is not writable host memory")
    bad = unmapped([(ptrs[i], sizes[i]) for i in unchecked if sizes[i]], write=write)
    if bad:
        raise next(iter(bad.values()))
    return [
        view(int(p), int(n)) if n else memoryview(b"") for p, n in zip(ptrs, sizes, strict=True)
    ]


def put_multi(
    client: Any,
    keys: Sequence[str],
    ptrs: Sequence[Sequence[int]],
    sizes: Sequence[Sequence[int]],
    opts: dict[str, Any],
) -> list[Outcome]:
    """Per key: None (stored, or already there) or the error."""
    out: list[Outcome] = list(_shape(keys, ptrs, sizes))
    todo, values = [], []
    for i in range(len(keys)):
        if out[i] is not None:
            continue
        try:
            views = host_views(client.engine, ptrs[i], sizes[i], write=False)
        except AccessViolation as exc:
            out[i] = exc
            continue
        todo.append(i)
        values.append(views[0] if len(views) == 1 else b"".join(views))
    if todo:
        errs = client.put_batch([keys[i] for i in todo], values, **opts)
        for i, err in zip(todo, errs, strict=True):
            out[i] = err
    return out


def get_multi(
    client: Any, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
) -> list[Outcome]:
    """Per key: bytes read, None on a miss, or the error."""
    out: list[Outcome] = list(_shape(keys, ptrs, sizes))
    if not keys:
        return out
    deadline = client._deadline()
    locs = client._lookup(list(keys), deadline)
    todo: list[tuple[int, Any, list[memoryview]]] = []
    for i, loc in enumerate(locs):
        if out[i] is not None or loc is None:
            continue
        total = sum(int(n) for n in sizes[i])
        if loc.size != total:  # Mooncake: buffers short of the value -600, beyond it -800
            code = Code.INVALID if loc.size > total else Code.TRANSFER_FAIL
            out[i] = StoreError(
                f"buffers of {total} bytes for a value of {loc.size}", key=keys[i], code=int(code)
            )
            continue
        if not total:
            out[i] = 0  # an empty value: nothing to read
            continue
        try:
            views = host_views(client.engine, ptrs[i], sizes[i], write=True)
        except AccessViolation as exc:
            out[i] = exc
            continue
        todo.append((i, loc, views))
    multi = [k for k, (_, _, views) in enumerate(todo) if len(views) > 1]
    with client._stage([todo[k][1].size for k in multi]) as tmp:
        dests = [int(ptrs[i][0]) for i, _, _ in todo]
        for k, addr in zip(multi, tmp, strict=True):
            dests[k] = addr
        got = client._read_into(
            [keys[i] for i, _, _ in todo],
            [loc for _, loc, _ in todo],
            dests,
            [loc.size for _, loc, _ in todo],
            deadline,
        )
        for k in multi:
            if isinstance(got[k], int):
                pos = dests[k]
                for v in todo[k][2]:
                    if len(v):
                        v[:] = view(pos, len(v))
                    pos += len(v)
    for (i, _, _), res in zip(todo, got, strict=True):
        out[i] = res
    return out
