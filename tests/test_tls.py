"""TLS on the transfer engine's listeners (tcp data plane, http and p2p metadata), with
certificates made by ``certs init``: round trips, and every way a peer can fail to belong."""

from __future__ import annotations

import os
import socket
import ssl
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from mooncake_connectors import certs
from mooncake_connectors.config import EngineConfig
from mooncake_connectors.errors import AuthenticationError, MetadataError, ProtocolError
from mooncake_connectors.tls import TlsConfig, client_context, wrap_client
from mooncake_connectors.transfer_core import TransferEngine
from mooncake_connectors.transfer_core.metadata.http import HttpMetadata, MetadataHTTPServer

TOKEN = "s3cret-token"
SIZE = 1 << 20


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    ours = certs.init(tmp_path_factory.mktemp("ours"), ("target", "initiator"))
    theirs = certs.init(tmp_path_factory.mktemp("theirs"), ("rogue",))
    return {**ours, "rogue": theirs["rogue"], "rogue-key": theirs["rogue-key"], "ca2": theirs["ca"]}


def files(pki: dict[str, Path], node: str | None, ca: str | None = "ca") -> dict[str, str]:
    out = {"tls_ca": str(pki[ca])} if ca else {}
    if node:
        out |= {"tls_cert": str(pki[node]), "tls_key": str(pki[f"{node}-key"])}
    return out


def tls(pki: dict[str, Path], node: str | None, ca: str | None = "ca") -> TlsConfig:
    f = files(pki, node, ca)
    return TlsConfig(f.get("tls_cert"), f.get("tls_key"), f.get("tls_ca"))


def test_certs_init_writes_private_keys_and_reuses_its_ca(tmp_path: Path) -> None:
    first = certs.init(tmp_path, ("a",))
    ca = first["ca"].read_bytes()
    second = certs.init(tmp_path, ("b",))
    assert second["ca"].read_bytes() == ca  # a second node joins the same cluster
    for key in ("ca-key",):
        assert stat.S_IMODE(os.stat(first[key]).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(second["b-key"]).st_mode) == 0o600


class Pair:
    def __init__(self, target: TransferEngine, initiator: TransferEngine) -> None:
        self.target, self.initiator = target, initiator
        self.victim = np.full(SIZE, 3, dtype=np.uint8)
        self.mine = np.arange(SIZE, dtype=np.uint64).astype(np.uint8)
        target.register(self.victim)
        initiator.register(self.mine)

    def write(self) -> None:
        self.initiator.write(
            self.target.segment_name, self.mine.ctypes.data, self.victim.ctypes.data, SIZE
        )


@pytest.fixture
def pair(request: pytest.FixtureRequest, pki: dict[str, Path]) -> Iterator[Pair]:
    """``request.param``: (target's EngineConfig keywords, initiator's)."""
    ns = f"memory://tls-{request.node.name}"
    theirs, mine = request.param
    t = TransferEngine(
        EngineConfig(metadata=ns, transports=("tcp",), timeout=5, **resolve(pki, theirs))
    ).start()
    i = TransferEngine(
        EngineConfig(metadata=ns, transports=("tcp",), timeout=5, **resolve(pki, mine))
    ).start()
    yield Pair(t, i)
    i.close()
    t.close()


def resolve(pki: dict[str, Path], spec: dict[str, str | None]) -> dict[str, str]:
    out = files(pki, spec.get("node"), spec.get("ca", "ca")) if "node" in spec else {}
    if spec.get("token"):
        out["auth_token"] = TOKEN
    return out


TARGET = {"node": "target", "token": "yes"}


@pytest.mark.parametrize(
    "pair",
    [(TARGET, {"node": "initiator", "token": "yes"}), (TARGET, {"node": "initiator"})],
    ids=["cert-and-token", "cert-instead-of-token"],
    indirect=True,
)
def test_mutual_tls_round_trip_the_certificate_stands_in_for_the_token(pair: Pair) -> None:
    pair.write()
    assert (pair.victim == pair.mine).all()
    pair.mine[:] = 0
    pair.initiator.read(
        pair.target.segment_name, pair.mine.ctypes.data, pair.victim.ctypes.data, SIZE
    )
    assert (pair.mine == pair.victim).all() and pair.mine.any()


