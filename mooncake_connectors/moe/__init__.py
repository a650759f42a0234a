"""EPLB-aware elastic MoE routing math: expert placement, replica planning, elastic re-planning
on rank loss, healthy-replica routing and rank health. Tensors are the unit (the ``torch``
extra); no engine is imported here. The conversions to and from vLLM's and SGLang's EPLB maps
live in :mod:`mooncake_connectors.adapters.moe`.

Typical use::

    placement = plan_placement(load, num_physical=288, num_ranks=32)
    router = ExpertRouter(placement)
    monitor = HealthMonitor(32, store=metadata, group="deepseek-v3")
    monitor.subscribe(router.set_health)
    ...
    phys = router.route(topk_ids, layer=i, gate_scores=logits).physical_ids
"""

from __future__ import annotations

from .elastic import ElasticPlan, placement_moves, plan_elastic
from .health import (
    HealthMonitor,
    HeartbeatPublisher,
    MetadataStore,
    heartbeat_key,
    heartbeat_prefix,
)
from .placement import EMPTY_SLOT, Placement
from .planner import pack_balanced, plan_placement, replicate_experts
from .router import ExpertRouter, RouteResult, RoutingMode

__all__ = [
    "EMPTY_SLOT",
    "ElasticPlan",
    "ExpertRouter",
    "HealthMonitor",
    "HeartbeatPublisher",
    "MetadataStore",
    "Placement",
    "RouteResult",
    "RoutingMode",
    "heartbeat_key",
    "heartbeat_prefix",
    "pack_balanced",
    "placement_moves",
    "plan_elastic",
    "plan_placement",
    "replicate_experts",
]
