"""The store control plane's shared-token authentication: a client without the token, or with a
wrong one, gets a clear AuthenticationError and its connection is closed; the master keeps serving
those who know it. Nothing but an HMAC of a one-time nonce crosses the wire."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from mooncake_connectors.errors import AuthenticationError, ConfigError
from mooncake_connectors.store import ClientConfig, Master, MasterConfig
from mooncake_connectors.store.protocol import (
    HEADER,
    MAGIC,
    PREFIX,
    PROTOCOL_VERSION,
    Auth,
    AuthStart,
    Bools,
    Challenge,
    Code,
    Err,
    Exists,
    Ok,
    auth_mac,
    frame,
    reply_decoder,
)
from mooncake_connectors.store.rpc import Channel

TOKEN = "correct horse battery"


@pytest.fixture(scope="module")
def master() -> Iterator[Master]:
    m = Master(MasterConfig(port=0, auth_token=TOKEN)).start()
    yield m
    m.close()


def serves(master: Master) -> None:
    ch = Channel(master.address, 5.0, TOKEN)
    try:
        assert isinstance(ch.call(Exists(["k"]), 5.0), Bools)
    finally:
        ch.close()


def test_the_right_token_is_served(master: Master) -> None:
    serves(master)


def test_no_token_is_refused_clearly_and_the_connection_closed(master: Master) -> None:
    ch = Channel(master.address, 5.0)
    with pytest.raises(AuthenticationError, match="requires a token"):
        ch.call(Exists(["k"]), 5.0)
    assert ch.closed
    serves(master)


def test_a_wrong_token_is_refused(master: Master) -> None:
    with pytest.raises(AuthenticationError, match="wrong token"):
        Channel(master.address, 5.0, "not the token")
    serves(master)


def test_an_answer_to_another_nonce_is_refused(master: Master) -> None:
    ch = Channel(master.address, 5.0)
    try:
        first = ch.call(AuthStart(), 5.0)
        assert isinstance(first, Challenge) and first.required and len(first.nonce) == 16
        again = ch.call(AuthStart(), 5.0)
        assert isinstance(again, Challenge) and again.nonce != first.nonce
        with pytest.raises(AuthenticationError):
            ch.call(Auth(auth_mac(TOKEN, first.nonce)), 5.0)  # a replayed answer
    finally:
        ch.close()
    serves(master)


def test_large_frames_before_authentication_are_refused(master: Master) -> None:
    host, port = master.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        body = b"\x00" * 100_000
        s.sendall(PREFIX.pack(HEADER.size + len(body)) + HEADER.pack(MAGIC, PROTOCOL_VERSION, 0, 1))
        buf = b""
        while len(buf) < PREFIX.size:
            chunk = s.recv(65536)
            assert chunk, "closed without an answer"
            buf += chunk
        (n,) = PREFIX.unpack_from(buf)
        while len(buf) < PREFIX.size + n:
            buf += s.recv(65536)
        err = reply_decoder.decode(buf[PREFIX.size + HEADER.size : PREFIX.size + n])
        assert isinstance(err, Err) and err.code == Code.PROTOCOL and "4096" in err.message
        s.settimeout(5)
        assert s.recv(10) == b""  # then closed
    serves(master)


def test_a_token_is_optional_towards_a_master_without_one() -> None:
    m = Master(MasterConfig(port=0)).start()
    try:
        ch = Channel(m.address, 5.0, TOKEN)
        assert isinstance(ch.call(AuthStart(), 5.0), Challenge)
        assert isinstance(ch.call(Auth(b"x"), 5.0), Ok)
        assert isinstance(ch.call(Exists(["k"]), 5.0), Bools)
        ch.close()
    finally:
        m.close()


def test_tokens_are_validated() -> None:
    with pytest.raises(ConfigError):
        MasterConfig(auth_token="short")
    with pytest.raises(ConfigError):
        ClientConfig(auth_token="")
    assert frame(Ok(), 1)  # (the framing itself is unchanged)
