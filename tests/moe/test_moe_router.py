"""Router: healthy replicas only, exact outputs under failure, fallback, spreading, modes."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mooncake_connectors.bench.moe_workload import expert_load, zipf_gate_scores
from mooncake_connectors.errors import ConfigError
from mooncake_connectors.moe import (
    ExpertRouter,
    Placement,
    RoutingMode,
    plan_placement,
)


class TinyMoE:
    """A top-k MoE layer on CPU whose experts are two-layer MLPs.

    Physical experts are bit-exact copies of their logical expert; copies on dead ranks are
    poisoned with NaN, so any token routed to a dead rank turns the output into NaN.
    """

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.top_k = top_k
        self.gate = torch.randn(dim, num_experts, generator=gen)
        self.w1 = torch.randn(num_experts, dim, hidden, generator=gen) / math.sqrt(dim)
        self.w2 = torch.randn(num_experts, hidden, dim, generator=gen) / math.sqrt(hidden)

    def physical(self, placement: Placement, alive: torch.Tensor) -> tuple[torch.Tensor, ...]:
        p2l = placement.physical_to_logical[0]
        w1 = self.w1[p2l.clamp(min=0)].clone()
        w2 = self.w2[p2l.clamp(min=0)].clone()
        dead = (p2l < 0) | ~alive[placement.rank_of_physical()]
        w1[dead] = float("nan")
        w2[dead] = float("nan")
        return w1, w2

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.gate

    def experts(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        weights: torch.Tensor,
    ) -> torch.Tensor:
        h = torch.relu(torch.einsum("td,tkdh->tkh", x, w1[ids]))
        y = torch.einsum("tkh,tkhd->tkd", h, w2[ids])
        return (weights.unsqueeze(-1) * y).sum(1)

    def forward_logical(self, x: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
        scores = self.scores(x)
        top = scores.topk(self.top_k, dim=1)
        weights = torch.softmax(top.values, dim=1)
        chosen = top.indices if ids is None else ids
        return self.experts(x, chosen, self.w1, self.w2, weights)

    def forward_routed(
        self, x: torch.Tensor, router: ExpertRouter, weights_phys: tuple[torch.Tensor, ...]
    ) -> torch.Tensor:
        scores = self.scores(x)
        top = scores.topk(self.top_k, dim=1)
        weights = torch.softmax(top.values, dim=1)
        result = router.route(top.indices, gate_scores=scores)
        return self.experts(x, result.physical_ids, *weights_phys, weights)


DIM, HIDDEN, N, K, RANKS, PHYSICAL = 16, 32, 16, 2, 4, 24


def layer_and_placement() -> tuple[TinyMoE, Placement, torch.Tensor]:
    moe = TinyMoE(DIM, HIDDEN, N, K, seed=0)
    x = torch.randn(256, DIM, generator=torch.Generator().manual_seed(1))
    load = torch.bincount(moe.scores(x).topk(K, dim=1).indices.reshape(-1), minlength=N)
    return moe, plan_placement(load.double(), PHYSICAL, RANKS), x


@pytest.mark.parametrize("mode", list(RoutingMode))
def test_outputs_unchanged_when_every_expert_keeps_a_healthy_replica(mode: RoutingMode) -> None:
    moe, placement, x = layer_and_placement()
    expected = moe.forward_logical(x)
    all_alive = torch.ones(RANKS, dtype=torch.bool)
    healthy = moe.forward_routed(
        x, ExpertRouter(placement, mode=mode), moe.physical(placement, all_alive)
    )
    assert torch.equal(healthy, expected)
    checked = 0
    for dead in range(RANKS):
        alive = all_alive.clone()
        alive[dead] = False
        router = ExpertRouter(placement, mode=mode, alive=alive)
        if router.lost_experts().numel():
            continue  # covered by the fallback test
        out = moe.forward_routed(x, router, moe.physical(placement, alive))
        assert torch.equal(out, expected), f"rank {dead} dead changed the output"
        assert router.fallback_count == 0
        checked += 1
    assert checked >= 1, "the placement must survive at least one single-rank loss"


def substitute_reference(scores: torch.Tensor, ids: torch.Tensor, lost: set[int]) -> torch.Tensor:
    """Replace each lost expert of a token by its best-scoring expert that is neither lost nor
    already chosen — a plain loop, independent of the router's tensor code."""
    out = ids.clone()
    for t in range(ids.shape[0]):
        taken = set(ids[t].tolist())
        order = scores[t].argsort(descending=True).tolist()
        for k in range(ids.shape[1]):
            if int(ids[t, k]) in lost:
                sub = next(e for e in order if e not in lost and e not in taken)
                out[t, k] = sub
                taken.add(sub)
    return out


