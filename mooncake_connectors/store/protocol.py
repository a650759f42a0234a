"""The store's control-plane messages and their framing.

A frame on the wire::

    u32 length (of what follows, little-endian)
    header: 2s magic "MS" | u8 protocol version | u8 flags | u64 request id
    body:   msgpack of one message (msgspec tagged array struct)

A reply carries its request's id. ``FLAG_NOTIFY`` marks a one-way request (no reply) and
``FLAG_PUSH`` an unsolicited master → server message. The version sits in the fixed header, so a
peer speaking another version gets a clear error before its body is decoded. Every field is
validated on decode (key length, sizes, batch length, replica count); a bad frame costs its
sender an ``Err`` reply, never the master.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import struct
from collections.abc import Iterator
from typing import Annotated, Union

import msgspec
from msgspec import Meta, Struct

from .config import MAX_OBJECT_SIZE, MAX_REPLICAS, MAX_SEGMENT_SIZE

PROTOCOL_VERSION = 2  # 2: per-stripe SSD copies (Loc.disk is a list), promotions
MAGIC = b"MS"
PREFIX = struct.Struct("<I")
HEADER = struct.Struct("<2sBBQ")
FLAG_NOTIFY = 1
FLAG_PUSH = 2
MAX_KEY = 4096
MAX_BATCH = 1 << 16
# Bytes an SSD file spends on its header (magic, version, length, CRC32): the master counts them
# against a server's SSD budget exactly as the server does.
SSD_HEADER = 32


class Code(enum.IntEnum):
    """Result codes, numbered like Mooncake's ErrorCode where one exists."""

    OK = 0
    INTERNAL = -1
    NO_SPACE = -200  # Mooncake NO_AVAILABLE_HANDLE
    INVALID = -600  # Mooncake INVALID_PARAMS
    NOT_FOUND = -704  # Mooncake OBJECT_NOT_FOUND
    EXISTS = -705  # Mooncake OBJECT_ALREADY_EXISTS
    TRANSFER_FAIL = -800  # Mooncake TRANSFER_FAIL
    RPC_FAIL = -900  # Mooncake RPC_FAIL
    NOT_LEADER = -1100
    PUT_EXPIRED = -1101
    UNAVAILABLE = -1102
    PROTOCOL = -1103
    UNKNOWN_CLIENT = -1104
    BUSY = -1105
    UNAUTHORIZED = -1106  # no or a wrong shared token; the connection is closed
    # PutStart: this put id already committed the key (its commit's answer was lost in a master
    # fail-over); nothing to write. Only a client that retries a put with its first id gets it.
    COMMITTED = -1107


Key = Annotated[str, Meta(min_length=1, max_length=MAX_KEY)]
Keys = Annotated[list[Key], Meta(max_length=MAX_BATCH)]
Size = Annotated[int, Meta(ge=0, le=MAX_OBJECT_SIZE)]
Id = Annotated[str, Meta(min_length=1, max_length=256)]
Copy = tuple[str, int]  # (segment name, address)


class Msg(Struct, array_like=True, tag=True):
    pass


# -- requests to the master ----------------------------------------------------------------
class Hello(Msg, tag="hello"):
    client_id: Id
    host_id: str = ""


class Mount(Msg, tag="mount"):
    """Offer memory [base, base+size) of segment ``segment`` (a transfer-engine segment)."""

    client_id: Id
    segment: Annotated[str, Meta(min_length=1, max_length=256)]
    base: Annotated[int, Meta(ge=0, le=(1 << 62))]
    size: Annotated[int, Meta(ge=4096, le=MAX_SEGMENT_SIZE)]
    host_id: str = ""
    endpoint: str = ""  # the server's load endpoint (SSD reads), "" if none
    ssd_size: Annotated[int, Meta(ge=0, le=1 << 50)] = 0
    recover: bool = False  # holdings follow in Report messages


class Unmount(Msg, tag="unmount"):
    client_id: Id
    segment: str


class Heartbeat(Msg, tag="hb"):
    client_id: Id


class PutStart(Msg, tag="put"):
    put_id: Annotated[int, Meta(ge=1, le=(1 << 63) - 1)]
    keys: Keys
    sizes: Annotated[list[Size], Meta(max_length=MAX_BATCH)]
    replicas: Annotated[int, Meta(ge=1, le=MAX_REPLICAS)] = 1
    ttl_ms: Annotated[int, Meta(ge=0)] = 0
    soft_pin: bool = False
    hard_pin: bool = False
    preferred: str = ""
    reserve: bool = False  # single key: also reserve room for the client's next put of this size


