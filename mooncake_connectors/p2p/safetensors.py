"""Safetensors checkpoints: fetch one from the swarm into a directory an engine then loads.

The format is an 8-byte little-endian header length, a JSON header (tensor name → dtype, shape,
``data_offsets`` into the byte buffer that follows, plus an optional ``__metadata__``), then the
buffer. The header is parsed here with ``json`` and ``struct``, so no torch is needed to check a
fetched checkpoint before vLLM or SGLang maps it.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .manifest import P2PError

if TYPE_CHECKING:
    from .fetch import FetchStats
    from .store import P2PStore

_ITEM = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2, "F16": 2,
    "BF16": 2, "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8, "C64": 8,
}  # fmt: skip
_MAX_HEADER = 100 << 20


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute file offsets of its bytes
    end: int


def read_header(path: str | os.PathLike[str]) -> dict[str, TensorInfo]:
    """The tensors of one ``.safetensors`` file; P2PError when the file is not well formed."""
    p = Path(path)
    size = p.stat().st_size
    with open(p, "rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise P2PError(f"{p.name}: shorter than a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > min(_MAX_HEADER, size - 8):
            raise P2PError(f"{p.name}: header length {n} does not fit the file")
        try:
            head = json.loads(fh.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise P2PError(f"{p.name}: header is not JSON: {exc}") from exc
    if not isinstance(head, dict):
        raise P2PError(f"{p.name}: header is not a JSON object")
    base = 8 + n
    out: dict[str, TensorInfo] = {}
    for key, val in head.items():
        if key == "__metadata__":
            continue
        out[key] = _tensor(p.name, key, val, base, size)
    return out


def _tensor(file: str, key: str, val: Any, base: int, size: int) -> TensorInfo:
    try:
        dtype, shape, (a, b) = val["dtype"], tuple(val["shape"]), val["data_offsets"]
    except (KeyError, TypeError, ValueError) as exc:
        raise P2PError(f"{file}: tensor {key!r} has a malformed entry") from exc
    item = _ITEM.get(dtype)
    if item is None or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise P2PError(f"{file}: tensor {key!r} has dtype {dtype!r} / shape {shape!r}")
    n = item
    for d in shape:
        n *= d
    if not (isinstance(a, int) and isinstance(b, int) and 0 <= a <= b and b - a == n):
        raise P2PError(f"{file}: tensor {key!r}: offsets {a}..{b} do not hold {n} bytes")
    if base + b > size:
        raise P2PError(f"{file}: tensor {key!r} runs past the end of the file")
    return TensorInfo(dtype, shape, base + a, base + b)


def check_checkpoint(root: str | os.PathLike[str]) -> dict[str, int]:
    """Parse every ``.safetensors`` under ``root`` and check the index's weight map.

    Returns tensors per file. A shard the index names but the directory lacks is an error.
    """
    r = Path(root)
    counts = {f.relative_to(r).as_posix(): len(read_header(f)) for f in r.rglob("*.safetensors")}
    if not counts:
        raise P2PError(f"no .safetensors files under {r}")
    for index in r.glob("*.safetensors.index.json"):
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise P2PError(f"{index.name}: no readable weight_map") from exc
        missing = sorted({v for v in weight_map.values() if v not in counts})
        if missing:
            raise P2PError(f"{index.name} names shards that are not here: {missing}")
    return counts


def fetch_checkpoint(
    store: P2PStore,
    name: str,
    dest: str | os.PathLike[str],
    *,
    version: int | None = None,
    timeout: float = 600.0,
    on_progress: Callable[[FetchStats], None] | None = None,
) -> FetchStats:
    """Fetch a published checkpoint into ``dest`` and check its safetensors files.

    ``dest`` is then a model directory vLLM (``--model DEST``) or SGLang (``--model-path``)
    loads as usual; a fetch killed half way resumes from what it left there.
    """
    stats = store.fetch(name, dest, version=version, timeout=timeout, on_progress=on_progress)
    check_checkpoint(dest)
    return stats


__all__ = ["TensorInfo", "check_checkpoint", "fetch_checkpoint", "read_header"]
