"""Segment descriptors: what a process publishes so peers can reach its registered memory.

The engine fills the fields every transport reads (address, length, location, access, epoch,
endpoints); each transport adds its own through ``Transport.describe_region`` and
``describe_segment`` (memfd, CUDA IPC handle, RDMA rkeys and GIDs), merged by
:func:`merge_fields`. Fields a peer does not know are ignored on decode, and fields left at their
default are not sent, so a transport adds fields without a new protocol version.
"""

from __future__ import annotations

import functools
import os
import socket
from collections.abc import Iterable, Mapping
from typing import TypeVar

import msgspec

from ..errors import MetadataError, PluginError
from ..types import LocationKind, parse_location

# Bumped on any incompatible change of descriptors or frames; peers refuse other versions.
PROTOCOL_VERSION = 1


class CudaExport(msgspec.Struct, frozen=True, omit_defaults=True):
    """One piece of a GPU region, shareable with processes of the same host.

    ``handle`` exports the whole allocation (``alloc_size`` bytes) that holds the piece; the
    piece is ``length`` bytes at ``alloc_offset`` into it and ``region_offset`` into the region.
    kind "ipc": a CUipcMemHandle; kind "fd": a VMM allocation's POSIX fd number in the owner.
    ``device_uuid`` names the GPU across processes (ordinals differ under CUDA_VISIBLE_DEVICES).
    """

    kind: str
    handle: bytes
    alloc_size: int
    alloc_offset: int
    region_offset: int
    length: int
    device_uuid: str = ""


class RegionDesc(msgspec.Struct, frozen=True, omit_defaults=True):
    addr: int
    length: int
    location: str = "cpu:0"
    access: int = 3  # types.Access bits
    # Same-host fast path: a memfd backing the region, mapped by peers through /proc/PID/fd/N.
    memfd: int = -1
    memfd_inode: int = 0
    memfd_offset: int = 0
    # RDMA: NIC name -> rkey. CUDA: the owner's device ordinal, and the region's exports
    # (cuda_ipc), in region order, covering it end to end.
    rdma_rkeys: dict[str, int] = {}
    # NIC name -> the iova the region starts at in its MR, where it is not ``addr`` (dma-buf)
    rdma_iova: dict[str, int] = {}
    # NIC name -> 1 for the owner's NICs nearest the region (PCIe/NUMA), when not all are
    rdma_near: dict[str, int] = {}
    cuda_device: int = -1
    cuda_exports: list[CudaExport] = []

    @property
    def end(self) -> int:
        return self.addr + self.length

    @property
    def kind(self) -> LocationKind:
        """The memory kind of ``location`` (validated when the descriptor is built or decoded)."""
        return _location_kind(self.location)

    def contains(self, addr: int, length: int) -> bool:
        return self.addr <= addr and addr + length <= self.end


class SegmentDesc(msgspec.Struct, frozen=True, omit_defaults=True):
    name: str
    host_id: str
    pid: int
    version: int = PROTOCOL_VERSION
    epoch: int = 0  # bumped on every register/unregister
    endpoints: dict[str, str] = {}  # transport name -> address, e.g. {"tcp": "127.0.0.1:4567"}
    regions: list[RegionDesc] = []
    auth: bool = False
    # memfd (fd, inode) of an 8-byte page holding the live epoch; same-host peers watch it.
    epoch_memfd: int = -1
    epoch_memfd_inode: int = 0
    rdma_gids: dict[str, str] = {}  # NIC name -> GID, for the rdma transport
    rdma_lids: dict[str, int] = {}  # NIC name -> LID (InfiniBand; 0 on RoCE)

    def find_region(self, addr: int, length: int) -> RegionDesc | None:
        for r in self.regions:
            if r.contains(addr, length):
                return r
        return None


# Fields the engine owns; a transport's describe_* may not set them.
ENGINE_REGION_FIELDS = frozenset({"addr", "length", "location", "access", "cuda_device"})
ENGINE_SEGMENT_FIELDS = frozenset(
    {"name", "host_id", "pid", "version", "epoch", "endpoints", "regions", "auth"}
)

D = TypeVar("D", RegionDesc, SegmentDesc)


def merge_fields(
    desc: D,
    contributions: Iterable[tuple[str, Mapping[str, object]]],
    engine_fields: frozenset[str],
) -> D:
    """``desc`` with the fields each (transport name, fields) pair contributes.

    A field the engine owns, a name the descriptor lacks, or one field set by two transports is
    a PluginError naming both; dict fields are merged key by key (two NIC drivers may each add
    rkeys) and only a key set twice collides. Values are type-checked by the descriptor's own
    decoder, so a wrong type fails here, at publish, rather than on a peer.
    """
    merged: dict[str, object] = {}
    owner: dict[str, str] = {}
    known = desc.__struct_fields__
    for transport, fields in contributions:
        for key, value in fields.items():
            if key in engine_fields or key not in known:
                why = "is the engine's own" if key in engine_fields else "is not a field"
                raise PluginError(
                    f"transport {transport!r} describes {type(desc).__name__}.{key}, which {why}",
                    first=transport,
                )
            prev = merged.get(key)
            if prev is None:
                merged[key], owner[key] = value, transport
            elif prev == value:  # two transports that publish the same fact agree
                owner[key] = f"{owner[key]}+{transport}"
            elif isinstance(prev, dict) and isinstance(value, dict) and not prev.keys() & value:
                merged[key] = {**prev, **value}
                owner[key] = f"{owner[key]}+{transport}"
            else:
                raise PluginError(
                    f"transports {owner[key]!r} and {transport!r} both describe "
                    f"{type(desc).__name__}.{key}",
                    first=owner[key],
                    second=transport,
                )
    if not merged:
        return desc
    out = msgspec.structs.replace(desc, **merged)
    try:
        # the round trip also turns plain values (a dict for a struct) into their types
        return msgspec.msgpack.decode(_encoder.encode(out), type=type(desc))
    except (msgspec.ValidationError, TypeError) as exc:
        raise PluginError(
            f"{type(desc).__name__} fields from {sorted(set(owner.values()))}: {exc}"
        ) from None


@functools.lru_cache(maxsize=256)
def _location_kind(location: str) -> LocationKind:
    # Transports ask on every reachability check; a process sees a handful of distinct
    # locations, so each string is parsed once.
    return parse_location(location)[0]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(SegmentDesc)


def encode_segment(desc: SegmentDesc) -> bytes:
    return _encoder.encode(desc)


def decode_segment(data: bytes, *, source: str = "") -> SegmentDesc:
    try:
        desc = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MetadataError(f"undecodable segment descriptor: {exc}", source=source) from exc
    if desc.version != PROTOCOL_VERSION:
        raise MetadataError(
            f"segment {desc.name!r} speaks protocol version {desc.version}, "
            f"this process speaks {PROTOCOL_VERSION}",
            source=source,
        )
    for region in desc.regions:
        try:
            _location_kind(region.location)
        except ValueError as exc:
            raise MetadataError(f"segment {desc.name!r}: {exc}", source=source) from None
    return desc


@functools.cache
def host_id() -> str:
    """Identify (host, boot, pid namespace): equal ids mean shm/process_vm can reach each other."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
    except OSError:
        boot = "noboot"
    try:
        pidns = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        pidns = "nopidns"
    return f"{socket.gethostname()}/{boot}/{pidns}"
