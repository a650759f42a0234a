"""The PD side channel over real zmq sockets on 127.0.0.1: layouts, done notices, the push
messages, a silent peer, a failing handler."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from mooncake_connectors.errors import ConfigError, TransferTimeout
from mooncake_connectors.pd.messages import (
    Done,
    LayerLayout,
    PushDone,
    PushTarget,
    WorkerLayout,
)
from mooncake_connectors.pd.side_channel import SideChannelClient, SideChannelServer

# -- side channel -------------------------------------------------------------------------------


@pytest.fixture
def server() -> Iterator[tuple[SideChannelServer, list[Done], threading.Event]]:
    got: list[Done] = []
    event = threading.Event()

    def on_done(msg: Done) -> None:
        got.append(msg)
        event.set()

    layout = WorkerLayout("eng", 0, 1, "seg", "", 32, "bf16", [LayerLayout("l", 1, 2, 2, 4)])
    srv = SideChannelServer("127.0.0.1", 0, lambda: layout, on_done)
    yield srv, got, event
    srv.close()


def test_layout_and_done_over_the_side_channel(
    server: tuple[SideChannelServer, list[Done], threading.Event],
) -> None:
    srv, got, event = server
    assert srv.endpoint.startswith("tcp://127.0.0.1:")
    client = SideChannelClient(timeout=5)
    try:
        # garbage first: the server drops it and keeps serving
        raw = zmq.Context.instance().socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(srv.endpoint)
        raw.send(b"\xc1 not msgpack")
        raw.close()
        layout = client.fetch_layout(srv.endpoint)
        assert layout.engine_id == "eng" and layout.layers[0].name == "l"
        client.notify_done(srv.endpoint, "eng", ["r1", "r2"])
        assert event.wait(5), "Done did not arrive"
        assert got == [Done("eng", ["r1", "r2"])]
    finally:
        client.close()


def test_a_silent_peer_times_out_within_the_deadline() -> None:
    ctx = zmq.Context.instance()
    mute = ctx.socket(zmq.ROUTER)  # accepts, never answers
    mute.setsockopt(zmq.LINGER, 0)
    port = mute.bind_to_random_port("tcp://127.0.0.1")
    client = SideChannelClient(timeout=0.5)
    try:
        t0 = time.monotonic()
        with pytest.raises(TransferTimeout, match="did not answer"):
            client.fetch_layout(f"tcp://127.0.0.1:{port}")
        assert time.monotonic() - t0 < 2
        client.notify_done(f"tcp://127.0.0.1:{port}", "eng", ["x"])  # never raises
    finally:
        client.close()
        mute.close()


def test_a_failing_handler_does_not_end_the_side_channel() -> None:
    ready = threading.Event()
    layout = WorkerLayout("eng", 0, 1, "seg", "", 32, "bf16", [])

    def get_layout() -> WorkerLayout:
        if not ready.is_set():
            raise ConfigError("KV caches not registered yet")
        return layout

    srv = SideChannelServer("127.0.0.1", 0, get_layout, lambda msg: None)
    client = SideChannelClient(timeout=0.5)
    try:
        with pytest.raises(TransferTimeout):
            client.fetch_layout(srv.endpoint)  # no answer while not ready
        ready.set()
        assert client.fetch_layout(srv.endpoint) == layout
    finally:
        client.close()
        srv.close()


def test_push_messages_over_the_side_channel() -> None:
    targets: list[PushTarget] = []
    dones: list[PushDone] = []
    arrived = threading.Event()
    layout = WorkerLayout("dec", 0, 1, "seg", "tcp://127.0.0.1:9", 32, "bf16", [])

    def on_target(msg: PushTarget) -> None:
        targets.append(msg)

    def on_push_done(msg: PushDone) -> None:
        dones.append(msg)
        arrived.set()

    srv = SideChannelServer(
        "127.0.0.1", 0, lambda: layout, lambda msg: None, on_target, on_push_done
    )
    client = SideChannelClient(timeout=2)
    try:
        target = PushTarget("id-1", "pre", layout, 2, [7, 8], 80, "h", 1e12)
        assert client.send(srv.endpoint, target)
        assert client.send(srv.endpoint, PushDone("id-1", False, "other tokens"))
        assert arrived.wait(5), "PushDone did not arrive"
        assert targets == [target] and dones == [PushDone("id-1", False, "other tokens")]
    finally:
        client.close()
        srv.close()