class PutEnd(Msg, tag="end"):
    put_id: int
    commit: Keys
    revoke: Keys


class PutReserved(Msg, tag="putr"):
    """Commit a put written into an earlier reservation: one round trip per put."""

    rid: int
    key: Key
    size: Size
    ttl_ms: Annotated[int, Meta(ge=0)] = 0
    soft_pin: bool = False
    hard_pin: bool = False
    refill: bool = True  # reserve the same again for the next put


class Get(Msg, tag="get"):
    keys: Keys


class Exists(Msg, tag="exists"):
    keys: Keys


class Remove(Msg, tag="rm"):
    keys: Keys
    force: bool = False


class RemoveAll(Msg, tag="rmall"):
    force: bool = False


class Part(Struct, array_like=True):
    """One stripe copy a server holds (what it re-reports to a new leader)."""

    key: str
    size: int
    nrep: int
    nst: int
    ridx: int
    sidx: int
    flags: int
    ttl_wall_ms: int  # absolute expiry (unix ms), 0 = none
    segment: str  # "" for a copy on the server's SSD
    offset: int  # inside the segment; the SSD file id for a disk copy
    put_id: int = 0  # the put (or reservation) that committed it, and when (unix ms):
    at_ms: int = 0  # a new leader then recognises a commit retried across the fail-over


class Report(Msg, tag="report"):
    client_id: Id
    parts: Annotated[list[Part], Meta(max_length=MAX_BATCH)]
    done: bool


# What one ``Part`` costs encoded besides its two strings: a 12-element array header, nine ints
# of at most 9 bytes and two string headers of at most 5 (msgpack), rounded up.
_PART_FIXED = 96
_REPORT_FIXED = 2048  # the Report around the parts: tag, client id (256 chars, 1 KiB), flag


def part_bytes(p: Part) -> int:
    """An upper bound of ``p``'s msgpack size (a UTF-8 character is at most 4 bytes; ASCII,
    the common key, is counted exactly without encoding it)."""
    k, s = p.key, p.segment
    return (
        _PART_FIXED
        + (len(k) if k.isascii() else 4 * len(k))
        + (len(s) if s.isascii() else 4 * len(s))
    )


def report_chunks(parts: list[Part], max_bytes: int) -> Iterator[tuple[list[Part], bool]]:
    """Split a server's holdings into ``(chunk, last)`` reports that each encode to at most
    ``max_bytes`` and hold at most ``MAX_BATCH`` parts: a chunk counted in parts alone exceeds
    the master's frame limit once keys are long, and the master then closes the connection
    and recovers nothing. One empty report when there is nothing to tell."""
    budget = max(1, max_bytes - _REPORT_FIXED)
    chunk: list[Part] = []
    used = 0
    for p in parts:
        n = part_bytes(p)
        if chunk and (used + n > budget or len(chunk) >= MAX_BATCH):
            yield chunk, False
            chunk, used = [], 0
        chunk.append(p)
        used += n
    yield chunk, True


class SpillDone(Msg, tag="spilled"):
    client_id: Id
    results: list[tuple[int, bool]]  # (file id, written)


class Promoted(Msg, tag="promoted"):
    client_id: Id
    results: list[tuple[int, bool]]  # (file id, read back into memory and checksum-verified)


class FilesLost(Msg, tag="lost"):
    """SSD files a server found damaged (bad checksum, length or header): their objects are gone."""

    client_id: Id
    file_ids: Annotated[list[int], Meta(max_length=MAX_BATCH)]


class Stats(Msg, tag="stats"):
    pass


# -- authentication (the first requests on a connection to a port that has a token) ---------
class AuthStart(Msg, tag="auth?"):
    pass


class Auth(Msg, tag="auth"):
    mac: Annotated[bytes, Meta(max_length=64)]  # HMAC-SHA256(token, "mcst-auth" + nonce)


# -- requests to a store server's load endpoint --------------------------------------------
class Load(Msg, tag="load"):
    file_id: int
    size: Size


class Release(Msg, tag="release"):
    token: int


