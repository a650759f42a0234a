"""Token routing: logical top-k expert ids -> physical expert ids on healthy ranks only.

For each layer the router keeps a small table per logical expert, ``G`` entries long, in which
each healthy replica owns a run of entries proportional to its share of the expert's tokens.
Routing a (token, k) entry is one lookup into that table, at a column chosen

- ``DETERMINISTIC``: from the entry's ordinal among this batch's entries for the same expert,
  scrambled by Fibonacci hashing, so that any run of consecutive ordinals spreads over the
  replicas in proportion to their shares (as quantised to 1/G) up to a few tokens. Same inputs
  give the same answer on every rank, with no random state;
- ``RANDOM``: uniformly at random (seeded generator), cheaper, balanced in expectation.

Shares are equal across a logical expert's healthy replicas until the engine reports load:
with :meth:`ExpertRouter.set_expert_load` (expected tokens per logical expert) and optionally
:meth:`ExpertRouter.set_rank_load` (tokens already queued per rank), shares shift towards
replicas on lightly loaded ranks. Dead ranks never appear in a table.

When a logical expert has no healthy replica, the entry goes to the token's best remaining
expert by gate score (one not already among its top-k and with a healthy replica) and is
counted in ``fallback_count``; without gate scores the entry is dropped (physical id ``-1``) and
counted in ``dropped_count``. The engine's combine weights are left alone.
"""

from __future__ import annotations

import dataclasses
import enum

import torch

from ..errors import ConfigError
from .placement import Placement, as_alive, as_load, check_positive

# Odd multiplier close to 2**32 / golden ratio: consecutive ordinals land far apart in the
# table (Fibonacci hashing), so short runs already visit every replica's entries fairly.
_GOLDEN = 0x9E3779B1
_MASK32 = 0xFFFFFFFF
_SHARE_ITERATIONS = 8


class RoutingMode(enum.Enum):
    DETERMINISTIC = "deterministic"
    RANDOM = "random"


@dataclasses.dataclass(frozen=True, eq=False)
class RouteResult:
    """Outcome of one :meth:`ExpertRouter.route` call.

    physical_ids: ``[T, K]`` int64 physical expert ids; ``-1`` where the entry was dropped.
    logical_ids: ``[T, K]`` int64 logical ids actually served (fallback substitutes included;
        ``-1`` where dropped).
    num_fallback: entries sent to a substitute expert in this call.
    num_dropped: entries with no healthy expert to go to in this call.
    """

    physical_ids: torch.Tensor
    logical_ids: torch.Tensor
    num_fallback: int
    num_dropped: int


