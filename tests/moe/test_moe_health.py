"""Health: heartbeats through the metadata protocol, engine verdicts, listeners."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from mooncake_connectors.errors import ConfigError
from mooncake_connectors.moe import (
    ExpertRouter,
    HealthMonitor,
    HeartbeatPublisher,
    MetadataStore,
    Placement,
    heartbeat_key,
)

# ``store`` (a dict-backed MetadataStore) and ``clock`` (advanced by hand) come from conftest.


def setup(
    store: Any, clock: Any, num_ranks: int = 4
) -> tuple[HealthMonitor, list[HeartbeatPublisher]]:
    monitor = HealthMonitor(num_ranks, store=store, group="g1", timeout=5.0, clock=clock)
    publishers = [HeartbeatPublisher(store, "g1", r, clock=clock) for r in range(num_ranks)]
    return monitor, publishers


def test_the_dict_store_satisfies_the_protocol(store: Any) -> None:
    assert isinstance(store, MetadataStore)


def test_heartbeat_key_and_value_format(store: Any, clock: Any) -> None:
    _, publishers = setup(store, clock)
    publishers[2].beat()
    assert heartbeat_key("g1", 2) == "mooncake/moe/g1/heartbeat/2" == publishers[2].key
    value = json.loads(store.data["mooncake/moe/g1/heartbeat/2"])
    assert value == {"rank": 2, "ts": clock.now, "seq": 1}


def test_ranks_are_alive_while_heartbeats_are_fresh(store: Any, clock: Any) -> None:
    monitor, publishers = setup(store, clock)
    assert monitor.poll().tolist() == [False] * 4, "no heartbeat yet: nobody is alive"
    for p in publishers:
        p.beat()
    assert monitor.poll().tolist() == [True] * 4
    clock.advance(3.0)
    for p in publishers[:3]:
        p.beat()
    clock.advance(2.5)  # rank 3's heartbeat is now 5.5 s old, the others 2.5 s
    assert monitor.poll().tolist() == [True, True, True, False]
    publishers[3].beat()
    assert monitor.poll().tolist() == [True] * 4


def test_leaving_rank_disappears_at_once(store: Any, clock: Any) -> None:
    monitor, publishers = setup(store, clock)
    for p in publishers:
        p.beat()
    assert publishers[1].leave() is True
    assert monitor.poll().tolist() == [True, False, True, True]
    assert publishers[1].leave() is False


def test_engine_verdicts_override_heartbeats_until_cleared(store: Any, clock: Any) -> None:
    monitor, publishers = setup(store, clock)
    for p in publishers:
        p.beat()
    monitor.mark_dead(2)  # e.g. a collective timed out on rank 2; its heartbeat still flows
    assert monitor.poll().tolist() == [True, True, False, True]
    monitor.clear_override(2)
    assert monitor.poll().tolist() == [True] * 4
    monitor.set_alive(torch.tensor([1, 1, 0, 0], dtype=torch.int32))
    assert monitor.alive.tolist() == [True, True, False, False]
    monitor.clear_override()
    assert monitor.poll().tolist() == [True] * 4


def test_without_a_store_the_engine_sets_the_mask() -> None:
    monitor = HealthMonitor(3)
    assert monitor.poll().tolist() == [True, True, True]
    monitor.mark_dead(1)
    assert monitor.alive.tolist() == [True, False, True]
    monitor.mark_alive(1)
    monitor.set_alive([True, True, False])
    assert monitor.alive.tolist() == [True, True, False]


def test_listeners_drive_the_router(store: Any, clock: Any) -> None:
    monitor, publishers = setup(store, clock, num_ranks=2)
    placement = Placement(torch.tensor([[0, 1, 1, 0]]), 2, 2)
    router = ExpertRouter(placement)
    calls: list[list[bool]] = []
    monitor.subscribe(router.set_health)
    unsubscribe = monitor.subscribe(lambda mask: calls.append(mask.tolist()))
    for p in publishers:
        p.beat()
    monitor.poll()
    monitor.poll()  # unchanged: no second notification
    clock.advance(10.0)
    publishers[0].beat()
    monitor.poll()
    assert calls == [[True, True], [True, False]]
    assert router.alive.tolist() == [True, False]
    phys = router.route(torch.tensor([[0], [1]])).physical_ids.reshape(-1).tolist()
    assert phys == [0, 1], "only rank 0's slots are used"
    unsubscribe()
    monitor.mark_dead(0)
    assert len(calls) == 2


def test_malformed_heartbeats_count_as_dead_and_do_not_break_the_others(
    store: Any, clock: Any
) -> None:
    monitor, publishers = setup(store, clock)
    for p in publishers:
        p.beat()
    store.data["mooncake/moe/g1/heartbeat/1"] = b"not json"
    store.data["mooncake/moe/g1/heartbeat/2"] = json.dumps({"rank": 3, "ts": 0}).encode()
    store.data["mooncake/moe/g1/heartbeat/9"] = json.dumps({"rank": 9, "ts": 1e12}).encode()
    store.data["mooncake/moe/g1/heartbeat/x"] = b"{}"
    assert monitor.poll().tolist() == [True, False, False, True]


def test_groups_do_not_see_each_other(store: Any, clock: Any) -> None:
    HeartbeatPublisher(store, "a", 0, clock=clock).beat()
    assert HealthMonitor(1, store=store, group="b", clock=clock).poll().tolist() == [False]
    assert HealthMonitor(1, store=store, group="a", clock=clock).poll().tolist() == [True]


@pytest.mark.parametrize(
    "kwargs",
    [{"timeout": 0}, {"timeout": float("inf")}, {"group": "a/b"}, {"group": ""}],
)
def test_bad_monitor_arguments_raise(store: Any, kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        HealthMonitor(2, store=store, **kwargs)


def test_bad_ranks_raise() -> None:
    monitor = HealthMonitor(2)
    with pytest.raises(ConfigError):
        monitor.mark_dead(2)
    with pytest.raises(ConfigError):
        monitor.set_alive([True])
    with pytest.raises(ConfigError):
        heartbeat_key("g", -1)
