"""Our placement as SGLang 0.5.23's EPLB algorithm, through SGLang's own plugin hooks.

No engine runs: our ``sglang.srt.plugins`` entry point function registers its hook in SGLang's
``HookRegistry``, SGLang's ``apply_hooks`` patches ``eplb_algorithms.rebalance_experts``, and
that function is then called the way ``ExpertLocationMetadata.init_by_eplb`` calls it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tomllib

pytest.importorskip("sglang")

import torch
from sglang.srt.eplb import eplb_algorithms
from sglang.srt.eplb.eplb_algorithms import EplbAlgorithm
from sglang.srt.plugins.hook_registry import HookRegistry

from mooncake_connectors.adapters.eplb_switch import EPLB_POLICY_ENV
from mooncake_connectors.adapters.sglang import eplb, plugin
from mooncake_connectors.errors import ConfigError
from mooncake_connectors.moe.placement import Placement

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def hooks(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """SGLang's registry emptied before and after; its rebalance function restored after."""
    monkeypatch.setattr(eplb_algorithms, "rebalance_experts", eplb_algorithms.rebalance_experts)
    HookRegistry.reset()
    yield eplb_algorithms.rebalance_experts
    HookRegistry.reset()


def _load(seed: int, windows: int, layers: int, n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(windows, layers, n, generator=gen) ** 4 * 1000).round()


def test_the_entry_point_is_declared_for_sglang() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    group = meta["project"]["entry-points"]["sglang.srt.plugins"]
    assert group["mooncake_connectors"] == "mooncake_connectors.adapters.sglang.plugin:register"


def test_without_the_switch_sglang_keeps_its_algorithm(
    hooks: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(EPLB_POLICY_ENV, raising=False)
    plugin.register()
    HookRegistry.apply_hooks()
    assert eplb_algorithms.rebalance_experts is hooks
    with pytest.raises(ConfigError, match="must be 'default' or 'mooncake'"):
        eplb.register({EPLB_POLICY_ENV: "other"})


@pytest.mark.parametrize(
    ("algorithm", "nodes"),
    [
        (EplbAlgorithm.deepseek, 1),
        (EplbAlgorithm.deepseek_hierarchical, 2),
        (EplbAlgorithm.deepseek_vec, 1),
    ],
)
def test_with_the_switch_sglang_plans_with_ours(
    hooks: Any, monkeypatch: pytest.MonkeyPatch, algorithm: EplbAlgorithm, nodes: int
) -> None:
    n, physical, local, groups = 32, 48, 6, 4  # 8 ranks of 6 slots
    counts = _load(5, 3, 2, n)
    theirs = hooks(counts, physical, local, groups, nodes, algorithm)
    monkeypatch.setenv(EPLB_POLICY_ENV, "mooncake")
    plugin.register()
    plugin.register()  # SGLang loads plugins once per process; a second call adds nothing
    HookRegistry.apply_hooks()
    assert eplb_algorithms.rebalance_experts is not hooks
    p2l, l2p, count = eplb_algorithms.rebalance_experts(
        tokens_per_expert=counts,
        num_physical_experts=physical,
        num_local_physical_experts=local,
        num_groups=groups,
        num_nodes=nodes,
        algorithm=algorithm,
    )
    ranks = physical // local
    assert p2l.dtype == l2p.dtype == count.dtype == torch.int64
    # What SGLang's own answer satisfies, ours does too: shapes, dtypes, consistent tables.
    for out in (theirs, (p2l, l2p, count)):
        # (SGLang's deepseek answers int64, its deepseek_vec int32; ours is always int64.)
        assert tuple(out[0].shape) == (2, physical) and out[0].dtype in (torch.int32, torch.int64)
        assert tuple(out[1].shape[:2]) == (2, n) and tuple(out[2].shape) == (2, n)
        assert int(out[2].min()) >= 1 and bool((out[2].sum(1) == physical).all())
        assert torch.equal(torch.count_nonzero(out[1] != -1, dim=-1), out[2])
        for layer in range(2):
            for expert in range(n):
                slots = out[1][layer, expert, : int(out[2][layer, expert])]
                assert bool((out[0][layer, slots] == expert).all())
    load = counts.sum(0)
    ours_ratio = Placement(p2l, n, ranks).balance(load)
    theirs_ratio = Placement(theirs[0], n, ranks).balance(load)
    assert bool((ours_ratio <= theirs_ratio + 1e-9).all()), (ours_ratio, theirs_ratio)


def test_ours_keeps_the_served_map_where_it_can(
    hooks: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With SGLang's global ExpertLocationMetadata set (the map being served), the new plan is
    renamed onto it: same balance, fewer expert weights across ranks than a fresh plan."""
    from sglang.srt.eplb import expert_location

    from mooncake_connectors.adapters.moe import to_sglang
    from mooncake_connectors.moe.align import cross_rank_moves
    from mooncake_connectors.moe.planner import plan_placement

    n, physical, local, ranks = 32, 48, 6, 8
    served = plan_placement(_load(7, 1, 2, n).sum(0), physical, ranks)
    counts = 0.5 * _load(7, 1, 2, n) + 0.5 * _load(8, 1, 2, n)
    fresh = eplb.rebalance(counts, physical, local, 4, 1, False)[0]
    monkeypatch.setenv(EPLB_POLICY_ENV, "mooncake")
    plugin.register()
    HookRegistry.apply_hooks()
    expert_location.set_global_expert_location_metadata(
        expert_location.ExpertLocationMetadata(**to_sglang(served).metadata_kwargs()),
        allow_overwrite=True,
    )
    try:
        aligned = eplb_algorithms.rebalance_experts(
            counts, physical, local, 4, 1, EplbAlgorithm.deepseek
        )[0]
    finally:
        expert_location.set_global_expert_location_metadata(None, allow_overwrite=True)
    load = counts.sum(0)
    assert torch.allclose(
        Placement(aligned, n, ranks).balance(load), Placement(fresh, n, ranks).balance(load)
    )
    old = served.physical_to_logical
    assert cross_rank_moves(old, aligned, ranks) < cross_rank_moves(old, fresh, ranks)
