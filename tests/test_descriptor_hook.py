"""Transports describe their own descriptor fields; the engine merges them before publishing.

The transports here are small real Transport subclasses registered at run time (a third-party
plugin would be the same); the engine, the merge and the metadata backend are the real ones.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import ClassVar

import msgspec
import pytest

from mooncake_connectors.config import DEFAULT_TRANSPORTS, EngineConfig, engine_config_from_env
from mooncake_connectors.errors import ConfigError, PluginError
from mooncake_connectors.transfer_core import TransferEngine
from mooncake_connectors.transfer_core.descriptor import (
    ENGINE_REGION_FIELDS,
    RegionDesc,
    SegmentDesc,
    merge_fields,
)
from mooncake_connectors.transfer_core.memory import Region
from mooncake_connectors.transfer_core.transport import (
    TRANSPORTS,
    Slice,
    Transport,
    TransportSettings,
)


class _Describing(Transport):
    """Reaches nothing; publishes what its class attributes say."""

    region_fields: ClassVar[Mapping[str, object]] = {}
    segment_fields: ClassVar[Mapping[str, object]] = {}

    def start(self) -> dict[str, str]:
        return {}

    def reachable(self, peer: SegmentDesc, region: RegionDesc) -> bool:
        return False

    def submit(
        self, peer: SegmentDesc, slices: Sequence[Slice], *, inline_ok: bool = False
    ) -> None:
        raise AssertionError("never reachable, never submitted to")

    def close(self) -> None:
        pass

    def describe_region(self, region: Region) -> Mapping[str, object]:
        return {k: (v(region) if callable(v) else v) for k, v in self.region_fields.items()}

    def describe_segment(self) -> Mapping[str, object]:
        return self.segment_fields


class _NicA(_Describing):
    name = "nic_a"
    region_fields = {"rdma_rkeys": {"mlx5_0": 11}}
    segment_fields = {"rdma_gids": {"mlx5_0": "fe80::1"}}


class _NicB(_Describing):
    name = "nic_b"
    region_fields = {"rdma_rkeys": {"mlx5_1": 22}}
    segment_fields = {"rdma_gids": {"mlx5_1": "fe80::2"}}


class _NicClash(_Describing):
    name = "nic_clash"
    region_fields = {"rdma_rkeys": {"mlx5_0": 99}}


class _Ipc(_Describing):
    name = "ipc_like"
    region_fields = {
        "cuda_exports": lambda r: [
            {
                "kind": "ipc",
                "handle": r.addr.to_bytes(8, "little"),
                "alloc_size": r.length,
                "alloc_offset": 0,
                "region_offset": 0,
                "length": r.length,
            }
        ]
    }


class _Greedy(_Describing):
    name = "greedy"
    region_fields = {"length": 1}


class _Typo(_Describing):
    name = "typo"
    region_fields = {"rdma_rkey": {"x": 1}}


class _BadType(_Describing):
    name = "bad_type"
    region_fields = {"memfd": "three"}


class _Knobs(TransportSettings, frozen=True, forbid_unknown_fields=True):
    depth: int = 2


class _WithSettings(_Describing):
    name = "knobs"
    Settings = _Knobs


@pytest.fixture(scope="module", autouse=True)
def _registered() -> None:
    for cls in (_NicA, _NicB, _NicClash, _Ipc, _Greedy, _Typo, _BadType, _WithSettings):
        TRANSPORTS.register(cls.name, cls)


@pytest.fixture
def engines() -> Iterator[list[TransferEngine]]:
    made: list[TransferEngine] = []
    yield made
    for e in made:
        e.close()


def _engine(made: list[TransferEngine], *transports: str, **kw: object) -> TransferEngine:
    cfg = EngineConfig(metadata="memory", transports=transports, **kw)  # type: ignore[arg-type]
    e = TransferEngine(cfg)
    made.append(e)
    return e.start()


def test_fields_of_several_transports_are_merged_and_published(
    engines: list[TransferEngine],
) -> None:
    e = _engine(engines, "tcp", "nic_a", "nic_b", "ipc_like")
    buf = e.allocate_buffer(4096)
    assert e.metadata is not None
    desc = e.metadata.lookup_segment(e.segment_name)  # what a peer reads
    assert desc.rdma_gids == {"mlx5_0": "fe80::1", "mlx5_1": "fe80::2"}
    (region,) = desc.regions
    assert region.rdma_rkeys == {"mlx5_0": 11, "mlx5_1": 22}
    (export,) = region.cuda_exports  # a plain dict came in, a typed CudaExport went out
    assert export.handle == buf.addr.to_bytes(8, "little") and export.length == 4096
    assert region.memfd == -1  # shm is not enabled, so nobody published the memfd


def test_shm_publishes_memfd_through_the_hook(engines: list[TransferEngine]) -> None:
    e = _engine(engines, *DEFAULT_TRANSPORTS)
    buf = e.allocate_buffer(4096)
    assert e.metadata is not None
    (region,) = e.metadata.lookup_segment(e.segment_name).regions
    assert region.memfd == buf.fd and region.memfd_inode > 0


def test_one_key_from_two_transports_is_refused(engines: list[TransferEngine]) -> None:
    e = _engine(engines, "tcp", "nic_a", "nic_clash")
    with pytest.raises(PluginError, match=r"both describe RegionDesc\.rdma_rkeys") as info:
        e.allocate_buffer(4096)
    assert {info.value.first, info.value.second} == {"nic_a", "nic_clash"}


@pytest.mark.parametrize(
    ("name", "match"),
    [("greedy", "engine's own"), ("typo", "not a field"), ("bad_type", "Expected `int`")],
)
def test_bad_contributions_fail_at_publish(
    engines: list[TransferEngine], name: str, match: str
) -> None:
    e = _engine(engines, "tcp", name)
    with pytest.raises(PluginError, match=match):
        e.allocate_buffer(4096)


def test_merge_leaves_a_descriptor_alone_when_nothing_is_added() -> None:
    d = RegionDesc(addr=4096, length=10)
    assert merge_fields(d, [("a", {}), ("b", {})], ENGINE_REGION_FIELDS) is d
    got = merge_fields(d, [("a", {"memfd": 3, "memfd_inode": 9})], ENGINE_REGION_FIELDS)
    assert (got.memfd, got.memfd_inode, got.addr) == (3, 9, 4096)
    # what went out decodes as it came in: the fields survive the wire
    wire = msgspec.msgpack.encode(got)
    assert msgspec.msgpack.decode(wire, type=RegionDesc) == got


def test_transport_settings_are_checked_by_their_transport(
    engines: list[TransferEngine],
) -> None:
    e = _engine(engines, "tcp", "knobs", transport_settings={"knobs": {"depth": 5}})
    assert e.transports[1].name == "knobs"
    with pytest.raises(ConfigError, match="depth"):
        _engine(engines, "tcp", "knobs", transport_settings={"knobs": {"depth": "deep"}})
    with pytest.raises(ConfigError, match="unknown field `dept`"):
        _engine(engines, "tcp", "knobs", transport_settings={"knobs": {"dept": 5}})
    with pytest.raises(ConfigError, match="not enabled"):
        EngineConfig(transports=("tcp",), transport_settings={"knobs": {}})
    with pytest.raises(ConfigError, match="unknown field"):
        _engine(engines, "tcp", transport_settings={"tcp": {"lane": 2}})


def test_tcp_lanes_setting_lives_with_tcp(engines: list[TransferEngine]) -> None:
    peer = SegmentDesc(name="p", host_id="h", pid=1, endpoints={"tcp": "127.0.0.1:1"})
    e = _engine(engines, "tcp", transport_settings={"tcp": {"lanes": 3}})
    assert e.transports[0].lanes(peer) == 3
    e2 = _engine(engines, "tcp", tcp_lanes=2)  # the engine-wide knob still works alone
    assert e2.transports[0].lanes(peer) == 2
    with pytest.raises(ConfigError, match=r"1\.\.64"):
        _engine(engines, "tcp", transport_settings={"tcp": {"lanes": 0}})


def test_transport_settings_from_the_environment() -> None:
    env = {
        "MOONCAKE_CONNECTORS_TRANSPORTS": "tcp",
        "MOONCAKE_CONNECTORS_TRANSPORT_SETTINGS": '{"tcp": {"lanes": 6}}',
    }
    assert engine_config_from_env(env).transport_settings == {"tcp": {"lanes": 6}}
    with pytest.raises(ConfigError, match="not valid"):
        engine_config_from_env({"MOONCAKE_CONNECTORS_TRANSPORT_SETTINGS": "{"})
    with pytest.raises(ConfigError, match="not valid"):
        engine_config_from_env({"MOONCAKE_CONNECTORS_TRANSPORT_SETTINGS": "[1]"})


def test_transports_that_publish_the_same_value_agree() -> None:
    d = RegionDesc(addr=4096, length=10)
    memfd = {"memfd": 7, "memfd_inode": 99}
    got = merge_fields(d, [("shm", memfd), ("cuda_ipc", dict(memfd))], ENGINE_REGION_FIELDS)
    assert (got.memfd, got.memfd_inode) == (7, 99)
    with pytest.raises(PluginError, match="both describe"):
        merge_fields(d, [("shm", memfd), ("other", {"memfd": 8})], ENGINE_REGION_FIELDS)
