"""TLS on the store: the master's control port (the same FrameServer serves a store server's
load endpoint), the servers' and clients' transfer engines, with certificates from ``certs init``.
With a CA the certificate stands in for the token; a client outside the CA is refused clearly."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mooncake_connectors import certs
from mooncake_connectors.errors import AuthenticationError
from mooncake_connectors.store import ClientConfig, Master, MasterConfig, StoreClient
from mooncake_connectors.store.config import ServerConfig
from mooncake_connectors.store.protocol import Bools, Exists
from mooncake_connectors.store.rpc import Channel
from mooncake_connectors.store.server import StoreServer
from mooncake_connectors.tls import TlsConfig

TOKEN = "correct horse battery"
VALUE = bytes(range(256)) * 4096  # 1 MiB


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TlsConfig]:
    ours = certs.init(tmp_path_factory.mktemp("ours"), ("master", "server", "client"))
    theirs = certs.init(tmp_path_factory.mktemp("theirs"), ("rogue",))

    def node(p: dict[str, Path], name: str, ca: Path | None) -> TlsConfig:
        return TlsConfig(str(p[name]), str(p[f"{name}-key"]), str(ca) if ca else None)

    return {
        "master": node(ours, "master", ours["ca"]),
        "server": node(ours, "server", ours["ca"]),
        "client": node(ours, "client", ours["ca"]),
        "ca-only": TlsConfig(ca=str(ours["ca"])),
        "rogue": node(theirs, "rogue", theirs["ca"]),
        "rogue-trusting-us": node(theirs, "rogue", ours["ca"]),
    }


@pytest.fixture(scope="module")
def master(pki: dict[str, TlsConfig]) -> Iterator[Master]:
    m = Master(MasterConfig(port=0, auth_token=TOKEN, tls=pki["master"])).start()
    yield m
    m.close()


def serves(master: Master, tls: TlsConfig) -> None:
    ch = Channel(master.address, 5.0, None, tls)  # no token: the certificate is the proof
    try:
        assert isinstance(ch.call(Exists(["k"]), 5.0), Bools)
    finally:
        ch.close()


def test_put_and_get_over_tls_without_the_token(master: Master, pki: dict[str, TlsConfig]) -> None:
    s = StoreServer(
        ServerConfig(master=master.address, memory=8 << 20, transports=("tcp",), tls=pki["server"])
    ).start()
    try:
        c = StoreClient(
            ClientConfig(master=master.address, transports=("tcp",), tls=pki["client"], timeout=10)
        ).start()
        try:
            c.put("k", VALUE)
            assert c.get("k") == VALUE
        finally:
            c.close()
    finally:
        s.close()


@pytest.mark.parametrize("who", ["ca-only", "rogue", "rogue-trusting-us"])
def test_a_client_outside_the_ca_is_refused(
    master: Master, pki: dict[str, TlsConfig], who: str
) -> None:
    with pytest.raises(AuthenticationError, match="TLS"):
        ch = Channel(master.address, 5.0, TOKEN, pki[who])  # even with the token
        ch.call(Exists(["k"]), 5.0)
    serves(master, pki["client"])


def test_a_plaintext_client_gets_an_error_not_a_hang(
    master: Master, pki: dict[str, TlsConfig]
) -> None:
    start = time.monotonic()
    with pytest.raises(AuthenticationError, match="requires TLS"):
        ch = Channel(master.address, 5.0, TOKEN)
        ch.call(Exists(["k"]), 5.0)
    assert time.monotonic() - start < 5.0  # refused at its first frame, not left to time out
    serves(master, pki["client"])


@pytest.mark.parametrize("mutual", [True, False])
def test_a_plaintext_store_client_is_refused_at_once_not_retried_to_its_deadline(
    pki: dict[str, TlsConfig], mutual: bool
) -> None:
    tls = pki["master"] if mutual else TlsConfig(pki["master"].cert, pki["master"].key)
    m = Master(MasterConfig(port=0, tls=tls)).start()
    try:
        start = time.monotonic()
        with pytest.raises(AuthenticationError, match="requires TLS"):
            StoreClient(ClientConfig(master=m.address, timeout=8.0)).start().stats()
        took = time.monotonic() - start
        # a reset looked like a master that went away: it was retried for the whole 8 s
        assert took < 4.0, f"refused after {took:.1f}s"
        serves(m, pki["client"])
    finally:
        m.close()


def test_a_plaintext_master_is_not_taken_for_a_tls_one() -> None:
    from mooncake_connectors.store.rpc import _speaks_tls

    m = Master(MasterConfig(port=0)).start()
    try:
        host, port = m.address.rsplit(":", 1)
        assert not _speaks_tls(host, int(port), 2.0)
        ch = Channel(m.address, 5.0, local_ipc=False)
        try:
            assert isinstance(ch.call(Exists(["k"]), 5.0), Bools)
        finally:
            ch.close()
    finally:
        m.close()


def test_no_unix_socket_bypasses_tls(master: Master) -> None:
    from mooncake_connectors.store.rpc import unix_name

    host, port = master.address.rsplit(":", 1)
    u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with pytest.raises(OSError):
        u.connect(unix_name(host, int(port)))
    u.close()


def test_metrics_and_health_over_mutual_tls(pki: dict[str, TlsConfig]) -> None:
    import http.client
    import ssl

    from mooncake_connectors.tls import client_context

    m = Master(MasterConfig(port=0, metrics_port=0, auth_token=TOKEN, tls=pki["master"])).start()
    try:
        port = m.metrics_port
        assert port
        conn = http.client.HTTPSConnection(
            "127.0.0.1", port, timeout=5, context=client_context(pki["client"])
        )
        conn.request("GET", "/health")  # no bearer token: the certificate is the proof
        assert conn.getresponse().status == 200
        conn.close()
        outsider = http.client.HTTPSConnection(
            "127.0.0.1", port, timeout=5, context=client_context(pki["ca-only"])
        )
        with pytest.raises((ssl.SSLError, ConnectionError)):
            outsider.request("GET", "/health")
            outsider.getresponse()
        outsider.close()
    finally:
        m.close()


def test_a_silent_connection_holds_no_one_up_and_is_closed(
    pki: dict[str, TlsConfig],
) -> None:
    m = Master(MasterConfig(port=0, tls=pki["master"], frame_timeout=0.5)).start()
    try:
        host, port = m.address.rsplit(":", 1)
        silent = socket.create_connection((host, int(port)), timeout=10)  # never says hello
        try:
            serves(m, pki["client"])
            silent.settimeout(10)
            with contextlib.suppress(ConnectionResetError):  # a reset is a close too
                assert silent.recv(1) == b""  # closed after frame_timeout, not held
        finally:
            silent.close()
    finally:
        m.close()
