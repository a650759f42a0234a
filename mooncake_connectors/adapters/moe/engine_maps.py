"""Conversions between our :class:`Placement` and the engines' EPLB expert maps.

Both engines describe a placement with the same three tensors (checked against
``sglang/srt/eplb/expert_location.py::ExpertLocationMetadata`` and
``vllm/distributed/eplb/eplb_state.py::EplbModelState``):

- slot -> logical, ``[L, P]``: SGLang ``physical_to_logical_map``, vLLM the same name;
- logical -> slots, ``[L, N, X]`` padded with -1: SGLang ``logical_to_all_physical_map``,
  vLLM ``logical_to_physical_map``;
- replicas per logical expert, ``[L, N]``: SGLang ``logical_to_all_physical_map_num_valid``,
  vLLM ``logical_replica_count``;
- live ranks, ``[R]`` int32, 1 = live: SGLang ``ElasticEPState.active_ranks`` (Mooncake EP's
  mask); vLLM has no equivalent.

SGLang pads ``X`` to ``P`` (its ``_init_raw``); vLLM to ``num_redundant + 1`` (``P - N + 1``),
older releases to 1024. Both engines put rank ``r``'s slots at ``[r * P/R, (r + 1) * P/R)``.

An engine slot with no expert (on a dead rank after SGLang's elasticity-aware re-plan) still
holds some logical id in ``physical_to_logical_map`` (SGLang writes 0) but is absent from the
logical-to-physical table; that table is therefore the source of truth when converting back.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ...errors import ConfigError
from ...moe.placement import EMPTY_SLOT, Placement, as_alive


@dataclasses.dataclass(frozen=True, eq=False)
class SGLangExpertMaps:
    """SGLang's expert-location tensors (int64) and the elastic-EP ``active_ranks`` (int32)."""

    physical_to_logical_map: torch.Tensor
    logical_to_all_physical_map: torch.Tensor
    logical_to_all_physical_map_num_valid: torch.Tensor
    active_ranks: torch.Tensor

    def metadata_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``ExpertLocationMetadata(...)`` (static dispatch map left
        ``None``: SGLang computes it per rank)."""
        return {
            "physical_to_logical_map": self.physical_to_logical_map,
            "physical_to_logical_map_cpu": self.physical_to_logical_map.cpu(),
            "logical_to_all_physical_map": self.logical_to_all_physical_map,
            "logical_to_all_physical_map_cpu": self.logical_to_all_physical_map.cpu(),
            "logical_to_all_physical_map_num_valid": self.logical_to_all_physical_map_num_valid,
            "ep_size": int(self.active_ranks.numel()),  # one entry per EP rank
            "logical_to_rank_dispatch_physical_map": None,
        }


@dataclasses.dataclass(frozen=True, eq=False)
class VllmExpertMaps:
    """vLLM's EPLB tensors (int64)."""

    physical_to_logical_map: torch.Tensor
    logical_to_physical_map: torch.Tensor
    logical_replica_count: torch.Tensor


def to_sglang(
    placement: Placement,
    *,
    alive: torch.Tensor | None = None,
    width: int | None = None,
    empty_fill: int = 0,
) -> SGLangExpertMaps:
    """SGLang maps of ``placement``.

    alive: optional ``[R]`` mask for ``active_ranks`` (all live by default).
    width: ``X`` of ``logical_to_all_physical_map``; ``P`` by default, like SGLang.
    empty_fill: logical id written into empty slots of ``physical_to_logical_map``.
    """
    x = placement.num_physical if width is None else width
    p2l, l2p, count = _maps(placement, x, empty_fill)
    mask = torch.ones(placement.num_ranks, dtype=torch.bool) if alive is None else alive
    active = as_alive(mask, placement.num_ranks).to(torch.int32)
    return SGLangExpertMaps(p2l, l2p, count, active)


def to_vllm(
    placement: Placement, *, width: int | None = None, empty_fill: int = 0
) -> VllmExpertMaps:
    """vLLM maps of ``placement``; ``width`` defaults to ``P - N + 1`` like vLLM's."""
    x = placement.num_physical - placement.num_logical + 1 if width is None else width
    return VllmExpertMaps(*_maps(placement, x, empty_fill))


def from_sglang(
    physical_to_logical_map: torch.Tensor,
    logical_to_all_physical_map: torch.Tensor,
    logical_to_all_physical_map_num_valid: torch.Tensor | None = None,
    *,
    num_ranks: int | None = None,
    active_ranks: torch.Tensor | None = None,
) -> Placement:
    """Placement from SGLang's maps. ``num_ranks`` defaults to ``len(active_ranks)``; the
    health mask itself is not part of a placement (see :func:`alive_from_active_ranks`)."""
    if num_ranks is None:
        if active_ranks is None:
            raise ConfigError("give num_ranks or active_ranks")
        num_ranks = int(active_ranks.shape[0])
    elif active_ranks is not None and int(active_ranks.shape[0]) != num_ranks:
        raise ConfigError(
            f"active_ranks has {active_ranks.shape[0]} entries, num_ranks is {num_ranks}"
        )
    return _from_maps(
        physical_to_logical_map,
        logical_to_all_physical_map,
        logical_to_all_physical_map_num_valid,
        num_ranks,
    )


