"""The Python API's boundaries: raw addresses that are not this process's memory, values of the
wrong kind, keys that are no UTF-8, a key twice in one batch. Each is a typed error (or, in the
compat facades, a negative return code), never a crash nor a foreign exception. Calls that crash
a process without the checks run in a child process, so a crash fails the test, not pytest."""

from __future__ import annotations

import json
import mmap
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from mooncake_connectors.compat import MooncakeDistributedStore
from mooncake_connectors.compat import TransferEngine as CompatEngine
from mooncake_connectors.config import EngineConfig
from mooncake_connectors.errors import AccessViolation, ConfigError, ObjectExists
from mooncake_connectors.store import ClientConfig, Master, MasterConfig, StoreClient
from mooncake_connectors.transfer_core import TransferEngine, TransferRequest
from mooncake_connectors.types import Access, TransferOp, TransferStatus

BAD_ADDRESSES = [0, 0x10, 1 << 46]  # null, just past null, unmapped high user space


def run_child(code: str, timeout: float = 60) -> dict[str, Any]:
    """Run ``code`` (which prints one JSON line last) in a fresh interpreter."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"child died (rc={proc.returncode}):\n{proc.stderr[-3000:]}"
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


@pytest.fixture(scope="module")
def master() -> Iterator[Master]:
    with Master(MasterConfig(port=0)) as m:
        yield m


# -- raw addresses -----------------------------------------------------------------------------
def test_check_mapped_tells_mapped_from_unmapped_and_read_only() -> None:
    from mooncake_connectors.transfer_core.memory import check_mapped

    arr = np.zeros(3 * mmap.PAGESIZE, np.uint8)
    check_mapped(int(arr.ctypes.data), arr.nbytes, write=True)
    for addr in BAD_ADDRESSES:
        with pytest.raises(AccessViolation):
            check_mapped(addr, 4096)
    ro = mmap.mmap(-1, 2 * mmap.PAGESIZE, prot=mmap.PROT_READ)
    addr = int(np.frombuffer(ro, np.uint8).ctypes.data)
    check_mapped(addr, 2 * mmap.PAGESIZE)
    with pytest.raises(AccessViolation, match="writable"):
        check_mapped(addr, 2 * mmap.PAGESIZE, write=True)
    with pytest.raises(AccessViolation):  # runs past its end into what is not ours
        check_mapped(addr + mmap.PAGESIZE, 1 << 40)


def test_check_mapped_reads_the_map_only_when_the_last_read_cannot_vouch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Reading /proc/self/maps costs ~0.4 ms in a vLLM worker, once per registration (vLLM's EC
    connector registers every encoder output it pushes). A range still mapped that the last read
    granted is taken without a read; an unmapped, new or read-only one still gets the real map."""
    from mooncake_connectors.transfer_core import memory

    reads = []
    real = memory.mappings

    def counted() -> Any:
        reads.append(1)
        return real()

    monkeypatch.setattr(memory, "mappings", counted)
    arr = np.zeros(3 * mmap.PAGESIZE, np.uint8)
    addr = int(arr.ctypes.data)
    memory.check_mapped(addr, arr.nbytes, write=True)
    before = len(reads)
    for _ in range(5):
        memory.check_mapped(addr, arr.nbytes, write=True)
        assert memory.unmapped([(addr, arr.nbytes)], write=True) == {}
    assert len(reads) == before  # vouched for by the last read: no read

    fresh = mmap.mmap(-1, 4 * mmap.PAGESIZE)  # mapped after the last read
    faddr = int(np.frombuffer(fresh, np.uint8).ctypes.data)
    memory.check_mapped(faddr, 4 * mmap.PAGESIZE, write=True)
    assert len(reads) == before + 1
    del arr
    ro = mmap.mmap(-1, 2 * mmap.PAGESIZE, prot=mmap.PROT_READ)
    raddr = int(np.frombuffer(ro, np.uint8).ctypes.data)
    for _ in range(2):  # the last read says read-only: refused each time, never vouched for
        with pytest.raises(AccessViolation, match="writable"):
            memory.check_mapped(raddr, 2 * mmap.PAGESIZE, write=True)
    memory.check_mapped(raddr, 2 * mmap.PAGESIZE)
    fresh.close()  # unmapped after the last read granted it
    with pytest.raises(AccessViolation, match="not mapped"):
        memory.check_mapped(faddr, 4 * mmap.PAGESIZE)
    assert 1 in memory.unmapped([(raddr, mmap.PAGESIZE), (faddr, mmap.PAGESIZE)])


