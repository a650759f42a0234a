"""KV cache tensors → per-block address arithmetic, and block reads → transfer requests.

Pure functions over shapes and addresses: a tensor is only asked for its geometry (``shape``,
``stride()``, ``element_size()``, ``data_ptr()``), so nothing here imports torch or an engine.

vLLM's CPU backend keeps one tensor per layer shaped ``(num_blocks, num_kv_heads, block_size,
2 * head_size)`` ("LBHNC": blocks outermost), so one block of one layer is one contiguous byte
range. The attention kernel may split a scheduler block into ``r`` kernel blocks (then the first
dimension is ``r * num_blocks``), and GPU backends put K and V first (``(2, num_blocks, ...)``);
both reduce to ranges here. Anything else is refused with the shape in the message.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import Any

from ..errors import ConfigError
from ..transfer_core import TransferRequest
from ..types import TransferOp
from .messages import LayerLayout, WorkerLayout


def _contiguous_tail(shape: Sequence[int], stride: Sequence[int], start: int) -> bool:
    expect = 1
    for dim in range(len(shape) - 1, start - 1, -1):
        if shape[dim] != 1 and stride[dim] != expect:
            return False
        expect *= shape[dim]
    return True


def layer_layouts(
    name: str, tensor: Any, num_blocks: int, num_kv_heads: int = 0
) -> list[LayerLayout]:
    """The block geometry of one layer's KV cache tensor (one entry, or K and V).

    ``num_kv_heads`` (this rank's) lets a ``(blocks, heads, ...)`` tensor be sliced by head.
    """
    shape = list(tensor.shape)
    stride = list(tensor.stride())
    elem = int(tensor.element_size())
    base = int(tensor.data_ptr())

    def planes(first: int) -> list[tuple[int, int, int]] | None:
        # (addr, stride, bytes) of scheduler blocks when dim ``first`` indexes kernel blocks
        if len(shape) <= first or shape[first] % num_blocks or not shape[first]:
            return None
        ratio = shape[first] // num_blocks
        if not _contiguous_tail(shape, stride, first + 1):
            return None
        kblock = elem
        for s in shape[first + 1 :]:
            kblock *= s
        kstride = stride[first] * elem
        if ratio > 1 and kstride != kblock:
            return None  # kernel blocks of one scheduler block are not adjacent
        if first == 0:
            return [(base, kstride * ratio, kblock * ratio)]
        return [(base + i * stride[0] * elem, kstride * ratio, kblock * ratio) for i in range(2)]

    found = planes(0)
    if found is not None:
        head_bytes = 0
        if (
            len(shape) >= 3
            and shape[0] == num_blocks
            and num_kv_heads
            and (shape[1] == num_kv_heads)
        ):
            head_bytes = stride[1] * elem  # contiguous tail: heads outermost inside a block
        return [LayerLayout(name, a, s, b, num_blocks, head_bytes) for a, s, b in found]
    if shape and shape[0] == 2:
        found = planes(1)
        if found is not None:
            return [
                LayerLayout(f"{name}/{kv}", a, s, b, num_blocks)
                for kv, (a, s, b) in zip("kv", found, strict=True)
            ]
    raise ConfigError(
        f"KV cache of layer {name} has a layout this connector cannot address by block "
        f"(shape {tuple(shape)}, stride {tuple(stride)}, {num_blocks} blocks)"
    )


def register_spans(layers: Iterable[LayerLayout]) -> list[tuple[int, int]]:
    """Disjoint (addr, length) ranges covering every block of every layer (overlaps merged)."""
    spans = sorted(
        (lay.addr, lay.addr + (lay.num_blocks - 1) * lay.stride + lay.block_bytes) for lay in layers
    )
    merged: list[list[int]] = []
    for start, end in spans:
        if merged and start < merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e - s) for s, e in merged]


def _pairing(local_tp: int, remote_tp: int) -> int:
    if max(local_tp, remote_tp) % min(local_tp, remote_tp):
        raise ConfigError(
            f"prefill TP {remote_tp} and decode TP {local_tp}: one must divide the other"
        )
    return max(local_tp, remote_tp) // min(local_tp, remote_tp)


def source_ranks(local_rank: int, local_tp: int, remote_tp: int) -> list[int]:
    """The prefill TP ranks whose KV heads decode rank ``local_rank`` holds.

    vLLM gives TP rank r the r-th contiguous slice of the KV heads. Decode with the smaller TP
    gathers its heads from several prefill ranks; with the larger TP it reads part of one.
    """
    k = _pairing(local_tp, remote_tp)
    if local_tp <= remote_tp:
        return [local_rank * k + j for j in range(k)]
    return [local_rank // k]


def readers_per_source(local_tp: int, remote_tp: int) -> int:
    """How many decode ranks read each prefill rank's blocks."""
    return _pairing(local_tp, remote_tp) if local_tp > remote_tp else 1


def check_compatible(local: WorkerLayout, remote: WorkerLayout) -> None:
    """Raise ConfigError when ``remote``'s blocks cannot be copied into ours.

    Equal TP sizes: blocks match byte for byte. Different TP sizes: both sides must keep heads
    outermost inside a block (``head_bytes``), heads of equal size, and the same heads in total.
    """
    if remote.block_size != local.block_size:
        raise ConfigError(
            f"block_size differs: prefill {remote.block_size}, decode {local.block_size}"
        )
    if remote.dtype != local.dtype:
        raise ConfigError(f"KV dtype differs: prefill {remote.dtype}, decode {local.dtype}")
    if (remote.groups, remote.group_kinds) != (local.groups, local.group_kinds):

        def describe(lay: WorkerLayout) -> str:
            if lay.groups is None:
                return "one KV cache group"
            kinds = lay.group_kinds or ["?"] * len(lay.groups)
            sizes = [f"{k} x{len(g)}" for k, g in zip(kinds, lay.groups, strict=False)]
            return f"KV cache groups {sizes}"

        raise ConfigError(
            f"KV cache groups differ: prefill has {describe(remote)}, decode {describe(local)} "
            "(hybrid KV cache manager on one side only, or another model?)"
        )
    theirs = {lay.name: lay for lay in remote.layers}
    ours = {lay.name: lay for lay in local.layers}
    if theirs.keys() != ours.keys():
        raise ConfigError(
            f"KV cache layers differ: prefill has {len(theirs)}, decode {len(ours)} "
            f"(e.g. {sorted(theirs.keys() ^ ours.keys())[:3]})"
        )
    _pairing(local.tp_size, remote.tp_size)
    for name, lay in ours.items():
        rl = theirs[name]
        if remote.tp_size == local.tp_size:
            if rl.block_bytes != lay.block_bytes:
                raise ConfigError(
                    f"layer {name}: block of {rl.block_bytes} bytes on prefill, "
                    f"{lay.block_bytes} on decode (different model or heads?)"
                )
            continue
        if not (lay.head_bytes and rl.head_bytes):
            raise ConfigError(
                f"layer {name}: prefill TP {remote.tp_size} != decode TP {local.tp_size} needs "
                "a head-major KV layout on both sides (vLLM's CPU layout), not this one"
            )
        if rl.head_bytes != lay.head_bytes:
            raise ConfigError(f"layer {name}: KV heads of different sizes on prefill and decode")
        if rl.block_bytes * remote.tp_size != lay.block_bytes * local.tp_size:
            raise ConfigError(
                f"layer {name}: {rl.block_bytes // rl.head_bytes} heads x TP {remote.tp_size} "
                f"on prefill, {lay.block_bytes // lay.head_bytes} x TP {local.tp_size} on "
                "decode (replicated KV heads are not supported)"
            )


def plan_reads(
    local: WorkerLayout,
    remotes: Sequence[WorkerLayout],
    local_blocks: Sequence[int],
    remote_blocks: Sequence[int],
    *,
    op: TransferOp = TransferOp.READ,
    layers: Collection[str] | None = None,
) -> tuple[list[TransferRequest], list[tuple[int, ...]]]:
    """READ requests filling ``local_blocks[i]`` from ``remote_blocks[i]`` for every layer.

    ``op=WRITE`` turns them around (a push: our blocks into the peer's); ``layers`` keeps only
    the layers of those names.
    ``remotes`` are the layouts of :func:`source_ranks` (one when TP sizes are equal). Equal TP:
    whole blocks, and runs of blocks consecutive on both sides (and adjacent in memory) become
    one request. Decode TP smaller: each local block is assembled from each source's block, one
    range of heads after the other. Decode TP larger: each local block is this rank's range of
    heads inside the source's block. The second list gives, per request, the local block ids it
    fills (to report failures by block).
    """
    if len(local_blocks) != len(remote_blocks):
        raise ConfigError(
            f"{len(local_blocks)} local blocks for {len(remote_blocks)} remote blocks"
        )
    if not remotes:
        raise ConfigError("no prefill layout to read from")
    tp_r = remotes[0].tp_size
    runs: list[tuple[int, int, int]] = []  # (first local, first remote, count)
    for lb, rb in zip(local_blocks, remote_blocks, strict=True):
        if runs:
            l0, r0, n = runs[-1]
            if lb == l0 + n and rb == r0 + n:
                runs[-1] = (l0, r0, n + 1)
                continue
        runs.append((lb, rb, 1))
    by_name = [{lay.name: lay for lay in r.layers} for r in remotes]
    reqs: list[TransferRequest] = []
    owners: list[tuple[int, ...]] = []
    for lay in local.layers:
        if layers is not None and lay.name not in layers:
            continue
        # (remote layout, its layer, offset in our block, offset in theirs, bytes per block)
        parts: list[tuple[WorkerLayout, LayerLayout, int, int, int]] = []
        if tp_r == local.tp_size:
            parts.append((remotes[0], by_name[0][lay.name], 0, 0, lay.block_bytes))
        elif local.tp_size < tp_r:
            off = 0
            for remote, names in zip(remotes, by_name, strict=True):
                rl = names[lay.name]
                parts.append((remote, rl, off, 0, rl.block_bytes))
                off += rl.block_bytes
        else:
            k = local.tp_size // tp_r
            sub = (local.tp_rank % k) * lay.block_bytes
            parts.append((remotes[0], by_name[0][lay.name], 0, sub, lay.block_bytes))
        for remote, rl, loff, roff, size in parts:
            whole = size == lay.block_bytes == rl.block_bytes
            packed = whole and lay.stride == size and rl.stride == size
            for l0, r0, n in runs:
                pieces = [(l0, r0, n)] if packed else [(l0 + j, r0 + j, 1) for j in range(n)]
                for lb, rb, count in pieces:
                    if (
                        lb < 0
                        or rb < 0
                        or lb + count > lay.num_blocks
                        or rb + count > rl.num_blocks
                    ):
                        raise ConfigError(
                            f"block id out of range (local {lb}+{count} of {lay.num_blocks}, "
                            f"remote {rb}+{count} of {rl.num_blocks})"
                        )
                    reqs.append(
                        TransferRequest(
                            op,
                            remote.segment,
                            lay.addr + lb * lay.stride + loff,
                            rl.addr + rb * rl.stride + roff,
                            count * size,
                        )
                    )
                    owners.append(tuple(range(lb, lb + count)))
    return reqs, owners
