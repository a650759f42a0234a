"""Segment descriptors: a region's memory kind is parsed from its location, and a peer's
descriptor with a malformed location is refused when it is decoded, not when a transport asks."""

from __future__ import annotations

import pytest

from mooncake_connectors.errors import MetadataError
from mooncake_connectors.transfer_core.descriptor import (
    RegionDesc,
    SegmentDesc,
    decode_segment,
    encode_segment,
)
from mooncake_connectors.types import LocationKind


def _segment(*locations: str) -> SegmentDesc:
    regions = [
        RegionDesc(addr=4096 * (i + 1), length=4096, location=loc)
        for i, loc in enumerate(locations)
    ]
    return SegmentDesc(name="peer", host_id="h", pid=1, regions=regions)


def test_region_kind_reads_the_location() -> None:
    desc = decode_segment(encode_segment(_segment("cpu:0", "cuda:1", "file:/tmp/x")))
    assert [r.kind for r in desc.regions] == [
        LocationKind.CPU,
        LocationKind.CUDA,
        LocationKind.FILE,
    ]


@pytest.mark.parametrize("location", ["cpux:0", "cpu", "cuda:a", "gpu:0", ""])
def test_a_malformed_location_is_refused_at_decode(location: str) -> None:
    data = encode_segment(_segment("cpu:0", location))
    with pytest.raises(MetadataError) as info:
        decode_segment(data, source="peer-a")
    assert info.value.source == "peer-a"
