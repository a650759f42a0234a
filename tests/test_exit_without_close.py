"""Scripts written for Mooncake's API call no close(): such a process must still exit. At
interpreter exit the facades' finalizers wait on nothing (our threads are frozen by then)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest
from helpers import free_port

from mooncake_connectors.store import Master, MasterConfig
from mooncake_connectors.transfer_core.metadata.http import MetadataHTTPServer

EXIT_DEADLINE = 30.0  # a process that waits on a frozen thread never exits: any bound shows it


@pytest.fixture(scope="module")
def master() -> Iterator[Master]:
    with Master(MasterConfig(port=0)) as m:
        yield m


def exits(code: str) -> str:
    try:
        proc = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            capture_output=True,
            text=True,
            timeout=EXIT_DEADLINE,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the process did not exit within {EXIT_DEADLINE} s")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.parametrize("metadata", ["P2PHANDSHAKE", "http", "embedded-http"])
def test_compat_engine_without_close_exits(metadata: str) -> None:
    srv = MetadataHTTPServer("127.0.0.1", 0).start() if metadata == "http" else None
    try:
        if srv is not None:
            url = srv.url
        elif metadata == "embedded-http":  # the first engine serves it itself, in-process
            url = f"http://127.0.0.1:{free_port()}/metadata"
        else:
            url = metadata
        out = exits(
            f"""
            from mooncake_connectors.compat import TransferEngine
            a, b = TransferEngine(), TransferEngine()
            assert a.initialize("127.0.0.1", {url!r}, "tcp", "") == 0
            assert b.initialize("127.0.0.1", {url!r}, "tcp", "") == 0
            src = a.allocate_managed_buffer(1 << 20)
            dst = b.allocate_managed_buffer(1 << 20)
            target = b.get_engine().segment_name
            assert a.transfer_sync_write(target, src, dst, 1 << 20) == 0
            print("moved")
            """
        )
        assert "moved" in out
    finally:
        if srv is not None:
            srv.stop()


def test_compat_store_without_close_exits(master: Master) -> None:
    out = exits(
        f"""
        from mooncake_connectors.compat import MooncakeDistributedStore
        s = MooncakeDistributedStore()
        assert s.setup("127.0.0.1", "P2PHANDSHAKE", 8 << 20, 1 << 20, "tcp", "",
                       {master.address!r}) == 0
        assert s.put("k", b"v" * 1000) == 0 and s.get("k") == b"v" * 1000
        print("stored")
        """
    )
    assert "stored" in out


def test_a_facade_dropped_mid_program_closes_and_the_program_goes_on(master: Master) -> None:
    out = exits(
        f"""
        import gc
        from mooncake_connectors.compat import MooncakeDistributedStore, TransferEngine
        te = TransferEngine()
        assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        s = MooncakeDistributedStore()
        assert s.setup("127.0.0.1", "P2PHANDSHAKE", 8 << 20, 1 << 20, "tcp", "",
                       {master.address!r}) == 0
        del te, s
        gc.collect()
        print("closed", flush=True)
        """
    )
    assert "closed" in out
