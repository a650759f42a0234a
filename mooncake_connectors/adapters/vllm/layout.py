"""KV cache tensors → per-block address arithmetic, and block reads → transfer requests.

Pure functions over shapes and addresses (torch only for reading a tensor's geometry), tested
without vLLM.

vLLM's CPU backend keeps one tensor per layer shaped ``(num_blocks, num_kv_heads, block_size,
2 * head_size)`` ("LBHNC": blocks outermost), so one block of one layer is one contiguous byte
range. The attention kernel may split a scheduler block into ``r`` kernel blocks (then the first
dimension is ``r * num_blocks``), and GPU backends put K and V first (``(2, num_blocks, ...)``);
both reduce to ranges here. Anything else is refused with the shape in the message.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from ...errors import ConfigError
from ...transfer_core import TransferRequest
from ...types import TransferOp
from .side_channel import LayerLayout, WorkerLayout


def _contiguous_tail(shape: Sequence[int], stride: Sequence[int], start: int) -> bool:
    expect = 1
    for dim in range(len(shape) - 1, start - 1, -1):
        if shape[dim] != 1 and stride[dim] != expect:
            return False
        expect *= shape[dim]
    return True


def layer_layouts(name: str, tensor: Any, num_blocks: int) -> list[LayerLayout]:
    """The block geometry of one layer's KV cache tensor (one entry, or K and V)."""
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
        return [LayerLayout(name, a, s, b, num_blocks) for a, s, b in found]
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


def check_compatible(local: WorkerLayout, remote: WorkerLayout) -> None:
    """Raise ConfigError when ``remote``'s blocks cannot be copied byte for byte into ours."""
    if remote.block_size != local.block_size:
        raise ConfigError(
            f"block_size differs: prefill {remote.block_size}, decode {local.block_size}"
        )
    if remote.dtype != local.dtype:
        raise ConfigError(f"KV dtype differs: prefill {remote.dtype}, decode {local.dtype}")
    theirs = {lay.name: lay for lay in remote.layers}
    ours = {lay.name: lay for lay in local.layers}
    if theirs.keys() != ours.keys():
        raise ConfigError(
            f"KV cache layers differ: prefill has {len(theirs)}, decode {len(ours)} "
            f"(e.g. {sorted(theirs.keys() ^ ours.keys())[:3]})"
        )
    for name, lay in ours.items():
        if theirs[name].block_bytes != lay.block_bytes:
            raise ConfigError(
                f"layer {name}: block of {theirs[name].block_bytes} bytes on prefill, "
                f"{lay.block_bytes} on decode (different model, heads or TP?)"
            )


def plan_reads(
    local: WorkerLayout,
    remote: WorkerLayout,
    local_blocks: Sequence[int],
    remote_blocks: Sequence[int],
) -> tuple[list[TransferRequest], list[tuple[int, ...]]]:
    """READ requests copying ``remote_blocks[i]`` into ``local_blocks[i]`` for every layer.

    Runs of blocks consecutive on both sides (and adjacent in memory) become one request. The
    second list gives, per request, the local block ids it fills (to report failures by block).
    """
    if len(local_blocks) != len(remote_blocks):
        raise ConfigError(
            f"{len(local_blocks)} local blocks for {len(remote_blocks)} remote blocks"
        )
    theirs = {lay.name: lay for lay in remote.layers}
    runs: list[tuple[int, int, int]] = []  # (first local, first remote, count)
    for lb, rb in zip(local_blocks, remote_blocks, strict=True):
        if runs:
            l0, r0, n = runs[-1]
            if lb == l0 + n and rb == r0 + n:
                runs[-1] = (l0, r0, n + 1)
                continue
        runs.append((lb, rb, 1))
    reqs: list[TransferRequest] = []
    owners: list[tuple[int, ...]] = []
    for lay in local.layers:
        rl = theirs[lay.name]
        size = lay.block_bytes
        packed = lay.stride == size and rl.stride == size
        for l0, r0, n in runs:
            for lb, rb, count in (
                ((l0, r0, n),) if packed else ((l0 + k, r0 + k, 1) for k in range(n))
            ):
                if lb < 0 or rb < 0 or lb + count > lay.num_blocks or rb + count > rl.num_blocks:
                    raise ConfigError(
                        f"block id out of range (local {lb}+{count} of {lay.num_blocks}, "
                        f"remote {rb}+{count} of {rl.num_blocks})"
                    )
                reqs.append(
                    TransferRequest(
                        TransferOp.READ,
                        remote.segment,
                        lay.addr + lb * lay.stride,
                        rl.addr + rb * rl.stride,
                        count * size,
                    )
                )
                owners.append(tuple(range(lb, lb + count)))
    return reqs, owners
