"""MoE heartbeats through the project's real metadata backends (in-process, HTTP server, etcd)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from helpers import EtcdServer

from mooncake_connectors.moe import (
    ExpertRouter,
    HealthMonitor,
    HeartbeatPublisher,
    MetadataStore,
    plan_placement,
)
from mooncake_connectors.transfer_core.metadata import MetadataBackend, open_metadata
from mooncake_connectors.transfer_core.metadata.http import MetadataHTTPServer


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["memory", "http", "etcd"])
def stores(request: pytest.FixtureRequest) -> Iterator[tuple[MetadataBackend, MetadataBackend]]:
    """Two handles: one for the publishing ranks, one for the monitor (as in two processes)."""
    srv = None
    if request.param == "memory":
        url = "memory://moe-health"
    elif request.param == "http":
        srv = MetadataHTTPServer("127.0.0.1", 0).start()
        url = srv.url
    else:
        etcd: EtcdServer = request.getfixturevalue("etcd")
        url = etcd.url + "/moe-health"
    a, b = open_metadata(url), open_metadata(url)
    yield a, b
    for k in a.list(""):
        a.delete(k)
    a.close()
    b.close()
    if srv is not None:
        srv.stop()


def test_dead_rank_is_routed_around(stores: tuple[MetadataBackend, MetadataBackend]) -> None:
    pub_store, mon_store = stores
    assert isinstance(pub_store, MetadataStore)  # our backends satisfy the router's protocol
    clock = Clock()
    ranks = 8
    placement = plan_placement(torch.arange(1, 33, dtype=torch.float32), 48, ranks)
    router = ExpertRouter(placement)
    monitor = HealthMonitor(ranks, store=mon_store, group="m", timeout=5.0, clock=clock)
    monitor.subscribe(router.set_health)
    pubs = [HeartbeatPublisher(pub_store, "m", r, clock=clock) for r in range(ranks)]
    for p in pubs:
        p.beat()
    assert monitor.poll().all()
    clock.now += 4.0
    for p in pubs[:5] + pubs[6:]:  # rank 5 stops beating
        p.beat()
    clock.now += 2.0
    alive = monitor.poll()
    assert alive.tolist() == [r != 5 for r in range(ranks)]
    topk = torch.randint(0, 32, (512, 4))
    physical = router.route(topk, layer=0).physical_ids
    slots_per_rank = 48 // ranks
    used_ranks = set((physical[physical >= 0] // slots_per_rank).tolist())
    assert 5 not in used_ranks
    pubs[7].leave()  # a clean shutdown is seen at once
    assert not monitor.poll()[7]
