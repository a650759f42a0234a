"""Our placement as vLLM's EPLB policy, driven through vLLM 0.32's own EPLB classes.

No engine runs: vLLM's policy table, config validation and map derivation
(``eplb_state.compute_logical_maps``) are called directly, the way ``EplbState.rearrange`` calls
them, and vLLM's default policy is the reference for the invariants.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("vllm")

import torch
from vllm.config.parallel import EPLBConfig
from vllm.distributed.eplb import policy as vllm_policy
from vllm.distributed.eplb.eplb_state import EplbState, compute_logical_maps
from vllm.distributed.eplb.policy.default import DefaultEplbPolicy

from mooncake_connectors.adapters.vllm import eplb, plugin
from mooncake_connectors.bench.moe_vllm import vllm_policy_rows
from mooncake_connectors.errors import ConfigError, PluginError
from mooncake_connectors.moe.align import cross_rank_moves
from mooncake_connectors.moe.placement import Placement


@pytest.fixture
def table() -> Iterator[dict[str, type]]:
    """vLLM's policy table, restored afterwards (the plugin edits it in place)."""
    held = dict(vllm_policy.EPLB_POLICIES)
    yield vllm_policy.EPLB_POLICIES
    vllm_policy.EPLB_POLICIES.clear()
    vllm_policy.EPLB_POLICIES.update(held)


def test_the_plugin_entry_point_installs_the_policy_only_when_asked(
    table: dict[str, type], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(plugin.EPLB_POLICY_ENV, raising=False)
    plugin.register()
    assert table["default"] is DefaultEplbPolicy
    monkeypatch.setenv(plugin.EPLB_POLICY_ENV, "mooncake")
    plugin.register()
    plugin.register()  # vLLM loads plugins in several places of one process
    assert table["default"] is eplb.MooncakeEplbPolicy
    # vLLM's own config validation still accepts the deployment (async EPLB included), and the
    # lookup EplbState.add_model does resolves to our class.
    config = EPLBConfig(policy="default", use_async=True)
    assert vllm_policy.EPLB_POLICIES[config.policy] is eplb.MooncakeEplbPolicy


def test_bad_settings_and_a_foreign_replacement_are_refused(table: dict[str, type]) -> None:
    with pytest.raises(ConfigError, match="must be 'default' or 'mooncake'"):
        eplb.install({plugin.EPLB_POLICY_ENV: "fancy"})

    class Other(DefaultEplbPolicy):
        pass

    table["default"] = Other
    with pytest.raises(PluginError, match="already replaced"):
        eplb.install({plugin.EPLB_POLICY_ENV: "mooncake"})
    assert table["default"] is Other
    assert eplb.install({}) is False


def _check_vllm_invariants(p2l: torch.Tensor, layers: int, n: int, num_phys: int) -> None:
    """What EplbState needs from a policy's answer (checked on vLLM's default as well)."""
    assert p2l.dtype == torch.int64 and p2l.device.type == "cpu"
    assert tuple(p2l.shape) == (layers, num_phys)
    assert int(p2l.min()) >= 0 and int(p2l.max()) < n
    l2p, count = compute_logical_maps(p2l, n)
    assert tuple(count.shape) == (layers, n) and int(count.min()) >= 1
    assert bool((count.sum(1) == num_phys).all())
    assert l2p.shape[:2] == (layers, n)
    for layer in range(layers):
        for expert in range(n):
            slots = l2p[layer, expert, : int(count[layer, expert])]
            assert bool((p2l[layer, slots] == expert).all())
            assert bool((l2p[layer, expert, int(count[layer, expert]) :] == -1).all())


CASES = [  # (layers, experts, physical, groups, nodes, ranks): global, hierarchical, no spare
    (3, 16, 20, 4, 1, 4),
    (2, 32, 48, 4, 2, 8),
    (2, 16, 16, 2, 2, 4),
]


@pytest.mark.parametrize(("layers", "n", "phys", "groups", "nodes", "ranks"), CASES)
def test_our_maps_satisfy_what_vllm_derives_from_a_policy(
    layers: int, n: int, phys: int, groups: int, nodes: int, ranks: int
) -> None:
    gen = torch.Generator().manual_seed(layers * n)
    weight = (torch.rand(layers, n, generator=gen) ** 4 * 1000).round().to(torch.int64)
    initial = torch.tensor(
        EplbState.build_initial_global_physical_to_logical_map(n, phys - n), dtype=torch.int64
    ).expand(layers, -1)
    for policy in (DefaultEplbPolicy, eplb.MooncakeEplbPolicy):
        first = policy.rebalance_experts(weight, phys, groups, nodes, ranks)
        _check_vllm_invariants(first, layers, n, phys)
        again = policy.rebalance_experts(weight, phys, groups, nodes, ranks, initial)
        _check_vllm_invariants(again, layers, n, phys)
    ours = eplb.MooncakeEplbPolicy.rebalance_experts(weight, phys, groups, nodes, ranks)
    # Re-planning the same load from our own map moves nothing.
    same = eplb.MooncakeEplbPolicy.rebalance_experts(weight, phys, groups, nodes, ranks, ours)
    assert torch.equal(same, ours)
    # Hierarchical: every expert group stays on one node, replicas included.
    if nodes > 1 and groups % nodes == 0:
        per_node = phys // nodes
        group_of = ours // (n // groups)
        for node in range(nodes):
            block = group_of[:, node * per_node : (node + 1) * per_node]
            for layer in range(layers):
                assert len(set(block[layer].tolist())) == groups // nodes


def test_against_vllm_default_on_a_drifting_skewed_load() -> None:
    """The benchmark's row: ours balances at least as well and moves fewer weights."""
    rows = vllm_policy_rows(seed=0)
    assert rows["available"] is True
    for case in rows["cases"]:
        ours, default = case["ours"], case["vllm_default"]
        assert ours["max_over_mean_mean"] <= default["max_over_mean_mean"]
        assert ours["max_over_mean_worst"] <= default["max_over_mean_worst"]
        assert ours["cross_rank_moves"] < default["cross_rank_moves"]


def test_moves_count_agrees_with_placement_balance() -> None:
    weight = torch.tensor([[100.0, 1, 1, 1, 50, 1, 1, 1]])
    old = torch.arange(8).unsqueeze(0)
    new = eplb.MooncakeEplbPolicy.rebalance_experts(weight, 8, 1, 1, 4, old)
    assert float(Placement(new, 8, 4).balance(weight)[0]) <= float(
        Placement(old, 8, 4).balance(weight)[0]
    )
    assert cross_rank_moves(old, new, 4) <= int((new != old).sum())
