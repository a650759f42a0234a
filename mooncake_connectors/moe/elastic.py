"""Elastic re-planning: a new placement over the live ranks that moves as few experts as possible.

When a rank dies, the router keeps serving from the surviving replicas at once (it reads the
health mask). Re-planning is the slower second step: experts that lost *every* replica must be
loaded somewhere again, and slots of joining ranks must be filled. Moving expert weights costs
time and bandwidth, so this planner starts from the previous placement and changes only:

1. slots on dead ranks become empty (nothing to transfer);
2. each expert with no surviving replica takes one slot — an empty live slot, or a slot of an
   expert that still has two or more replicas — chosen to keep the heaviest rank lightest.
   That is one move per lost expert, the minimum any plan needs;
3. empty live slots (a joining rank) get replicas of the experts with the heaviest load per
   replica, on the lightest ranks;
4. optionally up to ``max_extra_moves`` further moves per layer (adding a replica elsewhere,
   or exchanging two slots, which counts as two), each accepted only if it evens out the
   ranks, to claw back balance.

A move is a live slot whose logical expert changes (its new weights must be loaded).
"""

from __future__ import annotations

import dataclasses

import torch

from ..errors import ConfigError
from .placement import EMPTY_SLOT, Placement, as_alive, as_load

_REL_EPS = 1e-9


@dataclasses.dataclass(frozen=True, eq=False)
class ElasticPlan:
    """Result of :func:`plan_elastic`.

    placement: the new placement over ``len(alive)`` ranks; dead ranks' slots are empty.
    moves: ``[M, 4]`` int64 rows ``(layer, slot, old_logical, new_logical)``, one per live slot
        whose expert changes; ``old_logical`` is ``-1`` for a slot that was empty.
    lost: ``[L, N]`` bool, experts that had no replica left on a live rank.
    """

    placement: Placement
    moves: torch.Tensor
    lost: torch.Tensor

    @property
    def num_moves(self) -> int:
        return int(self.moves.shape[0])


def placement_moves(old: Placement, new: Placement) -> torch.Tensor:
    """``[M, 4]`` rows ``(layer, slot, old_logical, new_logical)`` for every non-empty slot of
    ``new`` that holds a different expert than in ``old`` (slots beyond ``old``'s count as
    empty there)."""
    if old.num_layers != new.num_layers or old.slots_per_rank != new.slots_per_rank:
        raise ConfigError("placements differ in layers or slots per rank")
    if new.num_physical < old.num_physical:
        raise ConfigError("the new placement has fewer slots than the old one")
    before = torch.full_like(new.physical_to_logical, EMPTY_SLOT)
    before[:, : old.num_physical] = old.physical_to_logical
    return _diff(before, new.physical_to_logical)