def test_fully_lost_expert_falls_back_to_next_best_and_is_counted() -> None:
    moe = TinyMoE(DIM, HIDDEN, N, K, seed=0)
    x = torch.randn(256, DIM, generator=torch.Generator().manual_seed(1))
    # Hand-made placement: experts 0 and 1 live only on rank 0; everything else twice.
    p2l = torch.tensor(
        [
            0,
            1,
            2,
            3,
            4,
            5,
            2,
            3,
            4,
            5,
            6,
            7,
            6,
            7,
            8,
            9,
            10,
            11,
            12,
            13,
            14,
            15,
            8,
            9,
            10,
            11,
            12,
            13,
            14,
            15,
        ]
    ).unsqueeze(0)
    placement = Placement(p2l, N, 5)
    alive = torch.tensor([False, True, True, True, True])
    router = ExpertRouter(placement, alive=alive)
    assert router.lost_experts().tolist() == [0, 1]
    out = moe.forward_routed(x, router, moe.physical(placement, alive))
    assert bool(torch.isfinite(out).all())
    scores = moe.scores(x)
    top_ids = scores.topk(K, dim=1).indices
    hits = int(((top_ids == 0) | (top_ids == 1)).sum())
    assert hits > 0
    assert router.fallback_count == hits
    assert router.dropped_count == 0
    expected = moe.forward_logical(x, substitute_reference(scores, top_ids, {0, 1}))
    assert torch.equal(out, expected)


def test_without_gate_scores_lost_entries_are_dropped_and_counted() -> None:
    placement = Placement(torch.tensor([[0, 1, 2, 3, 2, 3]]), 4, 3)
    router = ExpertRouter(placement, alive=torch.tensor([False, True, True]))
    ids = torch.tensor([[0, 2], [3, 1], [2, 3]])
    result = router.route(ids)
    assert result.num_dropped == 2 and router.dropped_count == 2
    assert result.physical_ids[0, 0] == -1 and result.physical_ids[1, 1] == -1
    assert result.logical_ids.tolist() == [[-1, 2], [3, -1], [2, 3]]
    assert bool((result.physical_ids[result.physical_ids >= 0] >= 2).all())


def test_no_substitute_left_means_dropped() -> None:
    placement = Placement(torch.tensor([[0, 1, 2, 2]]), 3, 2)
    router = ExpertRouter(placement, alive=torch.tensor([False, True]))
    ids = torch.tensor([[0, 2]])
    result = router.route(ids, gate_scores=torch.tensor([[3.0, 2.0, 1.0]]))
    # Expert 0 is lost, expert 1 too, expert 2 is already taken by this token.
    assert (result.num_fallback, result.num_dropped) == (0, 1)
    assert result.logical_ids.tolist() == [[-1, 2]]


def test_deterministic_mode_spreads_a_hot_expert_evenly() -> None:
    placement = Placement(torch.tensor([[0, 1, 0, 2, 0, 3, 1, 2]]), 4, 4)
    router = ExpertRouter(placement)
    ids = torch.zeros(3000, 1, dtype=torch.int64)  # every token wants expert 0
    phys = router.route(ids).physical_ids.reshape(-1)
    counts = torch.bincount(phys, minlength=8)
    assert counts[[0, 2, 4]].tolist() == pytest.approx([1000, 1000, 1000], abs=8)
    assert int(counts.sum()) == 3000
    again = ExpertRouter(placement).route(ids).physical_ids
    assert torch.equal(again.reshape(-1), phys), "same answer from another router instance"


def test_random_mode_is_seeded_and_balanced_in_expectation() -> None:
    placement = Placement(torch.tensor([[0, 1, 0, 2, 0, 3, 1, 2]]), 4, 4)
    ids = torch.zeros(30000, 1, dtype=torch.int64)
    a = ExpertRouter(placement, mode=RoutingMode.RANDOM, seed=7).route(ids).physical_ids
    b = ExpertRouter(placement, mode=RoutingMode.RANDOM, seed=7).route(ids).physical_ids
    assert torch.equal(a, b)
    counts = torch.bincount(a.reshape(-1), minlength=8)[[0, 2, 4]].double()
    assert bool(((counts - 10000).abs() < 400).all()), counts  # ~4.5 sigma


def test_queued_rank_load_shifts_tokens_away() -> None:
    placement = Placement(torch.tensor([[0, 1, 0, 2, 0, 3, 1, 2]]), 4, 4)
    router = ExpertRouter(placement)
    router.set_expert_load(torch.tensor([300.0, 10.0, 10.0, 10.0]))
    router.set_rank_load(torch.tensor([0.0, 200.0, 0.0, 0.0]))
    phys = router.route(torch.zeros(3000, 1, dtype=torch.int64)).physical_ids.reshape(-1)
    counts = torch.bincount(phys, minlength=8)
    assert counts[2] < 0.6 * counts[0] and counts[2] < 0.6 * counts[4], counts


