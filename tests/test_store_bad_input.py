"""Bad input on the master's port: every bad frame gets a clear error (or its connection is
closed), and the master keeps serving everyone else."""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Iterator

import msgspec
import pytest

from mooncake_connectors.errors import CapacityExceeded, ConfigError
from mooncake_connectors.store import Master, MasterConfig
from mooncake_connectors.store.protocol import (
    HEADER,
    MAGIC,
    PREFIX,
    PROTOCOL_VERSION,
    Code,
    Err,
    Exists,
    Get,
    PutStart,
    Remove,
    frame,
    reply_decoder,
)
from mooncake_connectors.store.rpc import Channel


@pytest.fixture(scope="module")
def master() -> Iterator[Master]:
    cfg = MasterConfig(port=0, max_frame=1 << 20, read_lease_ttl=0.3, heartbeat_interval=0.1)
    m = Master(cfg).start()
    yield m
    m.close()


def raw(master: Master) -> socket.socket:
    host, port = master.address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=5)
    return s


def read_reply(s: socket.socket) -> Err | None:
    buf = b""
    while len(buf) < PREFIX.size:
        chunk = s.recv(65536)
        if not chunk:
            return None
        buf += chunk
    (n,) = PREFIX.unpack_from(buf)
    while len(buf) < PREFIX.size + n:
        chunk = s.recv(65536)
        if not chunk:
            return None
        buf += chunk
    msg = reply_decoder.decode(buf[PREFIX.size + HEADER.size : PREFIX.size + n])
    assert isinstance(msg, Err)
    return msg


def body_frame(body: bytes, version: int = PROTOCOL_VERSION, magic: bytes = MAGIC) -> bytes:
    return PREFIX.pack(HEADER.size + len(body)) + HEADER.pack(magic, version, 0, 7) + body


def still_serving(master: Master) -> None:
    ch = Channel(master.address, 5.0)
    try:
        reply = ch.call(Exists(["anything"]), 5.0)
        assert not isinstance(reply, Err), reply
    finally:
        ch.close()


@pytest.mark.parametrize(
    ("body", "code", "text"),
    [
        (b"\xc1\xc1\xc1", Code.PROTOCOL, "malformed"),  # not msgpack
        (msgspec.msgpack.encode(["nosuchop", 1]), Code.INVALID, "invalid"),  # unknown tag
        (msgspec.msgpack.encode({"a": 1}), Code.INVALID, "invalid"),  # not a tagged array
        (msgspec.msgpack.encode(["get", ["x" * 5000]]), Code.INVALID, "invalid"),  # key too long
        (msgspec.msgpack.encode(["get", [""]]), Code.INVALID, "invalid"),  # empty key
        (msgspec.msgpack.encode(["put", 1, ["k"], [1 << 60], 1]), Code.INVALID, "invalid"),
        (msgspec.msgpack.encode(["put", 1, ["k"], [-5], 1]), Code.INVALID, "invalid"),
        (msgspec.msgpack.encode(["put", 1, ["k"], [5], 99]), Code.INVALID, "invalid"),
        (msgspec.msgpack.encode(["put", 1, ["k", "j"], [5], 1]), Code.INVALID, "differ"),
        (msgspec.msgpack.encode(["load", 1, 5]), Code.INVALID, "not a master request"),
    ],
)
def test_bad_messages_get_clear_errors(master: Master, body: bytes, code: int, text: str) -> None:
    with raw(master) as s:
        s.sendall(body_frame(body))
        err = read_reply(s)
        assert err is not None and err.code == code and text in err.message, err
        s.sendall(frame(Exists(["k"]), 8))  # the same connection still works
        assert s.recv(65536)
    still_serving(master)


def test_unknown_version_is_refused_by_name(master: Master) -> None:
    with raw(master) as s:
        s.sendall(body_frame(msgspec.msgpack.encode(["exists", ["k"]]), version=99))
        err = read_reply(s)
        assert err is not None and err.code == Code.PROTOCOL and "version 99" in err.message
    still_serving(master)


@pytest.mark.parametrize(
    "data",
    [
        struct.pack("<I", 1 << 30) + b"x" * 64,  # a 1 GiB frame announced
        struct.pack("<I", 3) + b"abc",  # shorter than a header
        body_frame(b"\x90", magic=b"XX"),  # not our protocol
    ],
)
def test_bad_frames_close_that_connection_only(master: Master, data: bytes) -> None:
    bystander = Channel(master.address, 5.0)
    with raw(master) as s:
        s.sendall(data)
        err = read_reply(s)
        assert err is not None and err.code == Code.PROTOCOL
        assert s.recv(10) == b""  # closed
    assert not isinstance(bystander.call(Get(["k"]), 5.0), Err)
    bystander.close()
    still_serving(master)


def test_garbage_stream_and_abrupt_disconnects(master: Master) -> None:
    for _ in range(20):
        with raw(master) as s:
            s.sendall(b"\x00\x01\x02" * 7)  # a partial frame, then gone
    with raw(master) as s:
        s.sendall(frame(PutStart(1, ["half"], [10]), 3)[:9])
    still_serving(master)


def test_client_errors_for_huge_and_unplaceable_values(master: Master) -> None:
    from mooncake_connectors.store import ClientConfig, StoreClient

    with StoreClient(ClientConfig(master=master.address, timeout=5)) as c:
        with pytest.raises(CapacityExceeded, match="no room"):
            c.put_from("k", 0, 1 << 35)  # no memory mounted at all: a clear error, no hang
        with pytest.raises(ConfigError):
            c.put_batch(["a"], [b"1", b"2"])
        reply = c._master(Remove(["x"] * 10), c._deadline())
        assert not isinstance(reply, Err)


def test_loopback_peers_take_the_unix_socket_and_tcp_still_works(master: Master) -> None:
    ch = Channel(master.address, 5.0)
    assert ch.sock.family == socket.AF_UNIX
    assert not isinstance(ch.call(Exists(["k"]), 5.0), Err)
    ch.close()
    with raw(master) as s:  # plain TCP, as a remote peer connects
        s.sendall(frame(Exists(["k"]), 9))
        assert s.recv(65536)


def test_pipelined_requests_are_collected_in_any_order(master: Master) -> None:
    ch = Channel(master.address, 5.0)
    try:
        rids = [ch.send(Exists([f"k{i}"]), 5.0) for i in range(5)]
        assert ch.in_flight
        deadline = time.monotonic() + 5.0
        for rid in reversed(rids):  # the last first: the others are kept until asked for
            assert not isinstance(ch.wait(rid, deadline), Err)
        assert not ch.in_flight
        assert not isinstance(ch.call(Exists(["x"]), 5.0), Err)  # and plain calls still work
    finally:
        ch.close()


def test_a_silent_or_unread_peer_ends_a_call_at_its_deadline() -> None:
    """A peer that accepts and never answers, or never reads: the channel gives up by the
    call's deadline (TimeoutError; a send that cannot finish closes the channel)."""
    with socket.create_server(("127.0.0.1", 0)) as silent:
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        ch = Channel(address, 5.0, local_ipc=False)
        try:
            for timeout in (0.2, 0.05, 0.3):  # bounds that shrink and grow between calls
                with pytest.raises(TimeoutError):
                    ch.call(Exists(["k"]), timeout)
            assert not ch.closed
            huge = Exists([f"{i:06d}" + "x" * 4000 for i in range(4000)])  # a 16 MB frame
            with pytest.raises(ConnectionError):
                ch.call(huge, 0.3)
            assert ch.closed
        finally:
            ch.close()