def _diff(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    changed = (after != before) & (after >= 0)
    layer, slot = changed.nonzero(as_tuple=True)
    return torch.stack([layer, slot, before[layer, slot], after[layer, slot]], dim=1)


def plan_elastic(
    previous: Placement,
    load: torch.Tensor,
    alive: torch.Tensor,
    *,
    max_extra_moves: int = 0,
) -> ElasticPlan:
    """Re-plan ``previous`` over the live ranks with the fewest expert moves.

    previous: the placement the engine runs now.
    load: ``[N]`` or ``[L, N]`` load per logical expert (the same statistics as for planning).
    alive: ``[R']`` bool (or 0/1) mask with ``R' >= previous.num_ranks``; ranks beyond the
        previous count are joining ranks with empty slots. Slots per rank stay the same.
    max_extra_moves: budget of balance-improving moves per layer beyond the required ones.
    Raises ConfigError when the live slots cannot hold every logical expert once.
    """
    budget = max_extra_moves
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise ConfigError(f"max_extra_moves must be a non-negative integer, got {budget!r}")
    if not isinstance(alive, torch.Tensor) or alive.dim() != 1:
        raise ConfigError("alive must be a 1-D tensor")
    num_ranks = int(alive.shape[0])
    if num_ranks < previous.num_ranks:
        raise ConfigError(
            f"alive covers {num_ranks} ranks, the placement has {previous.num_ranks}; "
            "dead ranks stay in the mask as 0"
        )
    live = as_alive(alive, num_ranks)
    w = as_load(load, previous.num_logical)
    if w.shape[0] == 1:
        w = w.expand(previous.num_layers, -1)
    if w.shape[0] != previous.num_layers:
        raise ConfigError(f"load has {w.shape[0]} layers, placement has {previous.num_layers}")
    slots = previous.slots_per_rank
    n = previous.num_logical
    if int(live.sum()) * slots < n:
        raise ConfigError(
            f"{int(live.sum())} live ranks x {slots} slots cannot hold {n} experts; "
            "keep serving on the old placement (the router falls back per token)"
        )
    old = torch.full((previous.num_layers, num_ranks * slots), EMPTY_SLOT, dtype=torch.int64)
    old[:, : previous.num_physical] = previous.physical_to_logical
    rows = []
    lost = torch.zeros(previous.num_layers, n, dtype=torch.bool)
    for layer in range(previous.num_layers):
        state = _LayerState(old[layer].tolist(), w[layer].tolist(), live.tolist(), slots, n)
        lost[layer] = torch.tensor([c == 0 for c in state.count], dtype=torch.bool)
        state.place_lost()
        state.fill_empty()
        state.improve(max_extra_moves)
        rows.append(state.p2l)
    placement = Placement(torch.tensor(rows, dtype=torch.int64), n, num_ranks)
    return ElasticPlan(placement, _diff(old, placement.physical_to_logical), lost)


class _LayerState:
    """One layer's slots during re-planning, with per-rank loads kept up to date."""

    def __init__(self, p2l: list[int], w: list[float], live: list[bool], slots: int, n: int):
        self.w = w
        self.slots = slots
        self.live = live
        self.num_ranks = len(live)
        for s in range(len(p2l)):
            if not live[s // slots]:
                p2l[s] = EMPTY_SLOT
        self.p2l = p2l
        self.count = [0] * n
        for e in p2l:
            if e >= 0:
                self.count[e] += 1
        self.eps = _REL_EPS * max(sum(w), 1e-300)
        self._reload()

    def _reload(self) -> None:
        self.rank_load = [0.0] * self.num_ranks
        # holders[e]: rank -> replicas of e on it (more than one only if the planner
        # co-located replicas, see spread_tolerance).
        self.holders: list[dict[int, int]] = [{} for _ in self.count]
        for s, e in enumerate(self.p2l):
            if e >= 0:
                r = s // self.slots
                self.rank_load[r] += self.w[e] / self.count[e]
                self.holders[e][r] = self.holders[e].get(r, 0) + 1

    def _set(self, s: int, e: int) -> None:
        old = self.p2l[s]
        if old >= 0:
            self.count[old] -= 1
        self.count[e] += 1
        self.p2l[s] = e
        self._reload()

    def _cost_of(self, s: int, x: int) -> tuple[float, float]:
        """(heaviest live rank, sum of squared live rank loads) after putting expert ``x``
        into slot ``s`` (evicting its expert). The second term breaks the many ties of the
        first: most moves do not touch the heaviest rank but still even out the rest."""
        r = s // self.slots
        y = self.p2l[s]
        loads = list(self.rank_load)
        cx = self.count[x]
        for h, c in self.holders[x].items():
            loads[h] += c * (self.w[x] / (cx + 1) - (self.w[x] / cx if cx else 0.0))
        loads[r] += self.w[x] / (cx + 1)
        if y >= 0:
            cy = self.count[y]
            loads[r] -= self.w[y] / cy
            for h, c in self.holders[y].items():
                others = c - 1 if h == r else c  # the evicted replica itself is gone
                loads[h] += others * (self.w[y] / (cy - 1) - self.w[y] / cy)
        live = [load for load, ok in zip(loads, self.live, strict=True) if ok]
        return max(live), sum(v * v for v in live)

    def _candidates(self, x: int) -> list[int]:
        """Slots that may take expert ``x``: live, on a rank without ``x``, and either empty
        or holding an expert with another replica."""
        out = []
        for s in range(len(self.p2l)):
            r = s // self.slots
            y = self.p2l[s]
            if not self.live[r] or r in self.holders[x] or y == x:
                continue
            if y == EMPTY_SLOT or self.count[y] >= 2:
                out.append(s)
        return out

    def _best_slot(self, x: int) -> int | None:
        best: tuple[tuple[float, float], int, int] | None = None
        for s in self._candidates(x):
            # Ties go to empty slots: they keep every existing replica.
            key = (self._cost_of(s, x), 0 if self.p2l[s] == EMPTY_SLOT else 1, s)
            if best is None or key < best:
                best = key
        return None if best is None else best[2]

    def place_lost(self) -> None:
        lost = [e for e, c in enumerate(self.count) if c == 0]
        for x in sorted(lost, key=lambda e: (-self.w[e], e)):
            s = self._best_slot(x)
            if s is None:  # cannot happen when live slots >= experts; kept as a guard
                raise ConfigError(f"no live slot can take expert {x}")
            self._set(s, x)

    def fill_empty(self) -> None:
        while True:
            empty = [
                s
                for s in range(len(self.p2l))
                if self.p2l[s] == EMPTY_SLOT and self.live[s // self.slots]
            ]
            if not empty:
                return
            # One empty slot per rank is enough to compare: slots of one rank are equivalent.
            firsts: dict[int, int] = {}
            for s in empty:
                firsts.setdefault(s // self.slots, s)
            best: tuple[tuple[float, float], int, int] | None = None
            for r, s in firsts.items():
                for x in range(len(self.count)):
                    if r in self.holders[x]:
                        continue
                    key = (self._cost_of(s, x), s, x)
                    if best is None or key < best:
                        best = key
            if best is None:
                # Every expert already sits on every rank with a free slot: duplicate the
                # heaviest per replica rather than leave capacity idle.
                x = max(range(len(self.count)), key=lambda e: (self.w[e] / self.count[e], -e))
                self._set(empty[0], x)
            else:
                self._set(best[1], best[2])

    def improve(self, budget: int) -> None:
        """Spend up to ``budget`` moves while each step improves (heaviest live rank, then sum
        of squared rank loads): add a replica of an expert of the heaviest rank elsewhere
        (1 move) or exchange a slot of the heaviest rank with a slot of another rank (2 moves).
        The second criterion matters when several ranks tie for the maximum: lowering them
        one at a time does not move the maximum until the last one drops."""
        while budget > 0:
            live = [v for v, ok in zip(self.rank_load, self.live, strict=True) if ok]
            current = (max(live), sum(v * v for v in live))
            heavy = max(
                (r for r in range(self.num_ranks) if self.live[r]),
                key=lambda r: (self.rank_load[r], -r),
            )
            heavy_slots = range(heavy * self.slots, (heavy + 1) * self.slots)
            on_heavy = {self.p2l[s] for s in heavy_slots}
            best: tuple[tuple[float, float], int, int, int] | None = None
            for x in sorted(e for e in on_heavy if e >= 0):
                for s in self._candidates(x):
                    key = (self._cost_of(s, x), 1, s, x)
                    if best is None or key < best:
                        best = key
            if budget >= 2:
                swap = self._best_swap(heavy, heavy_slots, on_heavy, current[1])
                if swap is not None and (best is None or swap < best):
                    best = swap
            if best is None or not self._better(best[0], current):
                return
            (_, cost, a, b) = best
            if cost == 1:
                self._set(a, b)
            else:
                self.p2l[a], self.p2l[b] = self.p2l[b], self.p2l[a]
                self._reload()
            budget -= cost

    def _better(self, key: tuple[float, float], current: tuple[float, float]) -> bool:
        if key[0] < current[0] - self.eps:
            return True
        return key[0] <= current[0] + self.eps and key[1] < current[1] * (1.0 - _REL_EPS)

    def _best_swap(
        self, heavy: int, heavy_slots: range, on_heavy: set[int], sumsq: float
    ) -> tuple[tuple[float, float], int, int, int] | None:
        """Best exchange of a heavy-rank slot with another rank's slot, as
        ``((new max, new sum of squares), 2, heavy slot, other slot)``. An exchange changes
        only the two ranks involved; replica counts stay the same."""
        top = sorted(((v, r) for r, v in enumerate(self.rank_load) if self.live[r]), reverse=True)[
            :3
        ]
        best: tuple[tuple[float, float], int, int, int] | None = None
        load_h = self.rank_load[heavy]
        for a in heavy_slots:
            ea = self.p2l[a]
            share_a = self.w[ea] / self.count[ea] if ea >= 0 else 0.0
            for b in range(len(self.p2l)):
                r = b // self.slots
                eb = self.p2l[b]
                if r == heavy or not self.live[r] or eb == ea:
                    continue
                if (ea >= 0 and r in self.holders[ea]) or (eb >= 0 and eb in on_heavy):
                    continue
                share_b = self.w[eb] / self.count[eb] if eb >= 0 else 0.0
                if share_b >= share_a:
                    continue
                new_h = load_h - share_a + share_b
                new_r = self.rank_load[r] - share_b + share_a
                rest = next((v for v, q in top if q not in (heavy, r)), 0.0)
                new_sumsq = sumsq - load_h**2 - self.rank_load[r] ** 2 + new_h**2 + new_r**2
                key = ((max(rest, new_h, new_r), new_sumsq), 2, a, b)
                if best is None or key < best:
                    best = key
        return best