class ExpertRouter:
    """Maps top-k logical expert ids to physical ids over healthy replicas.

    placement: the placement the engine runs.
    mode: :class:`RoutingMode`.
    alive: optional ``[R]`` health mask (bool or 0/1); all ranks alive by default.
    seed: seed of the ``RANDOM`` mode's generator.
    table_size: ``G``, entries per logical expert (a power of two); share resolution is 1/G.
        Tables take ``L * N * G * 8`` bytes on ``device`` (61 x 256 x 256: 32 MiB).
    device: where tables live and inputs are expected (CPU by default).
    record_load: count tokens per physical expert (see :meth:`take_physical_load`).
    validate: check every input's shape, dtype and range (one host sync per call on GPU).

    Not thread-safe: one router per engine worker.
    """

    def __init__(
        self,
        placement: Placement,
        *,
        mode: RoutingMode = RoutingMode.DETERMINISTIC,
        alive: torch.Tensor | None = None,
        seed: int = 0,
        table_size: int = 256,
        device: torch.device | str | None = None,
        record_load: bool = False,
        validate: bool = True,
    ) -> None:
        if not isinstance(mode, RoutingMode):
            raise ConfigError(f"mode must be a RoutingMode, got {mode!r}")
        check_positive(table_size, "table_size")
        if table_size & (table_size - 1):
            raise ConfigError(f"table_size must be a power of two, got {table_size}")
        self.mode = mode
        self.table_size = table_size
        self.device = torch.device("cpu" if device is None else device)
        self.record_load = record_load
        self.validate = validate
        self._generator = torch.Generator(device=self.device)
        self._generator.manual_seed(seed)
        self.fallback_count = 0
        self.dropped_count = 0
        self._expert_load: torch.Tensor | None = None
        self._rank_load: torch.Tensor | None = None
        # Assigned by _set_placement / _rebuild; declared here for the type checker.
        self._placement: Placement
        self._alive: torch.Tensor
        self._physical_load: torch.Tensor
        self._offset: torch.Tensor
        self._table: torch.Tensor
        self._healthy: torch.Tensor
        self._healthy_count: torch.Tensor
        self._any_lost: list[bool]
        self._set_placement(placement, alive)

    # ------------------------------------------------------------- state

    @property
    def placement(self) -> Placement:
        return self._placement

    @property
    def alive(self) -> torch.Tensor:
        """``[R]`` bool health mask (a copy)."""
        return self._alive.clone()

    def set_health(self, alive: torch.Tensor) -> None:
        """Replace the health mask; takes effect on the next :meth:`route`."""
        self._alive = as_alive(alive, self._placement.num_ranks)
        self._rebuild()

    def set_placement(self, placement: Placement, alive: torch.Tensor | None = None) -> None:
        """Switch to a new placement (after the engine moved expert weights). The health mask
        is kept when the rank count is unchanged, unless ``alive`` is given."""
        if alive is None and placement.num_ranks == self._placement.num_ranks:
            alive = self._alive
        if self._expert_load is not None and (
            self._expert_load.shape[0] != placement.num_layers
            or self._expert_load.shape[1] != placement.num_logical
        ):
            self._expert_load = None
        if self._rank_load is not None and self._rank_load.shape[0] != placement.num_ranks:
            self._rank_load = None
        self._set_placement(placement, alive)

    def set_expert_load(self, load: torch.Tensor | None) -> None:
        """Expected tokens per logical expert, ``[N]`` or ``[L, N]``; ``None`` = equal shares."""
        if load is None:
            self._expert_load = None
        else:
            w = as_load(load, self._placement.num_logical)
            if w.shape[0] not in (1, self._placement.num_layers):
                raise ConfigError(
                    f"load has {w.shape[0]} layers, expected 1 or {self._placement.num_layers}"
                )
            self._expert_load = w.expand(self._placement.num_layers, -1).contiguous()
        self._rebuild()

    def set_rank_load(self, load: torch.Tensor | None) -> None:
        """Tokens already queued per rank, ``[R]``; ``None`` = none."""
        if load is None:
            self._rank_load = None
        else:
            if not isinstance(load, torch.Tensor) or load.dim() != 1:
                raise ConfigError("rank load must be a 1-D tensor")
            w = as_load(load.unsqueeze(0))
            if w.shape[1] != self._placement.num_ranks:
                raise ConfigError(f"rank load must have {self._placement.num_ranks} entries")
            self._rank_load = w[0]
        self._rebuild()

    def healthy_replicas(self, layer: int = 0) -> torch.Tensor:
        """``[N]`` int64: healthy replicas per logical expert in ``layer``."""
        return self._healthy_count[self._layer(layer)].clone()

    def lost_experts(self, layer: int = 0) -> torch.Tensor:
        """Logical ids with no healthy replica in ``layer`` (their tokens fall back)."""
        return (self._healthy_count[self._layer(layer)] == 0).nonzero().squeeze(1)

    def take_physical_load(self) -> torch.Tensor:
        """``[L, P]`` int64 tokens routed per physical expert since the last call; resets."""
        out = self._physical_load.cpu()
        self._physical_load = torch.zeros_like(self._physical_load)
        return out

    # ------------------------------------------------------------- routing

    def route(
        self,
        topk_ids: torch.Tensor,
        *,
        layer: int = 0,
        gate_scores: torch.Tensor | None = None,
        salt: int = 0,
    ) -> RouteResult:
        """Route one batch.

        topk_ids: ``[T, K]`` integer logical expert ids in ``[0, N)``.
        layer: MoE layer index into the placement.
        gate_scores: optional ``[T, N]`` router scores (logits or probabilities; larger is
            better), used only to pick substitutes for experts without a healthy replica.
        salt: mixed into the deterministic walk's starting column (pass the step number, equal
            on every rank, so that experts with one token per batch rotate over replicas).
        Returns a :class:`RouteResult`.
        """
        layer = self._layer(layer)
        ids = self._check_ids(topk_ids) if self.validate else topk_ids.long()
        healthy = self._healthy[layer]
        num_fallback = num_dropped = 0
        if self._any_lost[layer]:
            ok = healthy[ids]
            if not bool(ok.all()):
                ids, num_fallback, num_dropped = self._fallback(ids, ok, gate_scores, healthy)
        flat = ids.reshape(-1)
        lookup = flat.clamp(min=0) if num_dropped else flat
        g = self.table_size
        table = self._table[layer]
        if self.mode is RoutingMode.RANDOM:
            col = torch.randint(0, g, flat.shape, generator=self._generator, device=self.device)
            phys = table.index_select(0, lookup * g + col)
        else:
            phys = self._deterministic(lookup, table, self._offset[layer], salt)
        if num_dropped:
            phys = torch.where(flat >= 0, phys, -1)
        if self.record_load:
            self._physical_load[layer] += torch.bincount(
                phys + 1, minlength=self._placement.num_physical + 1
            )[1:]
        self.fallback_count += num_fallback
        self.dropped_count += num_dropped
        return RouteResult(phys.view(ids.shape), ids, num_fallback, num_dropped)

    def _deterministic(
        self, flat: torch.Tensor, table: torch.Tensor, offset: torch.Tensor, salt: int
    ) -> torch.Tensor:
        g = self.table_size
        n = self._placement.num_logical
        # Stable sort on the narrowest dtype that holds the ids: several times faster on CPU.
        key = flat.to(torch.int16 if n <= 2**15 else torch.int32)
        sorted_key, order = torch.sort(key, stable=True)
        sorted_ids = sorted_key.long()
        counts = torch.bincount(flat, minlength=n)
        starts = counts.cumsum(0) - counts
        position = torch.arange(flat.shape[0], device=flat.device)
        ordinal = position - starts.index_select(0, sorted_ids)
        # Fibonacci hashing: the top bits of (ordinal * golden + start) mod 2**32. Consecutive
        # ordinals fill the table like the fractional parts of j * golden ratio, which cover
        # every interval in proportion to its length (three-distance theorem).
        start = offset.index_select(0, sorted_ids) + (salt * _GOLDEN & _MASK32)
        col = ((ordinal * _GOLDEN + start) & _MASK32) >> (32 - (g.bit_length() - 1))
        phys = table.index_select(0, sorted_ids * g + col)
        return torch.empty_like(flat).scatter_(0, order, phys)

    def _fallback(
        self,
        ids: torch.Tensor,
        ok: torch.Tensor,
        gate_scores: torch.Tensor | None,
        healthy: torch.Tensor,
    ) -> tuple[torch.Tensor, int, int]:
        bad = ~ok
        if gate_scores is None:
            return torch.where(bad, -1, ids), 0, int(bad.sum())
        n = self._placement.num_logical
        if gate_scores.dim() != 2 or gate_scores.shape != (ids.shape[0], n):
            raise ConfigError(
                f"gate_scores must have shape [{ids.shape[0]}, {n}], got {list(gate_scores.shape)}"
            )
        if not gate_scores.is_floating_point():
            raise ConfigError(f"gate_scores must be floating point, got {gate_scores.dtype}")
        rows = bad.any(1).nonzero().squeeze(1)
        row_ids, row_bad = ids.index_select(0, rows), bad.index_select(0, rows)
        neg_inf = float("-inf")
        # Experts without a healthy replica, NaN scores and the token's own top-k are never
        # substitutes; adding -inf is the cheapest way to rule a column out.
        penalty = torch.zeros(n, dtype=torch.float32, device=ids.device).masked_fill(
            ~healthy, neg_inf
        )
        scores = torch.nan_to_num(gate_scores.index_select(0, rows).float(), nan=neg_inf)
        scores = (scores + penalty).scatter_(1, row_ids, neg_inf)
        need = int(row_bad.sum(1).max())
        values, candidates = scores.topk(min(need, n), dim=1)
        # The j-th bad entry of a row takes the row's j-th best substitute.
        j = (row_bad.long().cumsum(1) - 1).clamp(0, candidates.shape[1] - 1)
        substitute = candidates.gather(1, j)
        usable = row_bad & torch.isfinite(values.gather(1, j))
        new_rows = torch.where(usable, substitute, torch.where(row_bad, -1, row_ids))
        out = ids.clone().index_copy_(0, rows, new_rows)
        num_fallback = int(usable.sum())
        return out, num_fallback, int(row_bad.sum()) - num_fallback

    # ------------------------------------------------------------- internals

    def _layer(self, layer: int) -> int:
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise ConfigError(f"layer must be an integer, got {layer!r}")
        if not 0 <= layer < self._placement.num_layers:
            raise ConfigError(f"layer {layer} outside [0, {self._placement.num_layers})")
        return layer

    def _check_ids(self, topk_ids: torch.Tensor) -> torch.Tensor:
        if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2:
            raise ConfigError("topk_ids must be a [T, K] tensor")
        if topk_ids.is_floating_point() or topk_ids.is_complex() or topk_ids.dtype == torch.bool:
            raise ConfigError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
        if topk_ids.device != self.device:
            raise ConfigError(f"topk_ids on {topk_ids.device}, router tables on {self.device}")
        if topk_ids.numel():
            lo, hi = torch.aminmax(topk_ids)
            if int(lo) < 0 or int(hi) >= self._placement.num_logical:
                raise ConfigError(
                    f"topk_ids must lie in [0, {self._placement.num_logical}), "
                    f"got [{int(lo)}, {int(hi)}]"
                )
        return topk_ids.long()

    def _set_placement(self, placement: Placement, alive: torch.Tensor | None) -> None:
        if not isinstance(placement, Placement):
            raise ConfigError(f"placement must be a Placement, got {type(placement).__name__}")
        self._placement = placement
        r = placement.num_ranks
        self._alive = torch.ones(r, dtype=torch.bool) if alive is None else as_alive(alive, r)
        self._physical_load = torch.zeros(
            placement.num_layers, placement.num_physical, dtype=torch.int64, device=self.device
        )
        # A fixed per-(layer, expert) starting column, so that experts with few tokens do not
        # all start on their first replica.
        ids = torch.arange(placement.num_layers * placement.num_logical, dtype=torch.int64)
        self._offset = ((ids * _GOLDEN) & _MASK32).view(placement.num_layers, -1).to(self.device)
        self._rebuild()

    def _rebuild(self) -> None:
        p = self._placement
        g = self.table_size
        l2p = p.logical_to_physical()  # [L, N, X]
        rank = l2p.clamp(min=0) // p.slots_per_rank
        valid = (l2p >= 0) & self._alive[rank]
        count = valid.sum(-1)
        shares = _shares(valid, rank, self._expert_load, self._rank_load, self._alive)
        cum = shares.cumsum(-1)
        u = ((torch.arange(g, dtype=torch.float64) + 0.5) / g).expand(*cum.shape[:2], g)
        pick = torch.searchsorted(cum.contiguous(), u.contiguous(), right=True)
        table = l2p.gather(-1, pick.clamp(max=l2p.shape[-1] - 1))
        table = torch.where((count > 0).unsqueeze(-1), table, -1)
        self._table = table.reshape(p.num_layers, -1).to(self.device)
        self._healthy_count = count
        self._healthy = (count > 0).to(self.device)
        # Host-side flags: the per-call health check is skipped for layers that lost nothing.
        self._any_lost = (count == 0).any(1).tolist()


