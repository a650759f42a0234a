"""``P2PStore``: one process's place in the swarm (publish, fetch, unpublish, list).

    with P2PStore(EngineConfig(metadata="http://127.0.0.1:8080/metadata")) as node:
        node.publish("llama-8b", ["/models/llama-8b"])     # serves until closed
    with P2PStore(cfg) as node:
        stats = node.fetch("llama-8b", "/local/llama-8b")  # and serves it onward while open

A process holds what it published or fetched for as long as its ``P2PStore`` is open; closing it
withdraws its holder records. Everything it serves is registered zero-copy: the mmap of a file,
or the tensor itself.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from ..config import EngineConfig
from ..errors import ConfigError
from ..transfer_core.engine import TransferEngine
from ..transfer_core.memory import Region
from ..transfer_core.metadata import scheme_of
from ..types import Access
from .fetch import Fetcher, FetchStats
from .manifest import (
    DEFAULT_CHUNK_SIZE,
    MARKER,
    Manifest,
    P2PError,
    build_manifest,
    check_paths,
    list_files,
    safe_relpath,
)
from .records import Catalog, bitmap
from .serve import Holder

Sources = str | os.PathLike[str] | Iterable[str | os.PathLike[str]] | Mapping[str, Any]
Dest = str | os.PathLike[str] | Mapping[str, Any]


@dataclass
class ObjectInfo:
    name: str
    version: int
    files: int
    total_size: int
    chunks: int
    holders: int
    complete_holders: int


class _Marker(msgspec.Struct):
    name: str
    version: int
    complete: bool


class P2PStore:
    """Publishes and fetches objects; serves what it holds while open."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        engine: TransferEngine | None = None,
        rate: float | None = None,
        serve_cap: int | None = None,
        lease: float = 10.0,
    ) -> None:
        """``rate``: egress budget in bytes/s for grants; ``serve_cap``: bytes per peer."""
        self._own_engine = engine is None
        self.engine = engine if engine is not None else TransferEngine(config or EngineConfig())
        if scheme_of(self.engine.config.metadata) == "p2p":
            raise ConfigError(
                "the P2P store keeps manifests in the metadata service: use http://, etcd:// "
                "or memory://, not p2p",
                field="metadata",
            )
        if rate is not None and rate <= 0:
            raise ConfigError("rate must be positive", field="rate")
        if lease <= 0:
            raise ConfigError("lease must be positive", field="lease")
        self.engine.start()
        assert self.engine.metadata is not None
        self.catalog = Catalog(self.engine.metadata)
        self.holder = Holder(self.engine, self.catalog, rate=rate, serve_cap=serve_cap, lease=lease)
        self._keep: list[Any] = []  # mmaps and files that back registered regions
        self._regions: list[Region] = []
        self._mmaps: dict[int, mmap.mmap] = {}

    # -- publish ----------------------------------------------------------------------------
    def publish(
        self, name: str, sources: Sources, *, chunk_size: int = DEFAULT_CHUNK_SIZE
    ) -> Manifest:
        """Register ``sources`` zero-copy, write a new version's manifest, hold every chunk.

        ``sources``: a file, a directory, a list of them, or a mapping of names to tensors or
        arrays (a state_dict; contiguous CPU memory).
        """
        items: list[tuple[str, memoryview, str, list[int]]] = []
        regions: list[Region | None] = []
        if isinstance(sources, Mapping):
            check_paths(sources)  # before anything is registered
            for key in sorted(sources):
                t = sources[key]
                dtype = str(getattr(t, "dtype", ""))
                shape = [int(x) for x in getattr(t, "shape", ())]
                empty = int(getattr(t, "nbytes", 1)) == 0
                held = None if empty else self._register(t, Access.READ)
                items.append((key, held.mv if held else memoryview(b""), dtype, shape))
                regions.append(held)
        else:
            srcs = [sources] if isinstance(sources, (str, os.PathLike)) else list(sources)
            for rel, path in list_files(srcs):
                region = self._map(path, writable=False)
                items.append((rel, region.mv if region else memoryview(b""), "", []))
                regions.append(region)
        version = self.catalog.next_version(name)
        m = build_manifest(name, version, items, chunk_size)
        have = bitmap(len(m.chunks))
        for i in range(len(m.chunks)):
            have[i // 8] |= 1 << (i % 8)
        self.catalog.put_manifest(m)
        self.holder.add(m, regions, have, complete=True)
        return m

    # -- fetch ------------------------------------------------------------------------------
    def fetch(
        self,
        name: str,
        dest: Dest,
        *,
        version: int | None = None,
        k: int = 4,
        parallel: int = 8,
        timeout: float = 600.0,
        share: bool = True,
        on_progress: Callable[[FetchStats], None] | None = None,
    ) -> FetchStats:
        """Fetch ``name`` (its current version unless pinned) into a directory or buffers.

        A directory keeps what a killed fetch left: those chunks are re-verified, not refetched.
        The fetched object stays served from this process until :meth:`close` (with
        ``share=False`` it is never served: each chunk comes from the holders alone, the way a
        plain download would, which is what the benchmark compares against).
        """
        if k < 1 or parallel < 1:
            raise ConfigError("k and parallel must be at least 1", field="k")
        m = self.catalog.manifest(name, version)
        into_dir = not isinstance(dest, Mapping)
        existed: set[int] = set()  # files a killed fetch (or anyone) left: verified, not refetched
        if into_dir:
            assert not isinstance(dest, Mapping)
            root = Path(dest)
            root.mkdir(parents=True, exist_ok=True)
            _write_marker(root, _Marker(m.name, m.version, False))
            regions: list[Region | None] = []
            for i, f in enumerate(m.files):
                path = root / safe_relpath(f.path)
                if path.is_file() and path.stat().st_size > 0:
                    existed.add(i)
                try:
                    regions.append(self._prepare(path, f.size))
                except OSError as exc:  # a full disk, a directory in the way, no permission
                    raise P2PError(f"cannot create {str(path)!r} for {m.name!r}: {exc}") from exc
        else:
            assert isinstance(dest, Mapping)
            regions = []
            for f in m.files:
                if f.size == 0:
                    regions.append(None)
                    continue
                if f.path not in dest:
                    raise ConfigError(f"no destination buffer for {f.path!r}", field="dest")
                region: Region | None = self._register(dest[f.path], Access.READ)
                assert region is not None
                if region.length != f.size:
                    raise ConfigError(
                        f"destination for {f.path!r} holds {region.length} bytes, "
                        f"the object {f.size}",
                        field="dest",
                    )
                regions.append(region)
        fetcher = Fetcher(
            self.engine,
            self.catalog,
            self.holder,
            m,
            regions,
            k=k,
            parallel=parallel,
            share=share,
            on_progress=on_progress,
        )
        have = fetcher.verify_existing(existed) if into_dir else bitmap(len(m.chunks))
        stats = fetcher.run(have, timeout)
        if into_dir:
            for r in regions:
                if r is not None:
                    self._mmaps[r.addr].flush()
            _write_marker(Path(dest), _Marker(m.name, m.version, True))  # type: ignore[arg-type]
        return stats

    # -- lifecycle --------------------------------------------------------------------------
    def unpublish(self, name: str) -> int:
        """Forget ``name``: every version and holder record. Holders stop at their next renewal."""
        return self.catalog.unpublish(name)

    def ls(self) -> list[ObjectInfo]:
        out = []
        for name, version in sorted(self.catalog.names().items()):
            try:
                m = self.catalog.manifest(name, version)
            except P2PError:
                continue
            recs = self.catalog.holders(name, version)
            out.append(
                ObjectInfo(
                    name,
                    version,
                    len(m.files),
                    m.total_size,
                    len(m.chunks),
                    len(recs),
                    sum(r.complete for r in recs),
                )
            )
        return out

    def holder_counts(self, name: str, version: int) -> list[int]:
        """How many live holders have each chunk (tests and progress displays)."""
        m = self.catalog.manifest(name, version)
        recs = self.catalog.holders(name, version)
        return [
            sum(bool(r.have[i // 8] >> (i % 8) & 1) for r in recs if i // 8 < len(r.have))
            for i in range(len(m.chunks))
        ]

    def close(self) -> None:
        self.holder.close()
        for r in self._regions:
            with contextlib.suppress(Exception):
                self.engine.unregister(r)
        if self._own_engine:
            self.engine.close()
        for obj in reversed(self._keep):
            with contextlib.suppress(BufferError, ValueError, OSError):
                obj.close()
        self._keep.clear()

    def __enter__(self) -> P2PStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- memory -----------------------------------------------------------------------------
    def _register(self, obj: Any, access: Access) -> Region:
        region = self.engine.register(obj, access=access)
        self._regions.append(region)
        return region

    def _map(self, path: Path, *, writable: bool) -> Region | None:
        size = path.stat().st_size
        if size == 0:
            return None  # nothing to map or to serve
        fh = open(path, "r+b" if writable else "rb")  # noqa: SIM115 - kept open while served
        self._keep.append(fh)
        mm = mmap.mmap(
            fh.fileno(), size, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
        )
        self._keep.append(mm)
        region = self._register(mm, Access.READ)
        self._mmaps[region.addr] = mm
        return region

    def _prepare(self, path: Path, size: int) -> Region | None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "ab") as fh:  # create it if missing, keep what a killed fetch left
            if os.fstat(fh.fileno()).st_size != size:
                fh.truncate(size)
        return self._map(path, writable=True)


def _write_marker(root: Path, marker: _Marker) -> None:
    tmp = root / (MARKER + ".tmp")
    tmp.write_bytes(msgspec.json.encode(marker))
    os.replace(tmp, root / MARKER)


def read_marker(root: str | os.PathLike[str]) -> tuple[str, int, bool] | None:
    """(name, version, complete) of the fetch into ``root``, or None if none was made there."""
    try:
        m = msgspec.json.decode((Path(root) / MARKER).read_bytes(), type=_Marker)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None
    return m.name, m.version, m.complete


__all__ = ["ObjectInfo", "P2PStore", "read_marker"]