def from_vllm(
    physical_to_logical_map: torch.Tensor,
    logical_to_physical_map: torch.Tensor,
    logical_replica_count: torch.Tensor | None = None,
    *,
    num_ranks: int,
) -> Placement:
    """Placement from vLLM's maps (also the output of vLLM's / DeepSeek's
    ``rebalance_experts``: ``(phy2log, log2phy, logcnt)``)."""
    return _from_maps(
        physical_to_logical_map, logical_to_physical_map, logical_replica_count, num_ranks
    )


def alive_from_active_ranks(active_ranks: torch.Tensor) -> torch.Tensor:
    """SGLang's int32 ``active_ranks`` as our bool mask."""
    return as_alive(active_ranks, int(active_ranks.shape[0]))


def placement_from_vllm_state(state: Any, *, num_ranks: int) -> Placement:
    """Read an ``EplbModelState`` (or anything with its three map attributes)."""
    return from_vllm(
        state.physical_to_logical_map,
        state.logical_to_physical_map,
        state.logical_replica_count,
        num_ranks=num_ranks,
    )


def apply_to_vllm_state(state: Any, placement: Placement, *, empty_fill: int = 0) -> None:
    """Write ``placement`` into an ``EplbModelState``'s tensors in place (the model's MoE
    layers hold references to them, which is why vLLM itself updates them with ``copy_``).
    Shapes must match the state's; the logical-to-physical width is the state's."""
    old_p2l = state.physical_to_logical_map
    old_l2p = state.logical_to_physical_map
    if tuple(old_p2l.shape) != (placement.num_layers, placement.num_physical):
        raise ConfigError(
            f"state has physical_to_logical_map {list(old_p2l.shape)}, placement is "
            f"[{placement.num_layers}, {placement.num_physical}]"
        )
    maps = to_vllm(placement, width=int(old_l2p.shape[-1]), empty_fill=empty_fill)
    for name in ("physical_to_logical_map", "logical_to_physical_map", "logical_replica_count"):
        target = getattr(state, name)
        source = getattr(maps, name)
        if tuple(target.shape) != tuple(source.shape):
            raise ConfigError(
                f"state.{name} has shape {list(target.shape)}, need {list(source.shape)}"
            )
        target.copy_(source.to(device=target.device, dtype=target.dtype))


def placement_from_sglang_metadata(meta: Any, *, num_ranks: int) -> Placement:
    """Read an ``ExpertLocationMetadata`` (or anything with its map attributes)."""
    return from_sglang(
        meta.physical_to_logical_map,
        meta.logical_to_all_physical_map,
        meta.logical_to_all_physical_map_num_valid,
        num_ranks=num_ranks,
    )


# ----------------------------------------------------------------- internals


def _maps(
    placement: Placement, width: int, empty_fill: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if (
        isinstance(empty_fill, bool)
        or not isinstance(empty_fill, int)
        or not (EMPTY_SLOT <= empty_fill < placement.num_logical)
    ):
        raise ConfigError(f"empty_fill must be an integer in [-1, {placement.num_logical})")
    p2l = placement.physical_to_logical
    p2l = torch.where(p2l >= 0, p2l, empty_fill)
    return p2l, placement.logical_to_physical(width), placement.replica_count()


def _int_tensor(t: Any, name: str, dims: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ConfigError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ConfigError(f"{name} must be an integer tensor, got {t.dtype}")
    if t.dim() != dims:
        raise ConfigError(f"{name} must have {dims} dimensions, got shape {list(t.shape)}")
    return t.detach().to(device="cpu", dtype=torch.int64)


def _from_maps(
    p2l_in: torch.Tensor, l2p_in: torch.Tensor, count_in: torch.Tensor | None, num_ranks: int
) -> Placement:
    p2l = _int_tensor(p2l_in, "physical_to_logical_map", 2)
    l2p = _int_tensor(l2p_in, "logical_to_physical_map", 3)
    num_layers, num_physical = p2l.shape
    if l2p.shape[0] != num_layers:
        raise ConfigError(f"maps disagree on layers: {num_layers} vs {l2p.shape[0]}")
    n = int(l2p.shape[1])
    listed = l2p >= 0
    if count_in is not None:
        count = _int_tensor(count_in, "replica count", 2)
        if tuple(count.shape) != (num_layers, n):
            raise ConfigError(f"replica count must have shape [{num_layers}, {n}]")
        # Engines fill the first ``count`` columns; anything after is padding even if not -1.
        listed &= torch.arange(l2p.shape[2]) < count.unsqueeze(-1)
        if not torch.equal(listed.sum(-1), count):
            raise ConfigError("replica count disagrees with the logical-to-physical map")
    if bool((l2p[listed] >= num_physical).any()):
        raise ConfigError(f"logical-to-physical map names a slot >= {num_physical}")
    layer = torch.arange(num_layers).view(-1, 1, 1).expand_as(l2p)[listed]
    logical = torch.arange(n).view(1, -1, 1).expand_as(l2p)[listed]
    slot = l2p[listed]
    out = torch.full((num_layers, num_physical), EMPTY_SLOT, dtype=torch.int64)
    seen = torch.zeros(num_layers, num_physical, dtype=torch.int64)
    seen.index_put_((layer, slot), torch.ones_like(slot), accumulate=True)
    if bool((seen > 1).any()):
        raise ConfigError("a physical slot is listed for more than one logical expert")
    out[layer, slot] = logical
    if not torch.equal(p2l[layer, slot], logical):
        raise ConfigError("physical_to_logical_map disagrees with the logical-to-physical map")
    return Placement(out, num_logical=n, num_ranks=num_ranks)
