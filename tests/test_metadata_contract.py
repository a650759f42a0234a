"""One contract, run unchanged over every metadata backend."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from helpers import EtcdServer

from mooncake_connectors.errors import MetadataError, SegmentNotFound
from mooncake_connectors.transfer_core.descriptor import RegionDesc, SegmentDesc
from mooncake_connectors.transfer_core.metadata import MetadataBackend, open_metadata
from mooncake_connectors.transfer_core.metadata.http import MetadataHTTPServer

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
