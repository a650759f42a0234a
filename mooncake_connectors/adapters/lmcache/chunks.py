"""LMCache chunks to and from store values, in the two layouts (see :class:`.config.Layout`).

Every function here runs on a store-call thread with a connected client and LMCache's real
``MemoryObj``s; none touches LMCache's event loop. A ``MemoryObj`` handed back to the caller
carries one reference, as LMCache's own connectors hand them back.

RAW puts pass each object's address to ``batch_put_from`` and gets read straight into freshly
allocated objects with ``batch_get_into``: with LMCache's CPU buffer registered both are
zero-copy (otherwise the client copies through its staging memory). FRAMED values are LMCache's
``RemoteMetadata`` header followed by the bytes, the layout LMCache's own Mooncake connector
writes when it saves chunk metadata; they are copied once on each side.
"""

from __future__ import annotations

import dataclasses
import logging
import struct
from collections.abc import Callable, Sequence
from typing import Any

from ...errors import MooncakeConnectorsError, ObjectExists
from ...store.client import StoreClient

log = logging.getLogger(__name__)

Warn = Callable[..., bool]


def release(objs: Sequence[Any | None]) -> None:
    """Drop the reference this module gave each object."""
    for obj in objs:
        if obj is not None:
            obj.ref_count_down()


@dataclasses.dataclass(eq=False)
class ChunkCodec:
    """What a chunk looks like here: the configured shape, dtypes and format of a full chunk.

    backend: LMCache's LocalCPUBackend (allocates MemoryObjs). shapes/dtypes/fmt: a full
    chunk's layout; full_bytes/token_bytes: its size and the size of one token.
    reshape(obj, n): LMCache's own narrowing of a full-size object to the n bytes read.
    """

    backend: Any
    shapes: list[Any]
    dtypes: list[Any]
    fmt: Any
    full_bytes: int
    token_bytes: int
    reshape: Callable[[Any, int], Any]
    warn: Warn
    token_dim: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.token_dim = self.fmt.token_dim()

    def _allocate(self, shapes: Any, dtypes: Any, fmt: Any) -> Any | None:
        # busy_loop=False: evict if it can, never spin waiting for memory on a store thread.
        return self.backend.allocate(shapes, dtypes, fmt, eviction=True, busy_loop=False)

    # -- RAW --------------------------------------------------------------------------------
    def raw_misfit(self, obj: Any) -> str | None:
        """Why ``obj`` cannot be stored RAW (None if it can): its shape must be the full
        chunk's, or with a single layout group, fewer tokens of it."""
        try:
            n = obj.get_size()
            shapes = [list(s) for s in obj.get_shapes()]
            dtypes = list(obj.get_dtypes())
            fmt = obj.get_memory_format()
        except (AssertionError, AttributeError) as exc:
            return f"no layout ({exc!r})"
        if fmt != self.fmt or dtypes != list(self.dtypes):
            return f"format {fmt}/{dtypes}, expected {self.fmt}/{self.dtypes}"
        if n == self.full_bytes and shapes == [list(s) for s in self.shapes]:
            return None
        if len(shapes) != 1 or len(self.shapes) != 1 or not 0 < n < self.full_bytes:
            return f"shapes {shapes} ({n} bytes) are not a chunk of {self.shapes}"
        want, got = list(self.shapes[0]), shapes[0]
        d = self.token_dim
        if len(got) != len(want) or got[:d] + got[d + 1 :] != want[:d] + want[d + 1 :]:
            return f"shape {got} is not a partial chunk of {want}"
        if n != got[d] * self.token_bytes:
            return f"{n} bytes for {got[d]} tokens of {self.token_bytes} bytes"
        return None

    def put_raw(
        self, client: StoreClient, keys: list[str], objs: Sequence[Any], replicas: int
    ) -> list[bool]:
        addrs = [obj.data_ptr for obj in objs]
        sizes = [obj.get_size() for obj in objs]
        results = client.batch_put_from(keys, addrs, sizes, replicas=replicas)
        return self._put_results(keys, results)

    def get_raw(self, client: StoreClient, keys: list[str]) -> list[Any | None]:
        """Full-chunk objects read in place, narrowed to the tokens read; None for a miss."""
        objs: list[Any] = []
        try:
            for _ in keys:
                obj = self._allocate(self.shapes, self.dtypes, self.fmt)
                if obj is None:
                    self.warn("alloc", "no LMCache CPU memory for %d remote chunk(s)", len(keys))
                    break
                objs.append(obj)
            if not objs:
                return [None] * len(keys)
            got = client.batch_get_into(
                keys[: len(objs)],
                [o.data_ptr for o in objs],
                [o.get_size() for o in objs],
            )
        except BaseException:
            release(objs)
            raise
        out: list[Any | None] = [None] * len(keys)
        for i, (obj, n) in enumerate(zip(objs, got, strict=False)):
            if isinstance(n, int) and n > 0:
                try:
                    out[i] = self.reshape(obj, n)
                    continue
                except ValueError as exc:
                    self.warn("get", "chunk %r unusable (%d bytes): %s", keys[i], n, exc)
            elif isinstance(n, MooncakeConnectorsError):
                self.warn("get", "get %r failed: %s", keys[i], n)
            obj.ref_count_down()
        return out

    # -- FRAMED -----------------------------------------------------------------------------
    def put_framed(
        self, client: StoreClient, keys: list[str], objs: Sequence[Any], replicas: int
    ) -> list[bool]:
        from lmcache.v1.protocol import RemoteMetadata

        values = []
        for obj in objs:
            n = obj.get_size()
            head = RemoteMetadata(
                n, obj.get_shapes(), obj.get_dtypes(), obj.get_memory_format()
            ).serialize()
            value = bytearray(len(head) + n)
            value[: len(head)] = head
            value[len(head) :] = memoryview(obj.byte_array).cast("B")
            values.append(value)
        return self._put_results(keys, client.put_batch(keys, values, replicas=replicas))

    def get_framed(self, client: StoreClient, keys: list[str]) -> list[Any | None]:
        from lmcache.v1.protocol import get_remote_metadata_bytes

        head = get_remote_metadata_bytes()
        out: list[Any | None] = []
        try:
            for key, value in zip(keys, client.get_batch(keys), strict=True):
                out.append(None if value is None else self._unframe(key, value, head))
        except BaseException:
            release(out)
            raise
        return out

    def _unframe(self, key: str, value: bytes, head: int) -> Any | None:
        from lmcache.v1.protocol import RemoteMetadata

        obj = None
        try:
            meta = RemoteMetadata.deserialize(value[:head])
            if len(value) != head + meta.length:
                raise ValueError(f"{len(value)} bytes, header says {head}+{meta.length}")
            obj = self._allocate(meta.shapes, meta.dtypes, meta.fmt)
            if obj is None:
                self.warn("alloc", "no LMCache CPU memory for remote chunk %r", key)
                return None
            if obj.get_size() != meta.length:
                raise ValueError(f"object of {obj.get_size()} bytes for {meta.length}")
            memoryview(obj.byte_array).cast("B")[:] = memoryview(value)[head:]
            return obj
        except (ValueError, TypeError, KeyError, IndexError, struct.error) as exc:
            # a bad header, a format the allocator refuses, a read-only object
            self.warn("get", "chunk %r unusable: %s", key, exc)
            if obj is not None:
                obj.ref_count_down()
            return None

    # -- shared -----------------------------------------------------------------------------
    def _put_results(self, keys: list[str], results: Sequence[Any]) -> list[bool]:
        """Per key: stored (an existing copy counts: chunk keys name their content)."""
        ok = []
        for key, err in zip(keys, results, strict=True):
            if err is None or isinstance(err, ObjectExists):
                ok.append(True)
            else:
                self.warn("put", "put %r failed: %s", key, err)
                ok.append(False)
        return ok