def test_engine_refuses_raw_ranges_that_are_not_its_memory() -> None:
    out = run_child(
        """
        import json, mmap
        import numpy as np
        from mooncake_connectors.compat import TransferEngine as Compat
        from mooncake_connectors.config import EngineConfig
        from mooncake_connectors.errors import AccessViolation
        from mooncake_connectors.transfer_core import TransferEngine
        from mooncake_connectors.types import Access

        res = {}
        cfg = EngineConfig(metadata="memory", transports=("shm", "tcp"))
        a, b = TransferEngine(cfg).start(), TransferEngine(cfg).start()
        buf = b.allocate_buffer(1 << 16)
        for addr in (0, 0x10, 1 << 46):
            try:
                a.register_raw(addr, 4096)
                res[hex(addr)] = "registered"
                b.read(a.segment_name, buf.addr, addr, 4096, timeout=5)  # crashes a shm peer
                a.read(b.segment_name, addr, buf.addr, 4096, timeout=5)
            except AccessViolation as exc:
                res[hex(addr)] = "AccessViolation"
        ro = mmap.mmap(-1, 8192, prot=mmap.PROT_READ)
        ro_addr = int(np.frombuffer(ro, np.uint8).ctypes.data)
        try:
            a.register_raw(ro_addr, 8192)
            res["read-only for writes"] = "registered"
        except AccessViolation:
            res["read-only for writes"] = "AccessViolation"
        res["read-only for reads"] = a.register_raw(ro_addr, 8192, access=Access.READ).length
        good = np.ones(8192, np.uint8)
        try:  # one bad range refuses the call and registers none of it
            a.register_many([(int(good.ctypes.data), 8192), (0x10, 4096)])
        except AccessViolation:
            pass
        res["partial"] = a.local.find(int(good.ctypes.data), 8192) is not None
        c = Compat()
        c.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
        res["compat"] = [c.register_memory(0, 4096), c.batch_register_memory([0x10], [4096])]
        c.close(); a.close(); b.close()
        print(json.dumps(res))
        """
    )
    assert out == {
        "0x0": "AccessViolation",
        "0x10": "AccessViolation",
        hex(1 << 46): "AccessViolation",
        "read-only for writes": "AccessViolation",
        "read-only for reads": 8192,
        "partial": False,
        "compat": [-1, -1],
    }


def test_store_refuses_raw_addresses_that_are_not_its_memory(master: Master) -> None:
    out = run_child(
        f"""
        import json
        from mooncake_connectors.compat import MooncakeDistributedStore
        from mooncake_connectors.errors import AccessViolation
        from mooncake_connectors.store import ClientConfig, StoreClient

        res = {{}}
        c = StoreClient(ClientConfig(master={master.address!r}, global_segment_size=8 << 20))
        c.start()
        c.put("real", b"x" * 4096)
        for addr in (0, 0x10):
            for what, call in (
                ("put_from", lambda: c.put_from(f"k{{addr}}", addr, 4096)),
                ("get_into", lambda: c.get_into("real", addr, 4096)),
                ("register_buffer", lambda: c.register_buffer(addr, 4096)),
            ):
                try:
                    call()
                    res[f"{{what}} {{addr}}"] = "ok"
                except AccessViolation:
                    res[f"{{what}} {{addr}}"] = "AccessViolation"
        c.put("again", b"y")  # a refused put leaves no key, no allocation behind
        res["after"] = [c.exists("k0"), c.exists("k16"), c.get("again").decode()]
        c.close()
        s = MooncakeDistributedStore()
        s.setup("127.0.0.1", "P2PHANDSHAKE", 8 << 20, 1 << 20, "tcp", "", {master.address!r})
        s.put("real2", b"z" * 100)
        res["compat"] = [
            s.put_from("c", 0, 4096),
            s.get_into("real2", 0x10, 4096),
            s.register_buffer(0, 4096),
            s.batch_put_from(["c1", "c2"], [0x10, 0], [10, 10]),
            s.batch_get_into(["real2"], [0], [4096]),
        ]
        s.close()
        print(json.dumps(res))
        """
    )
    for addr in (0, 16):
        for what in ("put_from", "get_into", "register_buffer"):
            assert out[f"{what} {addr}"] == "AccessViolation", (what, addr)
    assert out["after"] == [False, False, "y"]
    codes = out["compat"]
    assert codes == [-600, -600, -600, [-600, -600], [-600]], codes


# -- wrong kinds of values -----------------------------------------------------------------------
def test_transfer_requests_with_bad_fields_are_config_errors() -> None:
    cfg = EngineConfig(metadata="memory", transports=("tcp",))
    with TransferEngine(cfg) as a, TransferEngine(cfg) as b:
        src, dst = a.allocate_buffer(4096), b.allocate_buffer(4096)
        src.array[:] = 7
        peer = b.segment_name
        for bad in (
            TransferRequest(5, peer, src.addr, dst.addr, 10),  # type: ignore[arg-type]
            TransferRequest("WRITE", peer, src.addr, dst.addr, 10),  # type: ignore[arg-type]
            TransferRequest(TransferOp.WRITE, peer, src.addr, dst.addr, "10"),  # type: ignore[arg-type]
            TransferRequest(TransferOp.WRITE, peer, None, dst.addr, 10),  # type: ignore[arg-type]
            TransferRequest(TransferOp.WRITE, 7, src.addr, dst.addr, 10),  # type: ignore[arg-type]
            TransferRequest(TransferOp.WRITE, "seg\ud800", src.addr, dst.addr, 10),
        ):
            with pytest.raises(ConfigError):
                a.transfer([bad])
            batch = a.submit([bad])
            assert batch.wait(5) and batch.statuses == [TransferStatus.FAILED]
            assert isinstance(batch.errors[0], ConfigError)
        assert not dst.array.any()  # none of them moved a byte
        # a plain 1 is WRITE (not silently a READ), numpy ints are ints
        a.transfer([TransferRequest(1, peer, src.addr, dst.addr, np.int64(100))])  # type: ignore[arg-type]
        assert (dst.array[:100] == 7).all() and not dst.array[100:].any()


