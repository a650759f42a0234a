"""EPLB-aware elastic MoE routing: expert placement, healthy-replica routing, rank health, and
conversions to and from vLLM's and SGLang's EPLB maps. Needs torch (the ``torch`` extra).

Typical use::

    placement = plan_placement(load, num_physical=288, num_ranks=32)
    router = ExpertRouter(placement)
    monitor = HealthMonitor(32, store=metadata, group="deepseek-v3")
    monitor.subscribe(router.set_health)
    ...
    phys = router.route(topk_ids, layer=i, gate_scores=logits).physical_ids

See docs/moe.md.
"""

from __future__ import annotations

from .elastic import ElasticPlan, placement_moves, plan_elastic
from .engine_maps import (
    SGLangExpertMaps,
    VllmExpertMaps,
    alive_from_active_ranks,
    apply_to_vllm_state,
    from_sglang,
    from_vllm,
    placement_from_sglang_metadata,
    placement_from_vllm_state,
    to_sglang,
    to_vllm,
)
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
    "SGLangExpertMaps",
    "VllmExpertMaps",
    "alive_from_active_ranks",
    "apply_to_vllm_state",
    "from_sglang",
    "from_vllm",
    "heartbeat_key",
    "heartbeat_prefix",
    "pack_balanced",
    "placement_from_sglang_metadata",
    "placement_from_vllm_state",
    "placement_moves",
    "plan_elastic",
    "plan_placement",
    "replicate_experts",
    "to_sglang",
    "to_vllm",
]