Request = Union[  # noqa: UP007 - msgspec needs a runtime Union of tagged structs
    Hello,
    Mount,
    Unmount,
    Heartbeat,
    PutStart,
    PutEnd,
    PutReserved,
    Get,
    Exists,
    Remove,
    RemoveAll,
    Report,
    SpillDone,
    Promoted,
    FilesLost,
    Stats,
    Load,
    Release,
    AuthStart,
    Auth,
]


# -- replies -------------------------------------------------------------------------------
class Err(Msg, tag="err"):
    code: int
    message: str
    leader: str = ""


class Ok(Msg, tag="ok"):
    pass


class HelloOk(Msg, tag="hello_ok"):
    metadata: str
    stripe_size: int
    put_lease_ms: int
    read_lease_ms: int
    heartbeat_ms: int
    epoch: int
    max_frame: int = 0  # the largest control frame this master accepts (0: an older master)


class MountOk(Msg, tag="mount_ok"):
    seg_id: int


Spare = tuple[int, list[list[Copy]]]  # (reservation id, per stripe the copies to write)


class Allocs(Msg, tag="allocs"):
    codes: list[int]
    # per key, per stripe: the copies to write (one per replica)
    stripes: list[list[list[Copy]]]
    spare: Spare | None = None


class Committed(Msg, tag="committed"):
    code: int
    spare: Spare | None = None


class Loc(Struct, array_like=True):
    size: int
    stripes: list[list[Copy]]  # per stripe: live copies, any order
    # on SSD instead: per stripe (load endpoint, segment of that server, file id)
    disk: list[tuple[str, str, int]] | None = None


class Locs(Msg, tag="locs"):
    items: list[Loc | None]


class Codes(Msg, tag="codes"):
    codes: list[int]


class Bools(Msg, tag="bools"):
    values: list[bool]


class Count(Msg, tag="count"):
    n: int


class StatsOk(Msg, tag="stats_ok"):
    stats: dict[str, float]


class Challenge(Msg, tag="challenge"):
    nonce: bytes  # empty: this port requires no token
    required: bool


class Loaded(Msg, tag="loaded"):
    addr: int
    token: int


# -- pushes (master -> server) -------------------------------------------------------------
class Hold(Msg, tag="hold"):
    ops: list[Part | str]  # a Part is now held, a str key is no longer held


class Spill(Msg, tag="spill"):
    items: list[tuple[int, int, int]]  # (file id, address in the server's segment, size)


class DropFiles(Msg, tag="dropfiles"):
    file_ids: list[int]


class Promote(Msg, tag="promote"):
    items: list[tuple[int, int, int]]  # (file id, address in the server's segment, size)


Reply = Union[  # noqa: UP007
    Err,
    Ok,
    HelloOk,
    MountOk,
    Allocs,
    Committed,
    Locs,
    Codes,
    Bools,
    Count,
    StatsOk,
    Challenge,
    Loaded,
    Hold,
    Spill,
    DropFiles,
    Promote,
]

encoder = msgspec.msgpack.Encoder()
request_decoder = msgspec.msgpack.Decoder(Request)
reply_decoder = msgspec.msgpack.Decoder(Reply)


def frame(msg: Msg, req_id: int, flags: int = 0, version: int = PROTOCOL_VERSION) -> bytes:
    body = encoder.encode(msg)
    return PREFIX.pack(HEADER.size + len(body)) + HEADER.pack(MAGIC, version, flags, req_id) + body


def auth_mac(token: str, nonce: bytes) -> bytes:
    """The answer to a challenge: proves the token without sending it (a nonce is used once)."""
    return hmac.new(token.encode(), b"mcst-auth" + nonce, hashlib.sha256).digest()


def stripe_bounds(size: int, nst: int) -> list[tuple[int, int]]:
    """(offset, length) of each stripe: ``nst`` near-equal pieces of ``size`` bytes."""
    if nst <= 1:
        return [(0, size)]
    per = -(-size // nst)
    return [(k * per, max(0, min(per, size - k * per))) for k in range(nst)]


def stripe_count(size: int, stripe_size: int) -> int:
    return max(1, -(-size // stripe_size))


__all__ = [
    "HEADER",
    "PREFIX",
    "PROTOCOL_VERSION",
    "SSD_HEADER",
    "Code",
    "Loc",
    "Msg",
    "Part",
    "frame",
    "stripe_bounds",
    "stripe_count",
]
