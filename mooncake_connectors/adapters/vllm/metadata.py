"""The PD connector's messages inside vLLM: the per-step connector metadata (our
:class:`~mooncake_connectors.pd.plan.StepPlan` as vLLM's ``KVConnectorMetadata``) and each
worker's handshake to its scheduler side. The kv_transfer_params schema itself is engine-free
(:mod:`mooncake_connectors.pd.params`).
"""

from __future__ import annotations

import dataclasses

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)

from ...pd.plan import StepPlan


@dataclasses.dataclass
class PDConnectorMetadata(StepPlan, KVConnectorMetadata):  # type: ignore[misc]  # Any w/o vLLM
    """One step's :class:`StepPlan`, in the type vLLM hands from the scheduler to the workers."""


@dataclasses.dataclass
class PDHandshake(KVConnectorHandshakeMetadata):  # type: ignore[misc]
    """From each worker to its scheduler side: where that TP rank's side channel listens."""

    tp_rank: int
    side_channel: str