def test_realized_tokens_per_rank_match_the_plan() -> None:
    gen = torch.Generator().manual_seed(3)
    scores = zipf_gate_scores(4096, 256, 1.0, gen)
    ids = scores.topk(8, dim=1).indices
    load = expert_load(scores, 8)
    placement = plan_placement(load, 288, 32)
    phys = ExpertRouter(placement).route(ids).physical_ids
    per_rank = torch.bincount(phys.reshape(-1) // 9, minlength=32).double()
    planned = placement.balance(load).item()
    assert float(per_rank.max() / per_rank.mean()) <= planned + 0.02


def test_load_is_recorded_per_physical_expert() -> None:
    placement = Placement(torch.tensor([[0, 1, 0, 2, 0, 3, 1, 2]]), 4, 4)
    router = ExpertRouter(placement, record_load=True)
    router.route(torch.tensor([[0, 1], [0, 3], [0, 2]]))
    load = router.take_physical_load()
    assert int(load.sum()) == 6 and int(load[0, 5]) == 1
    assert int(router.take_physical_load().sum()) == 0


def test_set_placement_and_health_take_effect() -> None:
    first = Placement(torch.tensor([[0, 1, 0, 1]]), 2, 2)
    router = ExpertRouter(first)
    router.set_health(torch.tensor([1, 0], dtype=torch.int32))
    assert router.route(torch.tensor([[0], [1]])).physical_ids.reshape(-1).tolist() == [0, 1]
    router.set_placement(Placement(torch.tensor([[1, 0, 1, 0]]), 2, 2))
    assert router.route(torch.tensor([[0], [1]])).physical_ids.reshape(-1).tolist() == [1, 0]
    assert router.alive.tolist() == [True, False]


@pytest.mark.parametrize(
    ("ids", "kwargs", "message"),
    [
        (torch.tensor([[0, 4]]), {}, r"\[0, 4\)"),
        (torch.tensor([[-1, 0]]), {}, r"\[0, 4\)"),
        (torch.tensor([0, 1]), {}, r"\[T, K\]"),
        (torch.tensor([[0.0, 1.0]]), {}, "integer"),
        (torch.tensor([[0, 1]]), {"layer": 1}, "layer 1"),
    ],
)
def test_bad_route_inputs_raise(ids: torch.Tensor, kwargs: dict[str, int], message: str) -> None:
    router = ExpertRouter(Placement(torch.tensor([[0, 1, 2, 3]]), 4, 2))
    with pytest.raises(ConfigError, match=message):
        router.route(ids, **kwargs)


def test_bad_router_arguments_raise() -> None:
    placement = Placement(torch.tensor([[0, 1, 2, 3]]), 4, 2)
    with pytest.raises(ConfigError, match="power of two"):
        ExpertRouter(placement, table_size=48)
    with pytest.raises(ConfigError, match="shape"):
        ExpertRouter(placement, alive=torch.ones(3, dtype=torch.bool))
    router = ExpertRouter(placement, alive=torch.tensor([False, True]))
    with pytest.raises(ConfigError, match="gate_scores"):
        router.route(torch.tensor([[0]]), gate_scores=torch.ones(1, 3))


@st.composite
def routing_cases(draw: st.DrawFn) -> tuple[Placement, torch.Tensor, torch.Tensor, torch.Tensor]:
    num_ranks = draw(st.integers(1, 6))
    slots = draw(st.integers(1, 4))
    n = draw(st.integers(1, num_ranks * slots))
    # Every expert once, then random extra replicas, shuffled over the slots.
    extra = draw(
        st.lists(
            st.integers(0, n - 1), min_size=num_ranks * slots - n, max_size=num_ranks * slots - n
        )
    )
    order = draw(st.permutations(list(range(n)) + extra))
    placement = Placement(torch.tensor([order]), n, num_ranks)
    alive = torch.tensor(draw(st.lists(st.booleans(), min_size=num_ranks, max_size=num_ranks)))
    k = draw(st.integers(1, n))
    tokens = draw(st.integers(1, 40))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(tokens, n, generator=gen)
    return placement, alive, scores.topk(k, dim=1).indices, scores


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(routing_cases(), st.sampled_from(list(RoutingMode)))
def test_property_never_routes_to_a_dead_rank(
    case: tuple[Placement, torch.Tensor, torch.Tensor, torch.Tensor], mode: RoutingMode
) -> None:
    placement, alive, ids, scores = case
    router = ExpertRouter(placement, mode=mode, alive=alive)
    result = router.route(ids, gate_scores=scores)
    phys, logical = result.physical_ids, result.logical_ids
    served = phys >= 0
    assert bool(alive[phys[served] // placement.slots_per_rank].all()), "routed to a dead rank"
    assert torch.equal(placement.physical_to_logical[0][phys[served]], logical[served])
    lost = set(router.lost_experts().tolist())
    affected = sum(int(e) in lost for e in ids.reshape(-1).tolist())
    assert result.num_fallback + result.num_dropped == affected
    unaffected = torch.tensor([[int(e) not in lost for e in row] for row in ids.tolist()])
    assert torch.equal(logical[unaffected], ids[unaffected])
    for row in logical.tolist():  # a token never gets the same expert twice
        kept = [e for e in row if e >= 0]
        assert len(kept) == len(set(kept))