def test_an_allocation_the_host_cannot_back_is_a_config_error() -> None:
    with TransferEngine(EngineConfig(metadata="memory", transports=("tcp",))) as eng:
        for size in (1 << 50, 1 << 70, 1.5, "4096"):  # ENOMEM, past a C long, not ints
            with pytest.raises(ConfigError, match="buffer"):
                eng.allocate_buffer(size)  # type: ignore[arg-type]
        assert eng.allocate_buffer(np.int64(4096)).size == 4096  # numpy ints are ints
    c = CompatEngine()
    assert c.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    try:
        assert c.allocate_managed_buffer(1 << 50) == 0
    finally:
        c.close()


def test_values_that_are_no_buffers_are_config_errors(master: Master) -> None:
    with StoreClient(ClientConfig(master=master.address, global_segment_size=4 << 20)) as c:
        for value in ("str", None, 7, object()):
            with pytest.raises(ConfigError, match=f"not {type(value).__name__}"):
                c.put("v", value)
            with pytest.raises(ConfigError):
                c.put_batch(["fine", "v"], [b"1", value])
        assert not c.exists("v") and not c.exists("fine")  # a refused batch stored nothing


@pytest.mark.parametrize("key", ["\ud800", "a\udfffb", "", "k" * 5000])
def test_bad_keys_are_config_errors_in_client_and_compat(master: Master, key: str) -> None:
    with StoreClient(ClientConfig(master=master.address, global_segment_size=4 << 20)) as c:
        for call in (
            lambda: c.put(key, b"v"),
            lambda: c.put_batch(["fine", key], [b"1", b"2"]),
            lambda: c.get(key),
            lambda: c.get_batch(["fine", key]),
            lambda: c.exists(key),
            lambda: c.remove(key),
            lambda: c.get_into(key, 0, 0),
            lambda: c.put("fine", b"v", preferred_segment=key) if key else c.put("", b""),
        ):
            with pytest.raises(ConfigError):
                call()
        assert not c.exists("fine")  # a refused batch stored nothing
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 4 << 20, 1 << 20, "tcp", "", master.address) == 0
    try:
        assert s.put(key, b"v") == -600 and s.put_batch([key], [b"v"]) == -600
        assert s.get(key) == b"" and s.is_exist(key) == -1 and s.get_size(key) < 0
        assert s.remove(key) < 0
    finally:
        s.close()


# -- a key twice in one batch --------------------------------------------------------------------
def test_a_key_twice_in_one_batch_keeps_the_first_value(master: Master) -> None:
    with StoreClient(ClientConfig(master=master.address, global_segment_size=4 << 20)) as c:
        errs = c.put_batch(["d1", "e1", "d1"], [b"first", b"other", b"second!"])
        assert errs[0] is None and errs[1] is None and isinstance(errs[2], ObjectExists)
        assert c.get("d1") == b"first" and c.get("e1") == b"other"
        buf = np.frombuffer(bytearray(b"AAAABBBBB"), np.uint8)
        addr = c.register_buffer(buf)
        errs = c.batch_put_from(["d2", "d2"], [addr, addr + 4], [4, 5])
        assert errs[0] is None and isinstance(errs[1], ObjectExists)
        assert c.get("d2") == b"AAAA"
        c.unregister_buffer(addr)
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 4 << 20, 1 << 20, "tcp", "", master.address) == 0
    try:
        # as for a key that already exists: 0, and the stored (first) value stays
        assert s.put_batch(["d3", "d3"], [b"first", b"second!"]) == 0
        assert s.get("d3") == b"first"
        arr = np.frombuffer(bytearray(b"CCCCDDDDD"), np.uint8)
        ptr = int(arr.ctypes.data)
        assert s.register_buffer(ptr, arr.nbytes) == 0
        assert s.batch_put_from(["d4", "d4"], [ptr, ptr + 4], [4, 5]) == [0, 0]
        assert s.get("d4") == b"CCCC" and s.get_size("d4") == 4
    finally:
        s.close()


def test_compat_engine_register_of_a_good_buffer_still_works() -> None:
    c = CompatEngine()
    assert c.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    try:
        arr = np.zeros(1 << 16, np.uint8)
        assert c.register_memory(int(arr.ctypes.data), arr.nbytes) == 0
        ro = np.frombuffer(b"\0" * 8192, np.uint8)  # read-only bytes: refused for writes
        assert ro.flags.writeable is False
        assert c.get_engine().register_raw(int(ro.ctypes.data), 8192, access=Access.READ)
    finally:
        c.close()
