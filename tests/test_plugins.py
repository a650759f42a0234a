from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import tomllib

from mooncake_connectors.errors import PluginError
from mooncake_connectors.plugins import BUILTINS, METADATA_GROUP, TRANSPORT_GROUP, Registry
from mooncake_connectors.transfer_core.metadata import METADATA_BACKENDS, open_metadata, scheme_of
from mooncake_connectors.transfer_core.metadata.memory import MemoryMetadata
from mooncake_connectors.transfer_core.transport import TRANSPORTS, Transport
from mooncake_connectors.transfer_core.transports.tcp import TcpTransport


def test_builtins_come_from_entry_points() -> None:
    assert {"tcp", "shm"} <= set(TRANSPORTS.names())
    assert {"memory", "http", "etcd", "p2p"} <= set(METADATA_BACKENDS.names())
    assert TRANSPORTS.get("tcp") is TcpTransport


def test_unknown_name_lists_known_ones() -> None:
    with pytest.raises(PluginError, match="known"):
        TRANSPORTS.get("carrier-pigeon")


def test_duplicate_registration_raises() -> None:
    reg: Registry[Transport] = Registry(TRANSPORT_GROUP, "mooncake_transport")
    with pytest.raises(PluginError, match="already registered"):
        reg.register("tcp", type("Other", (TcpTransport,), {}))
    reg.register("tcp", TcpTransport)  # the same class again is harmless


def test_scheme_aliases() -> None:
    assert scheme_of("P2PHANDSHAKE") == "p2p"
    assert scheme_of("http://127.0.0.1:1/metadata") == "http"
    assert isinstance(open_metadata("memory://x"), MemoryMetadata)


def test_builtins_are_found_without_entry_points(monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy of the tracked files that was never installed (a GPU machine's) has no entry
    points; the built-ins must still load."""
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kw: [])
    transports: Registry[Transport] = Registry(TRANSPORT_GROUP, "mooncake_transport")
    assert {"tcp", "shm", "cuda_ipc", "rdma"} <= set(transports.names())
    assert transports.get("tcp") is TcpTransport
    backends: Registry[Any] = Registry(METADATA_GROUP, "mooncake_metadata")
    assert backends.get("memory") is MemoryMetadata and "http" in backends.names()


def test_the_builtin_table_matches_the_entry_points() -> None:
    with open(Path(__file__).resolve().parents[1] / "pyproject.toml", "rb") as fh:
        eps = tomllib.load(fh)["project"]["entry-points"]
    assert {group: eps[group] for group in BUILTINS} == BUILTINS
