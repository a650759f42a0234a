"""Manifests and holder records in the transfer engine's metadata backend.

Keys (the backend adds its own prefix):

    p2p/objects/NAME/current             the newest version number (ASCII)
    p2p/objects/NAME/v/VERSION           that version's manifest (JSON)
    p2p/holders/NAME/VERSION/HOLDER      one holder's record (msgpack): where to ask, what it has

A holder rewrites its record when it gets a chunk and at least every ``lease / 3`` seconds; a
record older than its lease is a dead holder's and readers skip it (and delete it). Lease ages
are measured on wall clocks, so hosts must agree on the time to within a fraction of the lease
(and within ``CLOCK_SKEW``: a record renewed further in the future is invalid).
"""

from __future__ import annotations

import contextlib
import time

import msgspec

from ..errors import MetadataError
from ..transfer_core.metadata import MetadataBackend
from .manifest import Manifest, ObjectNotFound, check_name, decode_manifest, encode_manifest

ROOT = "p2p/"
# A record renewed later than now plus this is invalid (a clock that far ahead, or a forgery
# that would never expire): skipped and deleted like an expired one.
CLOCK_SKEW = 5.0
MAX_LEASE = 3600.0  # s; a longer claimed lease counts as this long


class HolderRecord(msgspec.Struct, frozen=True):
    holder: str  # unique per holder process and object
    endpoint: str  # host:port of its grant server
    segment: str  # its transfer-engine segment
    have: bytes  # bitmap of the chunks it holds, chunk i at bit i % 8 of byte i // 8
    renewed: float  # wall-clock time of the last write
    lease: float  # seconds after ``renewed`` at which it counts as dead
    complete: bool = False


_rec_enc = msgspec.msgpack.Encoder()
_rec_dec = msgspec.msgpack.Decoder(HolderRecord)


def bitmap(n: int) -> bytearray:
    return bytearray(-(-n // 8))


def has(bits: bytes | bytearray, i: int) -> bool:
    return i // 8 < len(bits) and bool(bits[i // 8] >> (i % 8) & 1)


def set_bit(bits: bytearray, i: int) -> None:
    bits[i // 8] |= 1 << (i % 8)


def merge(a: bytes, b: bytes) -> bytes:
    """Union of two bitmaps (a holder only gains chunks, so news never removes one)."""
    n = max(len(a), len(b))
    return bytes(x | y for x, y in zip(a.ljust(n, b"\0"), b.ljust(n, b"\0"), strict=True))


def count(bits: bytes | bytearray) -> int:
    return sum(bin(b).count("1") for b in bits)


def _object(name: str) -> str:
    return f"{ROOT}objects/{check_name(name)}/"


def _holders(name: str, version: int) -> str:
    return f"{ROOT}holders/{check_name(name)}/{int(version)}/"


class Catalog:
    """Reads and writes the P2P store's records through one metadata backend."""

    def __init__(self, metadata: MetadataBackend) -> None:
        self.md = metadata

    # -- manifests --------------------------------------------------------------------------
    def next_version(self, name: str) -> int:
        raw = self.md.get(_object(name) + "current")
        return int(raw) + 1 if raw and raw.isdigit() else 1

    def put_manifest(self, m: Manifest) -> None:
        base = _object(m.name)
        self.md.put(f"{base}v/{m.version}", encode_manifest(m))
        self.md.put(base + "current", str(m.version).encode())

    def manifest(self, name: str, version: int | None = None) -> Manifest:
        base = _object(name)
        if version is None:
            raw = self.md.get(base + "current")
            if not raw or not raw.isdigit():
                raise ObjectNotFound(f"nothing is published as {name!r}", name=name)
            version = int(raw)
        data = self.md.get(f"{base}v/{int(version)}")
        if data is None:
            raise ObjectNotFound(f"{name!r} version {version} is not published", name=name)
        m = decode_manifest(data)
        if m.name != name or m.version != version:
            raise ObjectNotFound(f"{name!r} version {version}: the manifest names another object")
        return m

    def exists(self, name: str, version: int) -> bool:
        return self.md.get(f"{_object(name)}v/{int(version)}") is not None

    def names(self) -> dict[str, int]:
        """Every published name and its current version."""
        out: dict[str, int] = {}
        for key, val in self.md.list(ROOT + "objects/").items():
            rest = key.split(ROOT + "objects/", 1)[-1]
            name, _, leaf = rest.partition("/")
            if leaf == "current" and val.isdigit():
                out[name] = int(val)
        return out

    def unpublish(self, name: str) -> int:
        """Forget every version of ``name`` and its holder records; how many keys went."""
        gone = 0
        for prefix in (_object(name), f"{ROOT}holders/{check_name(name)}/"):
            for key in self.md.list(prefix):
                gone += self.md.delete(key)
        return gone

    # -- holders ----------------------------------------------------------------------------
    def put_holder(self, name: str, version: int, rec: HolderRecord) -> None:
        self.md.put(_holders(name, version) + rec.holder, _rec_enc.encode(rec))

    def drop_holder(self, name: str, version: int, holder: str) -> None:
        with contextlib.suppress(MetadataError):  # if not, its lease runs out anyway
            self.md.delete(_holders(name, version) + holder)

    def holders(self, name: str, version: int, *, now: float | None = None) -> list[HolderRecord]:
        """Live holders; the records of expired ones are deleted on the way."""
        now = time.time() if now is None else now
        out = []
        for key, raw in self.md.list(_holders(name, version)).items():
            try:
                rec = _rec_dec.decode(raw)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue  # not ours to judge further; it names no usable holder
            age = now - rec.renewed
            if not -CLOCK_SKEW <= age <= min(rec.lease, MAX_LEASE):  # NaN fails too
                with contextlib.suppress(MetadataError):
                    self.md.delete(key)
                continue
            out.append(rec)
        return out


__all__ = ["ROOT", "Catalog", "HolderRecord", "bitmap", "count", "has", "merge", "set_bit"]
