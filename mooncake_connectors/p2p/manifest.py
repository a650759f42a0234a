"""What a published object is: files cut into chunks, each with its hash, under one version.

A chunk never crosses a file boundary, so every chunk is one contiguous range of one registered
region (the mmap of a file, or one tensor) on every holder. Hashes are SHA-256: the fetcher
checks each chunk before it keeps or serves it, so a holder with bad bytes cannot spread them.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable
from pathlib import Path

import msgspec

from ..errors import ConfigError, MooncakeConnectorsError

DEFAULT_CHUNK_SIZE = 4 << 20
MARKER = ".mooncake-p2p.json"  # a fetch's own bookkeeping in its destination; never published
OWN_PREFIX = ".mooncake-p2p"  # the marker, its temp file, the vLLM loader's lock: never published
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class P2PError(MooncakeConnectorsError):
    """Base class of the P2P store's errors."""


class ObjectNotFound(P2PError):
    """No object (or no such version) is published under this name."""


class FetchFailed(P2PError):
    """A fetch could not get every chunk before its deadline."""


class FileEntry(msgspec.Struct, frozen=True):
    """One file of the object (or one tensor of a state_dict: ``path`` is its key)."""

    path: str
    size: int
    first_chunk: int  # index of its first chunk in Manifest.chunks
    dtype: str = ""  # set for tensors only
    shape: list[int] = []


class ChunkEntry(msgspec.Struct, frozen=True, array_like=True):
    file: int  # index into Manifest.files
    offset: int
    length: int
    sha256: str


class Manifest(msgspec.Struct, frozen=True):
    name: str
    version: int
    chunk_size: int
    total_size: int
    files: list[FileEntry]
    chunks: list[ChunkEntry]

    def chunks_of(self, file_index: int) -> range:
        f = self.files[file_index]
        n = -(-f.size // self.chunk_size)
        return range(f.first_chunk, f.first_chunk + n)


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Manifest)


def encode_manifest(m: Manifest) -> bytes:
    return _encoder.encode(m)


def decode_manifest(data: bytes) -> Manifest:
    try:
        m = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise P2PError(f"malformed manifest: {exc}") from exc
    check_manifest(m)
    return m


def check_manifest(m: Manifest) -> None:
    """Reject a manifest whose tables disagree (it names where bytes land on the fetcher)."""
    check_name(m.name)
    if m.chunk_size <= 0 or m.version < 1:
        raise P2PError(f"manifest of {m.name!r}: bad chunk size or version")
    check_paths(f.path for f in m.files)
    total = count = 0
    for i, f in enumerate(m.files):
        if f.size < 0 or f.first_chunk != count or m.chunks_of(i).stop > len(m.chunks):
            raise P2PError(f"manifest of {m.name!r}: bad entry for {f.path!r}")
        off = 0
        for c in m.chunks_of(i):
            ch = m.chunks[c]
            if ch.file != i or ch.offset != off or not 0 < ch.length <= m.chunk_size:
                raise P2PError(f"manifest of {m.name!r}: chunk {c} does not tile {f.path!r}")
            off += ch.length
            count += 1
        if off != f.size:
            raise P2PError(f"manifest of {m.name!r}: chunks of {f.path!r} do not add up")
        total += f.size
    if total != m.total_size or count != len(m.chunks):
        raise P2PError(f"manifest of {m.name!r}: total size does not add up")


def check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigError(
            f"object name {name!r} must be 1-128 characters of letters, digits, '.', '_', '-'",
            field="name",
        )
    return name


def safe_relpath(path: str) -> str:
    """A relative path that stays inside the destination directory."""
    p = Path(path)
    if not path or p.is_absolute() or ".." in p.parts or "\\" in path or "\x00" in path:
        raise P2PError(f"unsafe path {path!r} in manifest")
    return path


_NAME_MAX = 255  # bytes of one path component (Linux NAME_MAX)
_PATH_MAX = 4095  # bytes of a whole path under the destination


def check_paths(paths: Iterable[str]) -> None:
    """Every path is a canonical relative file path a fetch can create: no empty or ``.``
    component (so ``dir/``, ``a//b``, ``.`` and ``./a`` are refused and no two spellings name
    one file), components the filesystem takes, none of ours (the fetch's marker, temp and
    lock files), no path twice, and no file where another path needs a directory."""
    files: set[str] = set()
    dirs: set[str] = set()
    for path in paths:
        safe_relpath(path)
        parts = path.split("/")
        why = ""
        if any(not c or c == "." for c in parts):
            why = "is not a canonical relative path (an empty or '.' component)"
        elif any(len(c.encode("utf-8", "surrogatepass")) > _NAME_MAX for c in parts):
            why = f"has a component longer than {_NAME_MAX} bytes"
        elif len(path.encode("utf-8", "surrogatepass")) > _PATH_MAX:
            why = f"is longer than {_PATH_MAX} bytes"
        elif any(c.startswith(OWN_PREFIX) for c in parts):
            why = f"uses the name {OWN_PREFIX}*, kept for the fetch's own files"
        elif path in files:
            why = "appears twice"
        elif path in dirs:
            why = "is a file and a directory of another path"
        prefixes = ["/".join(parts[:n]) for n in range(1, len(parts))]
        if not why and any(d in files for d in prefixes):
            why = "lies under a path that is a file"
        if why:
            raise P2PError(f"manifest path {path[:300]!r} {why}")
        files.add(path)
        dirs.update(prefixes)


def digest(data: memoryview | bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def list_files(sources: Iterable[str | os.PathLike[str]]) -> list[tuple[str, Path]]:
    """(relative name, path) of every regular file in ``sources``, sorted by name.

    A directory contributes its files under their paths relative to it; a file its base name.
    """
    out: dict[str, Path] = {}
    for src in sources:
        p = Path(src)
        if p.is_dir():
            for f in sorted(p.rglob("*")):
                if f.is_file() and not f.name.startswith(OWN_PREFIX):
                    out.setdefault(f.relative_to(p).as_posix(), f)
        elif p.is_file():
            out.setdefault(p.name, p)
        else:
            raise ConfigError(f"{str(src)!r} is neither a file nor a directory", field="sources")
    if not out:
        raise ConfigError("nothing to publish: the sources hold no files", field="sources")
    return sorted(out.items())


def build_manifest(
    name: str,
    version: int,
    items: list[tuple[str, memoryview, str, list[int]]],
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Manifest:
    """Cut ``items`` (path, bytes, dtype, shape) into chunks and hash each."""
    check_name(name)
    if chunk_size <= 0:
        raise ConfigError("chunk_size must be positive", field="chunk_size")
    files: list[FileEntry] = []
    chunks: list[ChunkEntry] = []
    for i, (path, data, dtype, shape) in enumerate(items):
        files.append(FileEntry(path, len(data), len(chunks), dtype, shape))
        for off in range(0, len(data), chunk_size):
            piece = data[off : off + chunk_size]
            chunks.append(ChunkEntry(i, off, len(piece), digest(piece)))
    total = sum(f.size for f in files)
    return Manifest(name, version, chunk_size, total, files, chunks)


__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "MARKER",
    "ChunkEntry",
    "FetchFailed",
    "FileEntry",
    "Manifest",
    "ObjectNotFound",
    "P2PError",
    "build_manifest",
    "check_manifest",
    "check_name",
    "check_paths",
    "decode_manifest",
    "digest",
    "encode_manifest",
    "list_files",
    "safe_relpath",
]
