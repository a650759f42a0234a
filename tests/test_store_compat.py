"""The Mooncake-compatible store facade: one script, run on ours and on Mooncake's own store."""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from helpers import free_port, wait_until

from mooncake_connectors.bench.procs import mooncake_master_argv
from mooncake_connectors.compat import MooncakeDistributedStore as OurStore
from mooncake_connectors.compat import ReplicateConfig as OurConfig
from mooncake_connectors.store import Master, MasterConfig


def store_script(Store: Any, Config: Any, master: str, metadata: str) -> dict[str, Any]:
    """Code written for Mooncake's store, unchanged: an embedded client (own 64 MiB segment)."""
    s = Store()
    out: dict[str, Any] = {}
    out["setup"] = s.setup("127.0.0.1", metadata, 64 << 20, 16 << 20, "tcp", "", master)
    out["put"] = s.put("k1", b"hello")
    out["put_again"] = s.put("k1", b"world")  # an existing key: 0, the value stays
    out["get"] = s.get("k1")
    out["get_missing"] = s.get("nope")
    out["is_exist"] = [s.is_exist("k1"), s.is_exist("nope")]
    out["batch_is_exist"] = s.batch_is_exist(["k1", "nope"])
    out["put_batch"] = s.put_batch(["a", "b"], [b"A", b"BB"])
    out["get_batch"] = s.get_batch(["a", "b", "nope"])
    buf = np.zeros(1 << 20, dtype=np.uint8)
    ptr = int(buf.ctypes.data)
    out["register"] = s.register_buffer(ptr, buf.nbytes)
    buf[:10] = 5
    out["put_from"] = s.put_from("pf", ptr, 10)
    out["get_into"] = s.get_into("pf", ptr + 100, 100)
    out["get_into_data"] = bytes(buf[100:110]) == b"\x05" * 10
    out["get_into_small"] = s.get_into("pf", ptr + 100, 5)
    out["get_into_missing"] = s.get_into("nope", ptr + 100, 100)
    buf[1000:1030] = np.arange(30, dtype=np.uint8)
    out["batch_put_from"] = s.batch_put_from(["x", "y"], [ptr + 1000, ptr + 1010], [10, 20])
    out["batch_get_into"] = s.batch_get_into(
        ["x", "y", "nope"], [ptr + 4096, ptr + 8192, ptr + 12288], [100, 100, 100]
    )
    out["batch_get_into_data"] = bytes(buf[8192:8212]) == bytes(range(10, 30))
    big = np.random.default_rng(3).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    cfg = Config()
    cfg.replica_num = 1
    out["put_cfg"] = s.put("big", big, cfg)
    out["get_big"] = s.get("big") == big
    out["put_r"] = s.put("r", b"r")
    out["remove"] = s.remove("r")
    out["remove_missing"] = s.remove("never")
    out["remove_all"] = s.remove_all(True)
    out["after"] = s.is_exist("k1")
    out["unregister"] = s.unregister_buffer(ptr)
    out["close"] = s.close()
    return out


EXPECTED = {
    "setup": 0,
    "put": 0,
    "put_again": 0,
    "get": b"hello",
    "get_missing": b"",
    "is_exist": [1, 0],
    "batch_is_exist": [1, 0],
    "put_batch": 0,
    "get_batch": [b"A", b"BB", b""],
    "register": 0,
    "put_from": 0,
    "get_into": 10,
    "get_into_data": True,
    "get_into_small": -600,
    "get_into_missing": -704,
    "batch_put_from": [0, 0],
    "batch_get_into": [10, 20, -704],
    "batch_get_into_data": True,
    "put_cfg": 0,
    "get_big": True,
    "put_r": 0,
    "remove": 0,
    "remove_missing": -704,
    "remove_all": 7,
    "after": 0,
    "unregister": 0,
    "close": 0,
}


def test_mooncake_store_script_runs_on_ours() -> None:
    with Master(MasterConfig(port=0)) as master:
        assert store_script(OurStore, OurConfig, master.address, "P2PHANDSHAKE") == EXPECTED


def _mooncake_master_binary() -> str | None:
    if importlib.util.find_spec("mooncake") is None:
        return None
    path = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    return path if os.access(path, os.X_OK) else shutil.which("mooncake_master")


@pytest.fixture
def mooncake_master() -> Iterator[tuple[str, str]]:
    binary = _mooncake_master_binary()
    if binary is None:
        pytest.skip("Mooncake wheel not installed (pip install mooncake-transfer-engine-non-cuda)")
    rpc, metrics, http = free_port(), free_port(), free_port()
    proc = subprocess.Popen(
        mooncake_master_argv(binary, rpc, metrics, http),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def listening() -> bool:
        if proc.poll() is not None:
            pytest.skip(f"mooncake_master cannot run here (exit {proc.returncode})")
        try:
            with socket.create_connection(("127.0.0.1", http), 0.2):
                return True
        except OSError:
            return False

    try:
        wait_until(listening, 20, "mooncake_master to listen")
        yield f"127.0.0.1:{rpc}", f"http://127.0.0.1:{http}/metadata"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_same_script_same_answers_on_mooncake(
    mooncake_master: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig

    master, metadata = mooncake_master
    assert store_script(MooncakeDistributedStore, ReplicateConfig, master, metadata) == EXPECTED


def test_failures_are_return_codes() -> None:
    s = OurStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 1 << 20, "rdma", "", "127.0.0.1:1") < 0
    assert s.setup({"local_hostname": "127.0.0.1", "master_server_addr": "not an address"}) < 0
    with pytest.raises(AttributeError, match="supported"):
        s.batch_get_replica_desc  # noqa: B018
