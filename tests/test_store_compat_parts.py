"""The calls LMCache's ``mooncakestore`` connector makes with ``save_chunk_meta`` (a header and
the KV bytes as one value): ``put_parts``, ``get_buffer``, ``batch_get_buffer``. One script, run
on ours and on Mooncake's own wheel, same answers."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from test_store_compat import mooncake_master  # noqa: F401  (the fixture)

from mooncake_connectors import compat_store
from mooncake_connectors.store import Master, MasterConfig


def parts_script(store_module: Any, master: str, metadata: str) -> dict[str, Any]:
    """Code written for Mooncake's store, unchanged (``store_module`` is ``mooncake.store``)."""
    s = store_module.MooncakeDistributedStore()
    out: dict[str, Any] = {}
    out["setup"] = s.setup("127.0.0.1", metadata, 64 << 20, 16 << 20, "tcp", "", master)
    kv = np.random.default_rng(7).integers(0, 256, 3 << 20, dtype=np.uint8)
    out["put_parts"] = s.put_parts("p", b"head", memoryview(b"body"), kv)
    out["get"] = s.get("p") == b"headbody" + kv.tobytes()
    out["put_again"] = s.put_parts("p", b"other")  # an existing key: 0, the value stays
    cfg = store_module.ReplicateConfig()
    cfg.replica_num = 1
    out["put_cfg"] = s.put_parts("c", bytearray(b"cc"), np.arange(4, dtype=np.int8), config=cfg)
    out["get_cfg"] = s.get("c") == b"cc\x00\x01\x02\x03"
    out["put_one"] = s.put_parts("one", b"x")
    out["put_empty_part"] = s.put_parts("e", b"", b"z")
    out["get_empty_part"] = s.get("e")
    out["put_nothing"] = [s.put_parts("n0"), s.put_parts("n1", b"", b"")]
    out["nothing_stored"] = s.batch_is_exist(["n0", "n1"])
    with pytest.raises(TypeError):
        s.put_parts("bad", 5)
    with pytest.raises(TypeError):
        s.put_parts("bad", "text")
    for shaped in (np.zeros((2, 2), np.uint8), np.arange(2, dtype=np.int32)):
        with pytest.raises(RuntimeError, match="1-D bytes-like"):
            s.put_parts("bad", shaped)
    out["bad_stored"] = s.is_exist("bad")
    h = s.get_buffer("p")
    out["handle_len"] = [len(h), h.size()]
    view = memoryview(h)
    out["handle_bytes"] = bytes(view) == b"headbody" + kv.tobytes()
    out["handle_writable"] = not view.readonly
    out["handle_ptr"] = h.ptr() != 0
    # what LMCache does with it: a tensor over the bytes after the header
    import torch

    t = torch.frombuffer(h, dtype=torch.uint8, offset=8, count=kv.nbytes)
    out["frombuffer"] = bool(np.array_equal(t.numpy(), kv))
    del t, view
    out["get_buffer_miss"] = s.get_buffer("nope")
    got = s.batch_get_buffer(["c", "nope", "one", "e"])
    out["batch_get_buffer"] = [None if b is None else bytes(memoryview(b)) for b in got]
    out["batch_get_buffer_empty"] = s.batch_get_buffer([])
    out["remove_all"] = s.remove_all(True)
    out["after"] = s.get_buffer("p")
    out["close"] = s.close()
    return out


EXPECTED = {
    "setup": 0,
    "put_parts": 0,
    "get": True,
    "put_again": 0,
    "put_cfg": 0,
    "get_cfg": True,
    "put_one": 0,
    "put_empty_part": 0,
    "get_empty_part": b"z",
    "put_nothing": [0, 0],
    "nothing_stored": [0, 0],
    "handle_len": [8 + (3 << 20)] * 2,
    "handle_bytes": True,
    "handle_writable": True,
    "handle_ptr": True,
    "frombuffer": True,
    "get_buffer_miss": None,
    "bad_stored": 0,
    "batch_get_buffer": [b"cc\x00\x01\x02\x03", None, b"x", b"z"],
    "batch_get_buffer_empty": [],
    "remove_all": 4,
    "after": None,
    "close": 0,
}


def test_parts_script_runs_on_ours() -> None:
    with Master(MasterConfig(port=0)) as master:
        assert parts_script(compat_store, master.address, "P2PHANDSHAKE") == EXPECTED


def test_same_script_same_answers_on_mooncake(
    mooncake_master: tuple[str, str],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    import mooncake.store

    master, metadata = mooncake_master
    assert parts_script(mooncake.store, master, metadata) == EXPECTED


def test_buffer_calls_answer_misses_when_the_store_is_gone() -> None:
    with Master(MasterConfig(port=0)) as master:
        s = compat_store.MooncakeDistributedStore()
        assert s.setup("127.0.0.1", "", 8 << 20, 1 << 20, "tcp", "", master.address) == 0
        assert s.put_parts("k", b"ab", b"cd") == 0
    try:  # the master stopped: a failure, not an exception
        assert s.batch_get_buffer(["k", "j"]) == [None, None]
        assert s.put_parts("k2", b"x") < 0
    finally:
        s.close()
