"""The calls vLLM's MooncakeStoreConnector makes: one script, run on ours and on Mooncake's own."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from test_store_compat import mooncake_master  # noqa: F401  (the fixture)

from mooncake_connectors import compat_store
from mooncake_connectors.store import Master, MasterConfig


def multi_script(store_module: Any, master: str, metadata: str) -> dict[str, Any]:
    """Code written for Mooncake's store, unchanged (``store_module`` is ``mooncake.store``)."""
    s = store_module.MooncakeDistributedStore()
    out: dict[str, Any] = {}
    # vLLM's setup_mooncake_store: seven positional arguments, tenant_id only when not default
    out["setup"] = s.setup("127.0.0.1", metadata, 64 << 20, 16 << 20, "tcp", "", master)
    buf = np.zeros(1 << 20, dtype=np.uint8)
    ptr = int(buf.ctypes.data)
    out["register"] = s.register_buffer(ptr, buf.nbytes)
    buf[:100] = np.arange(100, dtype=np.uint8)
    cfg = store_module.ReplicateConfig()
    out["has_preferred_segment"] = hasattr(cfg, "preferred_segment")
    out["put"] = s.batch_put_from_multi_buffers(
        ["m1", "m2"], [[ptr, ptr + 50], [ptr + 10]], [[10, 20], [5]], cfg
    )
    out["put_again"] = s.batch_put_from_multi_buffers(["m1"], [[ptr + 60]], [[30]], cfg)
    out["get"] = s.get("m1") == bytes(range(10)) + bytes(range(50, 70))
    out["get_size"] = s.get_size("m1")
    out["is_exist"] = s.batch_is_exist(["m1", "m2", "nope"])
    out["get_multi"] = s.batch_get_into_multi_buffers(
        ["m1", "m2", "nope"],
        [[ptr + 4096, ptr + 4200], [ptr + 5000], [ptr + 6000]],
        [[10, 20], [5], [8]],
    )
    out["get_multi_data"] = [
        bytes(buf[4096:4106]) == bytes(range(10)),
        bytes(buf[4200:4220]) == bytes(range(50, 70)),
        bytes(buf[5000:5005]) == bytes(range(10, 15)),
    ]
    out["get_one_buffer"] = s.batch_get_into_multi_buffers(["m1"], [[ptr + 7000]], [[30]])
    out["get_one_buffer_data"] = bytes(buf[7000:7030]) == bytes(buf[4096:4106]) + bytes(
        buf[4200:4220]
    )
    out["get_buffers_beyond_value"] = s.batch_get_into_multi_buffers(
        ["m1"], [[ptr + 8192, ptr + 9000]], [[15, 40]]
    )
    out["beyond_left_untouched"] = not buf[8192:9040].any()
    out["get_buffers_short_of_value"] = s.batch_get_into_multi_buffers(
        ["m1"], [[ptr + 10000, ptr + 11000]], [[10, 5]]
    )
    out["lists_differ"] = s.batch_put_from_multi_buffers(["a", "b"], [[ptr]], [[4]], cfg)
    out["pointers_and_sizes_differ"] = s.batch_put_from_multi_buffers(
        ["c"], [[ptr, ptr + 4]], [[4]], cfg
    )
    out["empty"] = [
        s.batch_put_from_multi_buffers([], [], [], cfg),
        s.batch_get_into_multi_buffers([], [], []),
    ]
    plain = np.zeros(4096, dtype=np.uint8)  # memory never registered
    plain[:8] = 7
    p = int(plain.ctypes.data)
    out["unregistered_put"] = s.batch_put_from_multi_buffers(["u"], [[p, p + 4]], [[4, 4]], cfg)
    out["unregistered_get"] = s.batch_get_into_multi_buffers(
        ["u", "m2"], [[p + 100], [p + 200]], [[8], [5]]
    )
    out["unregistered_data"] = [bytes(plain[100:108]), bytes(plain[200:205])]
    tensor = store_module.ReplicateConfig()
    tensor.data_type = store_module.ObjectDataType.TENSOR  # vLLM's embedding store does this
    out["put_tensor"] = s.batch_put_from_multi_buffers(["t"], [[ptr, ptr + 8]], [[8, 8]], tensor)
    out["remove_all"] = s.remove_all(True)
    out["close"] = s.close()
    return out


EXPECTED = {
    "setup": 0,
    "register": 0,
    "has_preferred_segment": True,
    "put": [0, 0],
    "put_again": [0],  # an existing key: 0, the value stays
    "get": True,
    "get_size": 30,
    "is_exist": [1, 1, 0],
    "get_multi": [30, 5, -704],
    "get_multi_data": [True, True, True],
    "get_one_buffer": [30],
    "get_one_buffer_data": True,
    "get_buffers_beyond_value": [-800],
    "beyond_left_untouched": True,
    "get_buffers_short_of_value": [-600],
    "lists_differ": [-600, -600],
    "pointers_and_sizes_differ": [-600],
    "empty": [[], []],
    "unregistered_put": [0],
    "unregistered_get": [8, 5],
    "unregistered_data": [b"\x07" * 8, bytes(range(10, 15))],
    "put_tensor": [0],
    "remove_all": 4,
    "close": 0,
}


def test_multi_buffer_script_runs_on_ours() -> None:
    with Master(MasterConfig(port=0)) as master:
        assert multi_script(compat_store, master.address, "P2PHANDSHAKE") == EXPECTED


def test_same_script_same_answers_on_mooncake(
    mooncake_master: tuple[str, str],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    import mooncake.store

    master, metadata = mooncake_master
    assert multi_script(mooncake.store, master, metadata) == EXPECTED


def test_multi_buffer_refusals_are_return_codes() -> None:
    with Master(MasterConfig(port=0)) as master:
        s = compat_store.MooncakeDistributedStore()
        assert s.setup("127.0.0.1", "", 8 << 20, 1 << 20, "tcp", "", master.address) == 0
        try:
            # memory that is not this process's is refused, never read or written
            assert s.batch_put_from_multi_buffers(["k"], [[8, 16]], [[4, 4]]) == [-600]
            assert s.batch_put_from_multi_buffers(["k"], [[0]], [[-1]]) == [-600]
            assert s.put("k", b"abcd") == 0
            assert s.batch_get_into_multi_buffers(["k"], [[8, 16]], [[2, 2]]) == [-600]
        finally:
            s.close()
        # a tenant other than the default would share keys with every other: refused
        t = compat_store.MooncakeDistributedStore()
        rc = t.setup("127.0.0.1", "", 8 << 20, 1 << 20, "tcp", "", master.address, tenant_id="a")
        assert rc == -600
