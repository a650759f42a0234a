from __future__ import annotations

from pathlib import Path

import pytest

from mooncake_connectors.conductor.estimators import (
    DecodeModel,
    PrefillModel,
    TransferModel,
)
from mooncake_connectors.conductor.scheduler import ConductorConfig
from mooncake_connectors.conductor.types import Admission, PlacementPolicy

TRACE_HEAD = Path(__file__).parent / "data" / "conversation_head600.jsonl"

# Round numbers so expected answers can be worked out by hand:
# prefill of n new tokens = 1 ms per token (no constant, no quadratic term);
# transfer = 0.5 ms per token; decode step = 10 ms + 1 ms per sequence.
PREFILL = PrefillModel(a=0.0, b=1e-3, c=0.0)
TRANSFER = TransferModel(bandwidth_bytes_per_s=2000.0, kv_bytes_per_token=1)
DECODE = DecodeModel(base_s=0.010, per_seq_s=0.001, per_kv_token_s=0.0, capacity_tokens=10_000)


def make_config(
    placement: PlacementPolicy,
    admission: Admission = Admission.NONE,
    *,
    prefill: int = 3,
    decode: int = 2,
    **kw: object,
) -> ConductorConfig:
    return ConductorConfig(
        prefill_instances=tuple(f"p{i}" for i in range(prefill)),
        decode_instances=tuple(f"d{i}" for i in range(decode)),
        prefill_model=PREFILL,
        transfer_model=TRANSFER,
        decode_model=DECODE,
        placement=placement,
        admission=admission,
        block_tokens=100,
        **kw,  # type: ignore[arg-type]
    )


@pytest.fixture
def trace_head() -> Path:
    return TRACE_HEAD