def _shares(
    valid: torch.Tensor,
    rank: torch.Tensor,
    expert_load: torch.Tensor | None,
    rank_load: torch.Tensor | None,
    alive: torch.Tensor,
) -> torch.Tensor:
    """``[L, N, X]`` float64 share of each healthy replica in its expert's tokens (rows of
    experts with a healthy replica sum to 1).

    Equal shares unless load is known. With load, a few damped multiplicative steps move
    share from replicas on ranks above the mean (expected expert tokens plus queued tokens)
    to replicas below it; it is a heuristic for the min-max split, cheap and stable."""
    mask = valid.to(torch.float64)
    count = mask.sum(-1, keepdim=True)
    shares = mask / count.clamp(min=1)
    if expert_load is None and rank_load is None:
        return shares
    num_layers, n, _ = valid.shape
    num_ranks = alive.shape[0]
    volume = torch.ones(num_layers, n, dtype=torch.float64) if expert_load is None else expert_load
    background = (
        torch.zeros(num_ranks, dtype=torch.float64) if rank_load is None else rank_load
    ).expand(num_layers, -1)
    flat_rank = rank.reshape(num_layers, -1)
    for _ in range(_SHARE_ITERATIONS):
        per_rank = background.clone().scatter_add_(
            1, flat_rank, (volume.unsqueeze(-1) * shares).reshape(num_layers, -1)
        )
        mean = per_rank[:, alive].mean(1, keepdim=True)
        if not bool((mean > 0).all()):
            break
        pressure = (mean / per_rank.clamp(min=1e-12)).gather(1, flat_rank).view_as(shares)
        shares = shares * pressure.clamp(0.25, 4.0).sqrt() * mask
        shares = shares / shares.sum(-1, keepdim=True).clamp(min=1e-300)
    return shares
