"""The Mooncake facades' transport list: ``protocol="tcp"`` takes same-host shortcuts unless told
TCP only, through ``MOONCAKE_CONNECTORS_TRANSPORTS``, the engine's ``transports`` argument or the
store's ``setup(..., transports=...)``; TCP only covers the store's control plane too."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from prometheus_client import REGISTRY

from mooncake_connectors.compat import MooncakeDistributedStore, TransferEngine
from mooncake_connectors.config import TRANSPORTS_ENV, parse_transports, transports_from_env
from mooncake_connectors.errors import ConfigError
from mooncake_connectors.store import Master, MasterConfig
from mooncake_connectors.store.config import ServerConfig
from mooncake_connectors.store.server import StoreServer


def moved(transport: str) -> float:
    """Bytes the engines of this process moved over ``transport`` so far (all ops)."""
    total = 0.0
    for metric in REGISTRY.collect():
        if metric.name != "mooncake_connectors_transfer_bytes":
            continue
        for sample in metric.samples:
            if sample.name.endswith("_total") and sample.labels.get("transport") == transport:
                total += sample.value
    return total


def engine_pair_moves(te_args: dict[str, Any]) -> dict[str, Any]:
    """Two facade engines in this process; one 64 KiB read. Bytes moved per transport."""
    server, client = TransferEngine(**te_args), TransferEngine(**te_args)
    try:
        assert server.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert client.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        remote = np.arange(1 << 16, dtype=np.uint32).view(np.uint8)[: 1 << 16]
        assert server.register_memory(remote.ctypes.data, remote.nbytes) == 0
        local = np.zeros(1 << 16, dtype=np.uint8)
        assert client.register_memory(local.ctypes.data, local.nbytes) == 0
        before = {t: moved(t) for t in ("shm", "tcp")}
        target = f"127.0.0.1:{server.get_rpc_port()}"
        assert (
            client.transfer_sync_read(target, local.ctypes.data, remote.ctypes.data, 1 << 16) == 0
        )
        assert local.tobytes() == remote.tobytes()
        out: dict[str, Any] = {"names": [t.name for t in client.engine.transports]}
        out.update({t: moved(t) - before[t] for t in ("shm", "tcp")})
        return out
    finally:
        client.close()
        server.close()


def test_protocol_tcp_alone_takes_shared_memory_on_one_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(TRANSPORTS_ENV, raising=False)
    got = engine_pair_moves({})
    assert got["names"] == ["shm", "tcp"]
    assert got["shm"] >= 1 << 16 and got["tcp"] == 0


def test_environment_makes_the_engine_tcp_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TRANSPORTS_ENV, "tcp")
    got = engine_pair_moves({})
    assert got["names"] == ["tcp"]
    assert got["tcp"] >= 1 << 16 and got["shm"] == 0


def test_explicit_argument_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TRANSPORTS_ENV, "shm,tcp")
    got = engine_pair_moves({"transports": ["tcp"]})
    assert got["names"] == ["tcp"] and got["shm"] == 0


def test_a_bad_list_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TRANSPORTS_ENV, "tcp,tcp")
    with pytest.raises(ConfigError, match="twice"):
        TransferEngine()
    monkeypatch.setenv(TRANSPORTS_ENV, " , ")
    with pytest.raises(ConfigError, match="at least one"):
        transports_from_env()
    with pytest.raises(ConfigError, match="at least one"):
        TransferEngine(transports="")
    assert parse_transports(" SHM, tcp ") == ("shm", "tcp")


@pytest.fixture
def store_pair() -> Iterator[tuple[str, list[StoreServer]]]:
    """A master in this process; the caller starts a data server with the transports it wants."""
    servers: list[StoreServer] = []
    with Master(MasterConfig(port=0)) as master:
        try:
            yield master.address, servers
        finally:
            for s in servers:
                s.close()


def store_moves(
    master: str, servers: list[StoreServer], transports: tuple[str, ...], setup_kw: dict[str, Any]
) -> dict[str, Any]:
    servers.append(
        StoreServer(ServerConfig(master=master, memory=16 << 20, transports=transports)).start()
    )
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "", 0, 4 << 20, "tcp", "", master, **setup_kw) == 0
    try:
        value = bytes(range(256)) * 4096  # 1 MiB
        before = {t: moved(t) for t in ("shm", "tcp")}
        assert s.put("k", value) == 0
        assert s.get("k") == value
        client = s.client
        chans = [*client.link._channels, *client._reader._channels]
        families = {c.sock.family for c in chans if not c.closed}
        return {
            "families": families,
            "names": [t.name for t in client.engine.transports],
            **{t: moved(t) - before[t] for t in ("shm", "tcp")},
        }
    finally:
        s.close()


def test_store_default_takes_both_shortcuts(
    store_pair: tuple[str, list[StoreServer]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(TRANSPORTS_ENV, raising=False)
    got = store_moves(*store_pair, ("shm", "tcp"), {})
    assert got["names"] == ["shm", "tcp"]
    assert socket.AF_UNIX in got["families"]
    assert got["shm"] >= 2 << 20 and got["tcp"] == 0


def test_store_setup_argument_makes_data_and_control_tcp_only(
    store_pair: tuple[str, list[StoreServer]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(TRANSPORTS_ENV, "shm,tcp")  # the argument wins
    got = store_moves(*store_pair, ("shm", "tcp"), {"transports": "tcp"})
    assert got["names"] == ["tcp"]
    assert got["families"] == {socket.AF_INET}
    assert got["tcp"] >= 2 << 20 and got["shm"] == 0


def test_store_environment_makes_it_tcp_only(
    store_pair: tuple[str, list[StoreServer]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(TRANSPORTS_ENV, "tcp")
    got = store_moves(*store_pair, ("tcp",), {})
    assert got["names"] == ["tcp"] and got["families"] == {socket.AF_INET}
    assert got["shm"] == 0


def test_store_rejects_a_bad_transport_list(store_pair: tuple[str, list[StoreServer]]) -> None:
    master, _ = store_pair
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "", 0, 4 << 20, "tcp", "", master, transports=7) == -600
    assert s.setup("127.0.0.1", "", 0, 4 << 20, "tcp", "", master, transports="tcp,tcp") == -600
