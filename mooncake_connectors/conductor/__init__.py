"""KV-aware prefill/decode scheduling (the Mooncake paper's Conductor) and its trace replay.

Scheduling core, pure and I/O-free: :mod:`.hashing` (chained prefix-block keys),
:mod:`.cache_index` (per-instance cached blocks from KV events), :mod:`.estimators` (prefill,
transfer and decode time models), :mod:`.policies` (placement), :mod:`.scheduler`
(:class:`Conductor`: place or reject each request). Replay: :mod:`.trace`, :mod:`.simulator`,
:mod:`.report`, :mod:`.replay`. See docs/conductor.md.
"""

from .cache_index import AllBlocksCleared, BlockRemoved, BlockStored, CacheIndex
from .estimators import (
    DecodeModel,
    InstanceModels,
    PrefillModel,
    TransferModel,
    fit_prefill_model,
    llama2_70b_a800,
)
from .hashing import prefix_block_hashes, prefix_match_blocks
from .scheduler import Conductor, ConductorConfig
from .types import (
    Admission,
    Placement,
    PlacementPolicy,
    Rejection,
    RejectReason,
    ScheduleRequest,
)

__all__ = [
    "Admission",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "CacheIndex",
    "Conductor",
    "ConductorConfig",
    "DecodeModel",
    "InstanceModels",
    "Placement",
    "PlacementPolicy",
    "PrefillModel",
    "RejectReason",
    "Rejection",
    "ScheduleRequest",
    "TransferModel",
    "fit_prefill_model",
    "llama2_70b_a800",
    "prefix_block_hashes",
    "prefix_match_blocks",
]
