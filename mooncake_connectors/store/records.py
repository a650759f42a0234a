"""The master's records: what it keeps per key, per segment, per server — kept small."""

from __future__ import annotations

from typing import Any

import msgspec

from .allocator import RangeAllocator
from .protocol import Part

SHIFT = 40
MASK = (1 << SHIFT) - 1
HARD = 1
SOFT = 2
SPILLING = 4
PROMOTING = 8
PIN = HARD | SOFT


class Obj(msgspec.Struct, gc=False):
    size: int
    locs: Any  # int | tuple[int, ...]; -1 = no copy
    meta: int  # nrep << 8 | flags
    lease: float = 0.0
    extra: Extra | None = None


class Extra(msgspec.Struct, gc=False):
    ttl: float = 0.0  # monotonic expiry, 0 = none
    soft_until: float = 0.0
    # on SSD: per stripe (server client id, file id); ("", -1) for a stripe not re-reported yet
    disk: tuple[tuple[str, int], ...] | None = None
    ssd_hits: int = 0  # reads served from SSD since it was spilled (promotion trigger)


class Pending(msgspec.Struct, gc=False):
    put_id: int
    size: int
    locs: list[int]
    nrep: int
    flags: int
    ttl_ms: int
    deadline: float


# What one key costs the master beyond its characters (struct, dict slot, string header), for
# MasterConfig.key_budget; measured near 200 bytes per key by ``bench store-memory``.
KEY_OVERHEAD = 256


def key_cost(key: str) -> int:
    return len(key) + KEY_OVERHEAD


class Segment:
    __slots__ = ("alloc", "base", "host_id", "id", "name", "server", "size")

    def __init__(self, sid: int, name: str, base: int, size: int, server: Server) -> None:
        self.id = sid
        self.name = name
        self.base = base
        self.size = size
        self.server = server
        self.host_id = ""
        self.alloc: RangeAllocator | None = None  # None while its holdings are re-reported


class Server:
    """Whoever mounted memory: a store server or an embedded client."""

    __slots__ = (
        "alive",
        "client_id",
        "conn",
        "disk",
        "dropfiles",
        "endpoint",
        "last_seen",
        "ops",
        "parts",
        "promotes",
        "segments",
        "spills",
        "ssd_size",
        "ssd_used",
    )

    def __init__(self, client_id: str, conn: Any, now: float) -> None:
        self.client_id = client_id
        self.conn = conn
        self.last_seen = now
        self.alive = True
        self.segments: list[Segment] = []
        self.endpoint = ""
        self.ssd_size = 0
        self.ssd_used = 0
        # file id -> (key, bytes counted against ssd_size), least recently read first
        self.disk: dict[int, tuple[str, int]] = {}
        self.ops: list[Part | str] = []  # holdings delta to push
        self.spills: list[tuple[int, int, int]] = []
        self.dropfiles: list[int] = []
        self.promotes: list[tuple[int, int, int]] = []
        self.parts: list[Part] | None = None  # re-reported holdings being collected


def pack(seg: int, off: int) -> int:
    return seg << SHIFT | off