@pytest.mark.parametrize(
    "pair, error, match",
    [
        ((TARGET, {"node": "rogue", "ca": "ca2", "token": "yes"}), AuthenticationError, "TLS"),
        ((TARGET, {"node": "rogue", "ca": "ca", "token": "yes"}), AuthenticationError, "TLS"),
        ((TARGET, {"token": "yes"}), AuthenticationError, "requires TLS"),
        (({"token": "yes"}, {"node": "initiator", "token": "yes"}), ProtocolError, "TLS"),
    ],
    ids=["other-ca", "cert-of-other-ca", "plaintext-initiator", "plain-target"],
    indirect=["pair"],
)
def test_a_peer_outside_the_ca_moves_no_byte(
    pair: Pair, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        pair.write()
    assert (pair.victim == 3).all()


def test_a_plaintext_client_is_dropped_not_held(pki: dict[str, Path]) -> None:
    e = TransferEngine(
        EngineConfig(metadata="memory://tls-raw", transports=("tcp",), **files(pki, "target"))
    ).start()
    try:
        port = int(e.transports[0].port)  # type: ignore[attr-defined]
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"MCCT" + bytes(60))  # an old-style AUTH: not a TLS ClientHello
            deadline = time.monotonic() + 10
            try:
                while time.monotonic() < deadline:
                    if not s.recv(4096):  # an alert may come first; then the close
                        break
                else:
                    pytest.fail("the TLS listener held a plaintext client")
            except ConnectionResetError:
                pass  # dropped with a reset: as good as a close
    finally:
        e.close()


def test_a_tls_client_without_a_certificate_gets_no_hello(pki: dict[str, Path]) -> None:
    e = TransferEngine(
        EngineConfig(metadata="memory://tls-nocert", transports=("tcp",), **files(pki, "target"))
    ).start()
    try:
        port = int(e.transports[0].port)  # type: ignore[attr-defined]
        raw = socket.create_connection(("127.0.0.1", port), timeout=10)
        ctx = client_context(tls(pki, None))
        with (
            pytest.raises((AuthenticationError, ssl.SSLError, ConnectionError)) as got,
            wrap_client(ctx, raw, 10, "target") as s,
        ):
            s.recv(64)  # TLS 1.3: the refusal is an alert after the client's handshake
        assert "CERTIFICATE" in str(got.value).upper()
    finally:
        e.close()


# -- metadata over https -----------------------------------------------------------------------


@pytest.fixture
def https(pki: dict[str, Path]) -> Iterator[MetadataHTTPServer]:
    srv = MetadataHTTPServer("127.0.0.1", 0, token=TOKEN, tls=tls(pki, "target")).start()
    yield srv
    srv.stop()


def test_metadata_over_mutual_tls_needs_no_token(
    https: MetadataHTTPServer, pki: dict[str, Path]
) -> None:
    assert https.url.startswith("https://")
    client = HttpMetadata(https.url, tls=tls(pki, "initiator"))
    try:
        client.put("k", b"v")
        assert client.get("k") == b"v"
    finally:
        client.close()


@pytest.mark.parametrize(
    "node, ca", [(None, "ca"), ("rogue", "ca2"), ("rogue", "ca")], ids=["no-cert", "ca2", "mixed"]
)
def test_metadata_refuses_a_client_outside_the_ca(
    https: MetadataHTTPServer, pki: dict[str, Path], node: str | None, ca: str
) -> None:
    client = HttpMetadata(https.url, timeout=5, token=TOKEN, tls=tls(pki, node, ca))
    try:
        with pytest.raises(MetadataError):
            client.put("k", b"v")
    finally:
        client.close()


def test_a_plaintext_metadata_client_gets_an_error(https: MetadataHTTPServer) -> None:
    client = HttpMetadata(https.url.replace("https://", "http://"), timeout=5, token=TOKEN)
    try:
        with pytest.raises(MetadataError):
            client.get("k")
    finally:
        client.close()


def test_p2p_metadata_and_data_over_tls(pki: dict[str, Path]) -> None:
    t = TransferEngine(
        EngineConfig(metadata="p2p", transports=("tcp",), timeout=5, **files(pki, "target"))
    ).start()
    i = TransferEngine(
        EngineConfig(metadata="p2p", transports=("tcp",), timeout=5, **files(pki, "initiator"))
    ).start()
    try:
        pair = Pair(t, i)
        pair.write()
        assert (pair.victim == pair.mine).all()
    finally:
        i.close()
        t.close()


def test_a_client_stuck_in_the_handshake_holds_no_one_up(
    https: MetadataHTTPServer, pki: dict[str, Path]
) -> None:
    silent = socket.create_connection(("127.0.0.1", https.port), timeout=10)  # no ClientHello
    try:
        client = HttpMetadata(https.url, timeout=5, tls=tls(pki, "initiator"))
        try:
            client.put("k2", b"v2")
            assert client.get("k2") == b"v2"
        finally:
            client.close()
    finally:
        silent.close()
