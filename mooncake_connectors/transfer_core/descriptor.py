"""Segment descriptors: what a process publishes so peers can reach its registered memory.

A descriptor already carries the fields later transports need (per-NIC RDMA keys, CUDA device and
IPC handle), so adding those transports changes no wire format.
"""

from __future__ import annotations

import functools
import os
import socket

import msgspec

from ..errors import MetadataError
from ..types import LocationKind, parse_location

# Bumped on any incompatible change of descriptors or frames; peers refuse other versions.
PROTOCOL_VERSION = 1


class RegionDesc(msgspec.Struct, frozen=True, omit_defaults=True):
    addr: int
    length: int
    location: str = "cpu:0"
    access: int = 3  # types.Access bits
    # Same-host fast path: a memfd backing the region, mapped by peers through /proc/PID/fd/N.
    memfd: int = -1
    memfd_inode: int = 0
    memfd_offset: int = 0
    # RDMA: NIC name -> rkey. CUDA: device index and IPC handle bytes.
    rdma_rkeys: dict[str, int] = {}
    cuda_device: int = -1
    cuda_ipc_handle: bytes = b""

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

    def find_region(self, addr: int, length: int) -> RegionDesc | None:
        for r in self.regions:
            if r.contains(addr, length):
                return r
        return None


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
