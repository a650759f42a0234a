"""The Mooncake-compatible facade: the same script runs on ours and (when installed) on Mooncake."""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np
import pytest

from mooncake_connectors.compat import TransferEngine as OurTE


def mooncake_script(TE: Any, metadata: str) -> dict[str, Any]:
    """Code written for Mooncake's engine, unchanged: two engines, one process, P2P handshake."""
    server, client = TE(), TE()
    assert server.initialize("127.0.0.1", metadata, "tcp", "") == 0
    assert client.initialize("127.0.0.1", metadata, "tcp", "") == 0
    target = f"127.0.0.1:{server.get_rpc_port()}"
    remote = np.arange(1 << 20, dtype=np.uint8)
    assert server.register_memory(remote.ctypes.data, remote.nbytes) == 0
    local = client.allocate_managed_buffer(1 << 20)
    assert local != 0
    out: dict[str, Any] = {}
    out["probe"] = [client.send_probe(target), client.send_probe("127.0.0.1:1")]
    out["probe_not_a_name"] = client.send_probe("nonsense")
    out["read"] = client.transfer_sync_read(target, local, remote.ctypes.data, 4096)
    out["read_ok"] = client.read_bytes_from_buffer(local, 4096) == remote[:4096].tobytes()
    assert client.write_bytes_to_buffer(local, b"\x07" * 100, 100) == 0
    out["write"] = client.transfer_sync_write(target, local, remote.ctypes.data + 1000, 100)
    out["write_ok"] = bool((remote[1000:1100] == 7).all())
    out["batch_read"] = client.batch_transfer_sync_read(
        target, [local, local + 8192], [remote.ctypes.data, remote.ctypes.data + 8192], [512, 512]
    )
    out["batch_write"] = client.batch_transfer_sync_write(
        target, [local], [remote.ctypes.data + 50000], [256]
    )
    extra = np.zeros(4096, dtype=np.uint8)
    out["batch_register"] = client.batch_register_memory([extra.ctypes.data], [extra.nbytes])
    out["unregister"] = client.unregister_memory(extra.ctypes.data)
    out["free"] = client.free_managed_buffer(local, 1 << 20)
    out["server_unregister"] = server.unregister_memory(remote.ctypes.data)
    for e in (client, server):
        if hasattr(e, "close") and e.__class__ is OurTE:
            e.close()
    return out


EXPECTED = {
    "probe": [0, -102],  # a live peer, a port nobody listens on
    "probe_not_a_name": -101,
    "read": 0,
    "read_ok": True,
    "write": 0,
    "write_ok": True,
    "batch_read": 0,
    "batch_write": 0,
    "batch_register": 0,
    "unregister": 0,
    "free": 0,
    "server_unregister": 0,
}


def test_mooncake_script_runs_on_ours() -> None:
    assert mooncake_script(OurTE, "P2PHANDSHAKE") == EXPECTED


@pytest.mark.skipif(
    importlib.util.find_spec("mooncake") is None,
    reason="Mooncake wheel not installed (pip install mooncake-transfer-engine-non-cuda)",
)
def test_same_script_same_answers_on_mooncake(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    # Installed but unloadable (its RDMA/NUMA libraries missing) fails here: not a skip.
    from mooncake.engine import TransferEngine as MooncakeTE

    assert mooncake_script(MooncakeTE, "P2PHANDSHAKE") == EXPECTED


def test_failures_are_negative_return_codes(meta_server: Any) -> None:
    te = OurTE()
    assert te.initialize("127.0.0.1", meta_server.url, "carrier-pigeon", "") < 0
    assert te.initialize("127.0.0.1", meta_server.url, "tcp", "") == 0
    assert te.initialize("127.0.0.1", meta_server.url, "tcp", "") < 0  # twice
    buf = np.zeros(4096, dtype=np.uint8)
    assert te.register_memory(buf.ctypes.data, 4096) == 0
    assert te.transfer_sync_read("127.0.0.1:1", buf.ctypes.data, 0, 16) < 0  # unknown peer
    me = te.get_engine().segment_name
    assert te.transfer_sync_read(me, buf.ctypes.data, buf.ctypes.data + 8192, 16) < 0  # OOB
    assert te.batch_transfer_sync_read(me, [buf.ctypes.data], [], [16]) < 0  # ragged lists
    assert te.unregister_memory(12345) < 0
    assert te.free_managed_buffer(12345, 1) < 0
    assert te.allocate_managed_buffer(-1) == 0
    te.close()


def test_unsupported_method_names_the_supported_ones() -> None:
    with pytest.raises(AttributeError, match="supported"):
        OurTE().transfer_submit_write  # noqa: B018


@pytest.mark.parametrize(
    ("given", "url"),
    [
        ("P2PHANDSHAKE", "p2p"),
        (" p2phandshake ", "p2p"),
        ("http://127.0.0.1:8080/metadata", "http://127.0.0.1:8080/metadata"),
        ("etcd://127.0.0.1:2379", "etcd://127.0.0.1:2379"),
        ("memory://x", "memory://x"),
        ("127.0.0.1:2379", "etcd://127.0.0.1:2379"),  # Mooncake's bare form is etcd
    ],
)
def test_both_facades_read_mooncakes_metadata_server_forms_alike(given: str, url: str) -> None:
    from mooncake_connectors.compat_store import _metadata, metadata_url

    assert metadata_url(given) == url
    assert _metadata(given) == url
    assert _metadata("  ") is None  # the store falls back to its master's metadata
