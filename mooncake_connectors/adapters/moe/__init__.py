"""Conversions between :class:`mooncake_connectors.moe.Placement` and the engines' EPLB expert
maps (vLLM's ``EplbState``, SGLang's ``ExpertLocationMetadata``). The routing math itself is
:mod:`mooncake_connectors.moe`. Needs torch (the ``torch`` extra).
"""

from __future__ import annotations

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

__all__ = [
    "SGLangExpertMaps",
    "VllmExpertMaps",
    "alive_from_active_ranks",
    "apply_to_vllm_state",
    "from_sglang",
    "from_vllm",
    "placement_from_sglang_metadata",
    "placement_from_vllm_state",
    "to_sglang",
    "to_vllm",
]
