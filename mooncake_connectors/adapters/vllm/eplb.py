"""Our expert placement as vLLM's EPLB policy (``vllm/distributed/eplb/policy``).

vLLM asks a policy class for one thing: ``rebalance_experts(weight, num_replicas, num_groups,
num_nodes, num_ranks, old_global_expert_indices)`` returns the new ``[layers, num_replicas]``
int64 physical-to-logical map; vLLM derives the logical-to-physical table and the replica counts
from it (``eplb_state.compute_logical_maps``). Ours plans with :func:`plan_placement` (refined
packing, replicas on distinct ranks) and then :func:`align_to_previous`, so that experts which
stay on a rank are not copied.

How it is switched on: ``EPLBConfig.policy`` is a pydantic-validated ``Literal["default"]`` and
``EPLBConfig`` refuses any other policy with async EPLB (vLLM's default mode), so a new policy
name would need vLLM's config schema rebuilt *and* async EPLB turned off. Instead, with
``MOONCAKE_CONNECTORS_EPLB_POLICY=mooncake`` in the environment, the ``vllm.general_plugins``
entry point (which vLLM runs in every process before a model is loaded) points the table entry
``EPLB_POLICIES["default"]`` at our class; ``EplbState.add_model`` looks the policy up there, in
the synchronous and the async path alike. Unset (or ``default``) leaves vLLM untouched.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from vllm.distributed.eplb import policy as _policy_pkg
from vllm.distributed.eplb.policy.abstract import AbstractEplbPolicy
from vllm.distributed.eplb.policy.default import DefaultEplbPolicy

from ...errors import PluginError
from ...moe.align import align_to_previous
from ...moe.planner import plan_placement
from ..eplb_switch import EPLB_POLICY_ENV, wants_ours


class MooncakeEplbPolicy(AbstractEplbPolicy):  # type: ignore[misc]
    """vLLM EPLB policy backed by :mod:`mooncake_connectors.moe`."""

    @classmethod
    def rebalance_experts(
        cls,
        weight: torch.Tensor,
        num_replicas: int,
        num_groups: int,
        num_nodes: int,
        num_ranks: int,
        old_global_expert_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return rebalance(
            weight, num_replicas, num_groups, num_nodes, num_ranks, old_global_expert_indices
        )


def rebalance(
    weight: torch.Tensor,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_ranks: int,
    old: torch.Tensor | None = None,
) -> torch.Tensor:
    """The policy's body: ``[L, N]`` loads to a ``[L, num_replicas]`` int64 CPU map.

    Like vLLM's default, the plan is hierarchical (expert groups kept on nodes) when the groups
    divide over the nodes, global otherwise; ``old`` is the map running now.

    Elastic EP scale-down (``ElasticEPScalingExecutor.perform_scale_down_eplb_reshuffle``) calls
    with fewer ranks and replicas than ``old`` holds and keeps ranks ``0 .. num_ranks - 1`` at
    their index (its ``rank_mapping`` sends the rest to -1), with the same slots per rank; the
    plan is then aligned to those surviving ranks' part of ``old``.
    """
    hierarchical = num_nodes > 1 and num_groups % num_nodes == 0
    nodes = num_nodes if hierarchical else 1
    plan = plan_placement(
        weight.float(),
        num_replicas,
        num_ranks,
        num_nodes=nodes,
        num_groups=num_groups if hierarchical else 1,
    )
    if old is not None:
        if (
            old.dim() == 2
            and old.shape[1] > num_replicas
            and old.shape[1] % (num_replicas // num_ranks) == 0
        ):
            old = old[:, :num_replicas]  # the surviving ranks of a scale-down
        plan = align_to_previous(plan, old, num_nodes=nodes)
    return plan.physical_to_logical.clone()


def install(environ: Mapping[str, str] | None = None) -> bool:
    """Point vLLM's ``"default"`` EPLB policy at ours when the environment asks; True if so.

    Idempotent. Refuses (PluginError) when another package already replaced the entry, rather
    than silently overriding it.
    """
    if not wants_ours(EPLB_POLICY_ENV, environ):
        return False
    table: dict[str, Any] = _policy_pkg.EPLB_POLICIES
    held = table.get("default")
    if held not in (DefaultEplbPolicy, MooncakeEplbPolicy):
        raise PluginError(f"vLLM's EPLB policy 'default' is already replaced by {held!r}")
    table["default"] = MooncakeEplbPolicy
    return True


def vllm_default_rebalance(
    weight: torch.Tensor,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_ranks: int,
    old: torch.Tensor | None = None,
) -> torch.Tensor:
    """vLLM's own default policy, whatever the table holds (the benchmark's baseline)."""
    out: torch.Tensor = DefaultEplbPolicy.rebalance_experts(
        weight, num_replicas, num_groups, num_nodes, num_ranks, old
    )
    return out
