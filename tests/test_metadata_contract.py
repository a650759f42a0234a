"""One contract, run unchanged over every metadata backend."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest
from helpers import EtcdServer, wait_until

from mooncake_connectors.config import EngineConfig
from mooncake_connectors.errors import MetadataError, SegmentNotFound
from mooncake_connectors.transfer_core import TransferEngine
from mooncake_connectors.transfer_core.descriptor import RegionDesc, SegmentDesc
from mooncake_connectors.transfer_core.metadata import MetadataBackend, open_metadata
from mooncake_connectors.transfer_core.metadata.http import MetadataHTTPServer
from mooncake_connectors.transfer_core.metadata.memory import MemoryMetadata

Pair = tuple[MetadataBackend, MetadataBackend]


@pytest.fixture(params=["memory", "http", "etcd", "p2p"])
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    """Two handles on one metadata service, as two processes would hold."""
    kind = request.param
    cleanup: list[Callable[[], None]] = []
    if kind == "memory":
        a, b = open_metadata("memory://contract"), open_metadata("memory://contract")
    elif kind == "http":
        srv = MetadataHTTPServer("127.0.0.1", 0).start()
        cleanup.append(srv.stop)
        a, b = open_metadata(srv.url), open_metadata(srv.url)
    elif kind == "etcd":
        etcd: EtcdServer = request.getfixturevalue("etcd")
        a, b = open_metadata(etcd.url + "/contract"), open_metadata(etcd.url + "/contract")
    else:
        a, b = open_metadata("p2p"), open_metadata("p2p")
    yield a, b
    for x in (a, b):
        if kind != "p2p":
            for k in x.list(""):
                x.delete(k)
        x.close()
    for f in cleanup:
        f()


def _desc(name: str, epoch: int = 0) -> SegmentDesc:
    return SegmentDesc(
        name=name,
        host_id="h",
        pid=1,
        epoch=epoch,
        endpoints={"tcp": "127.0.0.1:1"},
        regions=[RegionDesc(addr=4096, length=8192, rdma_rkeys={"mlx5_0": 7}, memfd=3)],
    )


def test_publish_then_lookup_from_another_handle(pair: Pair) -> None:
    a, b = pair
    name = a.segment_name("seg-a")
    a.publish_segment(_desc(name))
    got = b.lookup_segment(name)
    assert got == _desc(name)
    assert got.regions[0].rdma_rkeys == {"mlx5_0": 7}  # room for later transports travels


def test_update_is_visible(pair: Pair) -> None:
    a, b = pair
    name = a.segment_name("seg-u")
    a.publish_segment(_desc(name, epoch=1))
    a.publish_segment(_desc(name, epoch=2))
    assert b.lookup_segment(name).epoch == 2


def test_unknown_segment_is_not_found(pair: Pair) -> None:
    _, b = pair
    with pytest.raises(SegmentNotFound):
        b.lookup_segment("127.0.0.1:1")  # nothing listens there, nothing is published


def test_removed_segment_is_gone(pair: Pair) -> None:
    a, b = pair
    name = a.segment_name("seg-r")
    a.publish_segment(_desc(name))
    assert a.remove_segment(name)
    with pytest.raises(SegmentNotFound):
        b.lookup_segment(name)


def test_garbage_descriptor_is_a_metadata_error(pair: Pair) -> None:
    a, b = pair
    name = a.segment_name("seg-g")
    a.put("segments/" + name, b"\x00not msgpack")
    with pytest.raises(MetadataError):
        b.lookup_segment(name)


@pytest.mark.parametrize("kind", ["memory", "http", "etcd"])
def test_key_value_contract(kind: str, request: pytest.FixtureRequest) -> None:
    if kind == "etcd":
        url = request.getfixturevalue("etcd").url + "/kv"
        srv = None
    elif kind == "http":
        srv = MetadataHTTPServer("127.0.0.1", 0).start()
        url = srv.url
    else:
        url, srv = "memory://kv", None
    m = open_metadata(url)
    try:
        assert m.get("k/missing") is None
        m.put("k/a", b"1")
        m.put("k/b", b"\x00\xff" * 1000)
        m.put("other", b"x")
        assert m.get("k/b") == b"\x00\xff" * 1000
        assert m.list("k/") == {"k/a": b"1", "k/b": b"\x00\xff" * 1000}
        assert m.delete("k/a") is True
        assert m.delete("k/a") is False
        assert set(m.list("k/")) == {"k/b"}
    finally:
        for k in m.list(""):
            m.delete(k)
        m.close()
        if srv is not None:
            srv.stop()


# -- a descriptor lives as long as its publisher ---------------------------------------------------
def test_a_leased_descriptor_expires_unless_renewed(pair: Pair) -> None:
    a, b = pair
    name = a.segment_name("seg-l")
    a.publish_segment(_desc(name), lease=1.0)
    assert b.lookup_segment(name) == _desc(name)
    if not a.central:  # memory, p2p: in-process, the descriptor goes with its process
        return
    t0 = time.monotonic()
    while time.monotonic() - t0 < 2.0:  # renewed: it stays (etcd rounds a lease up to 2 s)
        a.publish_segment(_desc(name, epoch=1), lease=1.0)
        assert b.lookup_segment(name).epoch == 1
        later = time.monotonic() + 0.3
        wait_until(lambda at=later: time.monotonic() > at, 5, "0.3 s")
    wait_until(lambda: gone(b, name), 15, "the lease to run out")
    a.publish_segment(_desc(name))  # and without a lease nothing expires it
    assert b.lookup_segment(name) == _desc(name)


def test_an_engine_withdraws_its_descriptor_at_close(pair: Pair) -> None:
    a, b = pair
    url = a.url if a.central else "p2p"  # type: ignore[attr-defined]
    if isinstance(a, MemoryMetadata):
        url = "memory://contract"
    cfg = EngineConfig(metadata=url, transports=("tcp",), metadata_lease=1.0)
    e = TransferEngine(cfg).start()
    name = e.segment_name
    assert b.lookup_segment(name).pid == os.getpid()
    if a.central:  # its keep-alive renews the lease: still there after two of them
        later = time.monotonic() + 2.5
        wait_until(lambda: time.monotonic() > later, 10, "2.5 s")
        assert b.lookup_segment(name).pid == os.getpid()
    e.close()
    assert gone(b, name)


def gone(m: MetadataBackend, name: str) -> bool:
    try:
        m.lookup_segment(name)
    except SegmentNotFound:
        return True
    return False


EXITS = """
import os, sys
from mooncake_connectors.config import EngineConfig
from mooncake_connectors.transfer_core import TransferEngine
e = TransferEngine(EngineConfig(metadata=sys.argv[1], transports=("tcp",), metadata_lease=1.0))
print(e.start().segment_name, flush=True)
if sys.argv[2] == "_exit":
    os._exit(0)  # no atexit: only the lease can end the descriptor
"""  # (and "exit": ends without close(), as a compat script does)


@pytest.mark.parametrize("how", ["exit", "_exit"])
@pytest.mark.parametrize("kind", ["http", "etcd"])
def test_a_process_that_exits_without_close_leaves_no_descriptor(
    kind: str, how: str, request: pytest.FixtureRequest
) -> None:
    srv = None
    if kind == "etcd":
        url = request.getfixturevalue("etcd").url + "/exits"
    else:
        srv = MetadataHTTPServer("127.0.0.1", 0).start()
        url = srv.url
    m = open_metadata(url)
    try:
        proc = subprocess.run(
            [sys.executable, "-c", EXITS, url, how], capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        name = proc.stdout.split()[-1]
        t0 = time.monotonic()
        if how == "exit":
            assert gone(m, name)  # withdrawn at exit
        else:
            wait_until(lambda: gone(m, name), 15, "the lease to run out")
            assert time.monotonic() - t0 < 10.0
    finally:
        m.close()
        if srv is not None:
            srv.stop()
