"""Small shared value types: enums for operations, rights and status."""

from __future__ import annotations

import enum


class TransferOp(enum.IntEnum):
    READ = 0
    WRITE = 1


class Access(enum.IntFlag):
    NONE = 0
    READ = 1
    WRITE = 2
    READ_WRITE = 3


class TransferStatus(enum.IntEnum):
    PENDING = 0
    COMPLETED = 1
    FAILED = 2
    TIMEOUT = 3


class LocationKind(enum.Enum):
    CPU = "cpu"
    CUDA = "cuda"
    FILE = "file"


def parse_location(location: str) -> tuple[LocationKind, str]:
    """Split ``cpu:0`` / ``cuda:1`` / ``file:/path`` into (kind, rest); raise ValueError if bad."""
    kind, sep, rest = location.partition(":")
    try:
        lk = LocationKind(kind)
    except ValueError:
        raise ValueError(
            f"unknown memory location {location!r}: expected cpu:N, cuda:N or file:PATH"
        ) from None
    if not sep or not rest:
        raise ValueError(f"memory location {location!r} lacks its ':' part")
    if lk in (LocationKind.CPU, LocationKind.CUDA) and not rest.isdigit():
        raise ValueError(f"memory location {location!r}: device index must be a number")
    return lk, rest
