"""The PD side channel with mutual TLS configured: CURVE over real zmq sockets on 127.0.0.1,
keys bound to ``certs init`` certificates. A peer outside the CA, a borrowed binding, a client
without CURVE: none gets a layout or a notice through, and the server keeps serving."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from mooncake_connectors import certs
from mooncake_connectors.errors import AuthenticationError, TransferTimeout
from mooncake_connectors.pd.curve import CurveIdentity, split_endpoint
from mooncake_connectors.pd.messages import Done, LayerLayout, WorkerLayout
from mooncake_connectors.pd.side_channel import SideChannelClient, SideChannelServer
from mooncake_connectors.tls import TlsConfig


@pytest.fixture(scope="module")
def ids(tmp_path_factory: pytest.TempPathFactory) -> dict[str, CurveIdentity]:
    ours = certs.init(tmp_path_factory.mktemp("ours"), ("prefill", "decode"))
    theirs = certs.init(tmp_path_factory.mktemp("theirs"), ("rogue",))

    def ident(p: dict[str, Path], name: str) -> CurveIdentity:
        return CurveIdentity.from_tls(TlsConfig(str(p[name]), str(p[f"{name}-key"]), str(p["ca"])))

    return {
        "prefill": ident(ours, "prefill"),
        "decode": ident(ours, "decode"),
        "rogue": ident(theirs, "rogue"),
    }


@pytest.fixture
def server(
    ids: dict[str, CurveIdentity],
) -> Iterator[tuple[SideChannelServer, list[Done], threading.Event]]:
    got: list[Done] = []
    event = threading.Event()

    def on_done(msg: Done) -> None:
        got.append(msg)
        event.set()

    layout = WorkerLayout("eng", 0, 1, "seg", "", 32, "bf16", [LayerLayout("l", 1, 2, 2, 4)])
    srv = SideChannelServer("127.0.0.1", 0, lambda: layout, on_done, curve=ids["prefill"])
    yield srv, got, event
    srv.close()


def served(srv: SideChannelServer, ids: dict[str, CurveIdentity]) -> None:
    client = SideChannelClient(timeout=5, curve=ids["decode"])
    try:
        assert client.fetch_layout(srv.endpoint).engine_id == "eng"
    finally:
        client.close()


def test_keys_are_derived_from_the_tls_key_and_advertised(
    ids: dict[str, CurveIdentity], server: tuple[SideChannelServer, list[Done], threading.Event]
) -> None:
    srv, _, _ = server
    address, key = split_endpoint(srv.endpoint)
    assert address.startswith("tcp://127.0.0.1:") and key == ids["prefill"].public
    assert ids["prefill"].public != ids["decode"].public


def test_layout_and_done_between_members_of_the_ca(
    ids: dict[str, CurveIdentity], server: tuple[SideChannelServer, list[Done], threading.Event]
) -> None:
    srv, got, event = server
    client = SideChannelClient(timeout=5, curve=ids["decode"])
    try:
        assert client.fetch_layout(srv.endpoint).layers[0].name == "l"
        client.notify_done(srv.endpoint, "eng", ["r1"])
        assert event.wait(5), "Done did not arrive"
        assert got == [Done("eng", ["r1"])]
    finally:
        client.close()


@pytest.mark.parametrize("who", ["rogue", "borrowed-binding"])
def test_a_key_no_certificate_of_the_ca_binds_gets_nothing_through(
    ids: dict[str, CurveIdentity],
    server: tuple[SideChannelServer, list[Done], threading.Event],
    who: str,
) -> None:
    srv, got, _ = server
    me = ids["rogue"]
    if who == "borrowed-binding":  # a member's binding replayed beside another key
        me = dataclasses.replace(me, binding=ids["decode"].binding, ca_der=ids["decode"].ca_der)
    client = SideChannelClient(timeout=1, curve=me)
    try:
        client.notify_done(srv.endpoint, "eng", ["stolen"])
        with pytest.raises(TransferTimeout):
            client.fetch_layout(srv.endpoint)
    finally:
        client.close()
    served(srv, ids)  # still serving, and the Done sent before was dropped
    assert got == []


def test_a_client_without_curve_is_refused(
    ids: dict[str, CurveIdentity], server: tuple[SideChannelServer, list[Done], threading.Event]
) -> None:
    srv, got, _ = server
    plain = SideChannelClient(timeout=1)
    try:
        with pytest.raises(AuthenticationError, match="CURVE"):
            plain.fetch_layout(srv.endpoint)
    finally:
        plain.close()
    raw = zmq.Context.instance().socket(zmq.DEALER)  # ignores the key, speaks NULL
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(split_endpoint(srv.endpoint)[0])
    raw.send(b"\x93anything")
    raw.close()
    served(srv, ids)
    assert got == []


def test_a_curve_client_refuses_a_plaintext_endpoint(ids: dict[str, CurveIdentity]) -> None:
    layout = WorkerLayout("eng", 0, 1, "seg", "", 32, "bf16", [LayerLayout("l", 1, 2, 2, 4)])
    srv = SideChannelServer("127.0.0.1", 0, lambda: layout, lambda _: None)
    client = SideChannelClient(timeout=1, curve=ids["decode"])
    try:
        with pytest.raises(AuthenticationError, match="no CURVE key"):
            client.fetch_layout(srv.endpoint)
    finally:
        client.close()
        srv.close()


def test_close_ends_the_authenticator_and_the_context(ids: dict[str, CurveIdentity]) -> None:
    layout = WorkerLayout("eng", 0, 1, "seg", "", 32, "bf16", [LayerLayout("l", 1, 2, 2, 4)])
    srv = SideChannelServer("127.0.0.1", 0, lambda: layout, lambda _: None, curve=ids["prefill"])
    served(srv, ids)
    zap = srv._auth.thread
    assert zap.is_alive()
    srv.close()  # bounded: stop() and term() run on a helper that close() waits for 5 s at most
    assert not zap.is_alive()
    assert srv._ctx.closed
    srv.close()  # a second close is harmless
