"""Where each expert lives: the :class:`Placement` value and the checks shared by the planners.

Vocabulary (the same as vLLM's and SGLang's EPLB):

- a **logical expert** is one set of weights of the model (``N`` per MoE layer);
- a **physical expert** (slot) is one copy of a logical expert on one rank (``P`` per layer);
- rank ``r`` owns the contiguous slots ``[r * S, (r + 1) * S)`` with ``S = P // R``, which is the
  layout both engines use, so physical ids convert to ranks by integer division.

A placement is one ``[L, P]`` int64 tensor, ``physical_to_logical``; ``-1`` marks an empty slot
(a slot on a rank that left, or one an elastic re-plan has not filled). Everything else
(replica counts, the logical-to-physical table, per-rank load) is derived from it.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from ..errors import ConfigError

EMPTY_SLOT = -1


def check_positive(value: int, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{what} must be a positive integer, got {value!r}")


def as_load(load: torch.Tensor, num_logical: int | None = None) -> torch.Tensor:
    """Validate per-expert load statistics and return them as float64 ``[L, N]`` on the CPU.

    load: ``[N]`` (one layer) or ``[L, N]``; finite and non-negative (token counts or rates).
    """
    if not isinstance(load, torch.Tensor):
        raise ConfigError(f"load must be a torch.Tensor, got {type(load).__name__}")
    if load.dim() == 1:
        load = load.unsqueeze(0)
    if load.dim() != 2 or load.shape[0] == 0 or load.shape[1] == 0:
        raise ConfigError(
            f"load must have shape [N] or [L, N] with L, N > 0, got {list(load.shape)}"
        )
    if num_logical is not None and load.shape[1] != num_logical:
        raise ConfigError(f"load has {load.shape[1]} experts, expected {num_logical}")
    if load.is_complex() or load.dtype == torch.bool:
        raise ConfigError(f"load must be a real tensor, got dtype {load.dtype}")
    out = load.detach().to(device="cpu", dtype=torch.float64)
    if not bool(torch.isfinite(out).all()) or bool((out < 0).any()):
        raise ConfigError("load must be finite and non-negative")
    return out.contiguous()


def as_alive(alive: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """Validate a health mask and return it as a bool ``[R]`` tensor on the CPU.

    alive: ``[R]``, bool or 0/1 integers (SGLang's ``active_ranks`` is int32).
    """
    if not isinstance(alive, torch.Tensor):
        raise ConfigError(f"alive must be a torch.Tensor, got {type(alive).__name__}")
    if alive.dim() != 1 or alive.shape[0] != num_ranks:
        raise ConfigError(f"alive must have shape [{num_ranks}], got {list(alive.shape)}")
    if alive.dtype != torch.bool:
        if alive.is_floating_point() or alive.is_complex():
            raise ConfigError(f"alive must be bool or integer 0/1, got dtype {alive.dtype}")
        if bool(((alive != 0) & (alive != 1)).any()):
            raise ConfigError("alive must hold only 0 and 1")
        alive = alive != 0
    return alive.detach().to("cpu").contiguous()


@dataclasses.dataclass(frozen=True, eq=False)
class Placement:
    """Physical-to-logical expert map of ``L`` MoE layers over ``R`` ranks.

    physical_to_logical: ``[L, P]`` integer tensor, values in ``[-1, N)``; ``-1`` = empty slot.
        Stored as int64 on the CPU (planning is host-side work; routers copy what they need).
    num_logical: ``N``, the number of logical experts per layer.
    num_ranks: ``R``; ``P`` must be a multiple of it.

    Every logical expert must hold at least one slot in every layer: a placement is what the
    planners produce and the engines load. A rank failing does not change the placement, it
    changes the health mask the router reads.
    """

    physical_to_logical: torch.Tensor
    num_logical: int
    num_ranks: int

    def __post_init__(self) -> None:
        check_positive(self.num_logical, "num_logical")
        check_positive(self.num_ranks, "num_ranks")
        p2l = self.physical_to_logical
        if not isinstance(p2l, torch.Tensor):
            raise ConfigError("physical_to_logical must be a torch.Tensor")
        if p2l.dim() == 1:
            p2l = p2l.unsqueeze(0)
        if p2l.dim() != 2 or p2l.shape[0] == 0 or p2l.shape[1] == 0:
            raise ConfigError(
                f"physical_to_logical must have shape [L, P] with L, P > 0, got {list(p2l.shape)}"
            )
        if p2l.is_floating_point() or p2l.is_complex() or p2l.dtype == torch.bool:
            raise ConfigError(f"physical_to_logical must be an integer tensor, got {p2l.dtype}")
        if p2l.shape[1] % self.num_ranks:
            raise ConfigError(
                f"{p2l.shape[1]} physical slots do not divide evenly over {self.num_ranks} ranks"
            )
        p2l = p2l.detach().to(device="cpu", dtype=torch.int64).contiguous()
        if bool((p2l < EMPTY_SLOT).any()) or bool((p2l >= self.num_logical).any()):
            raise ConfigError(f"physical_to_logical values must lie in [-1, {self.num_logical})")
        counts = _replica_count(p2l, self.num_logical)
        missing = (counts == 0).nonzero()
        if missing.numel():
            layer, expert = (int(v) for v in missing[0])
            raise ConfigError(
                f"logical expert {expert} has no slot in layer {layer} "
                f"({missing.shape[0]} unplaced (layer, expert) pairs)"
            )
        # Frozen dataclass: normalise the stored tensor once, here.
        object.__setattr__(self, "physical_to_logical", p2l)

    # ------------------------------------------------------------------ shape

    @property
    def num_layers(self) -> int:
        return int(self.physical_to_logical.shape[0])

    @property
    def num_physical(self) -> int:
        return int(self.physical_to_logical.shape[1])

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical // self.num_ranks

    def rank_of_physical(self) -> torch.Tensor:
        """``[P]`` int64: the rank owning each physical slot."""
        return torch.arange(self.num_physical, dtype=torch.int64) // self.slots_per_rank

    # ------------------------------------------------------------ derived maps

    @functools.cached_property
    def _counts(self) -> torch.Tensor:
        return _replica_count(self.physical_to_logical, self.num_logical)

    def replica_count(self) -> torch.Tensor:
        """``[L, N]`` int64: number of (non-empty) slots holding each logical expert."""
        return self._counts.clone()

    def max_replicas(self) -> int:
        return int(self._counts.max())

    def logical_to_physical(self, width: int | None = None) -> torch.Tensor:
        """``[L, N, X]`` int64: the slots of each logical expert, ascending, padded with ``-1``.

        width: ``X``; defaults to the largest replica count. Engines use wider tables
        (SGLang pads to ``P``, vLLM to ``num_redundant + 1``).
        """
        need = self.max_replicas()
        x = need if width is None else width
        if isinstance(x, bool) or not isinstance(x, int) or x < need:
            raise ConfigError(f"width must be an integer >= {need} (the largest replica count)")
        p2l = self.physical_to_logical
        num_layers, num_physical = p2l.shape
        n = self.num_logical
        phys = torch.arange(num_physical, dtype=torch.int64)
        # Sorting by (logical, physical) groups each expert's slots in ascending order; empty
        # slots sort last.
        key = torch.where(p2l >= 0, p2l * num_physical + phys, n * num_physical + phys)
        order = key.argsort(dim=1)
        sorted_logical = p2l.gather(1, order)
        valid = sorted_logical >= 0
        starts = self._counts.cumsum(1) - self._counts
        replica_rank = phys.expand(num_layers, -1) - starts.gather(1, sorted_logical.clamp(min=0))
        # Empty slots scatter into one extra dump column that is cut off afterwards.
        target = torch.where(valid, sorted_logical * x + replica_rank, n * x)
        out = torch.full((num_layers, n * x + 1), EMPTY_SLOT, dtype=torch.int64)
        out.scatter_(1, target, torch.where(valid, order, EMPTY_SLOT))
        return out[:, : n * x].reshape(num_layers, n, x)

    # ----------------------------------------------------------------- load

    def slot_load(self, load: torch.Tensor) -> torch.Tensor:
        """``[L, P]`` float64: expected load of each slot when every expert's load is split
        evenly over its replicas (what the router does in steady state).

        load: ``[N]`` or ``[L, N]`` per-logical-expert load.
        """
        w = _layer_load(load, self)
        p2l = self.physical_to_logical
        idx = p2l.clamp(min=0)
        share = w.gather(1, idx) / self._counts.gather(1, idx).to(torch.float64)
        return torch.where(p2l >= 0, share, torch.zeros((), dtype=torch.float64))

    def rank_load(self, load: torch.Tensor) -> torch.Tensor:
        """``[L, R]`` float64: expected load per rank (see :meth:`slot_load`)."""
        return self.slot_load(load).view(self.num_layers, self.num_ranks, -1).sum(-1)

    def balance(self, load: torch.Tensor, alive: torch.Tensor | None = None) -> torch.Tensor:
        """``[L]`` float64: max / mean rank load per layer (1.0 is perfect).

        alive: optional ``[R]`` mask; the mean is taken over live ranks only (dead ranks
        hold nothing after an elastic re-plan and would otherwise flatter the ratio).
        """
        per_rank = self.rank_load(load)
        if alive is not None:
            per_rank = per_rank[:, as_alive(alive, self.num_ranks)]
        mean = per_rank.mean(1)
        return torch.where(mean > 0, per_rank.max(1).values / mean.clamp(min=1e-300), 1.0)

    # ---------------------------------------------------------------- misc

    def same_as(self, other: Placement) -> bool:
        return (
            self.num_logical == other.num_logical
            and self.num_ranks == other.num_ranks
            and torch.equal(self.physical_to_logical, other.physical_to_logical)
        )


def _replica_count(p2l: torch.Tensor, num_logical: int) -> torch.Tensor:
    # Column 0 collects the empty slots (-1 + 1) and is dropped.
    counts = torch.zeros(p2l.shape[0], num_logical + 1, dtype=torch.int64)
    counts.scatter_add_(1, p2l + 1, torch.ones_like(p2l))
    return counts[:, 1:].contiguous()


def _layer_load(load: torch.Tensor, placement: Placement) -> torch.Tensor:
    w = as_load(load, placement.num_logical)
    if w.shape[0] == 1 and placement.num_layers > 1:
        w = w.expand(placement.num_layers, -1)
    if w.shape[0] != placement.num_layers:
        raise ConfigError(f"load has {w.shape[0]} layers, placement has {placement.num_layers}")
    return w
