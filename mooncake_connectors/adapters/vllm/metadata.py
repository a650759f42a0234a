"""What the PD scheduler side tells the workers each step, and the kv_transfer_params contract.

kv_transfer_params (JSON, carried by the proxy from the prefill response to the decode request):

    do_remote_prefill      true: "this request's prompt KV is on a prefill instance"
    remote_engine_id       the prefill instance's engine id
    remote_request_id      the request id on the prefill instance
    remote_block_ids       its block ids holding the prompt KV, in order
    remote_num_tokens      how many prompt tokens those blocks hold
    remote_prompt_hash     blake2b of those token ids: decode loads only for the same tokens
    remote_side_channels   tcp://host:port of each prefill TP rank's side channel
    remote_tp_size         the prefill instance's tensor-parallel size
    remote_expires_at      wall-clock time (s) after which prefill may free the blocks

The prefill request itself carries ``{"do_remote_decode": true}``.

Layer-wise push (the proxy runs both legs at once): the prefill request carries
``{"do_remote_decode": true, "push_id": ID}`` and the decode request

    do_remote_prefill      true
    push_id                the same ID
    remote_engine_id       the prefill instance's engine id
    remote_side_channels   its side channels (the proxy learned them from an earlier answer)
    remote_tp_size         its tensor-parallel size
"""

from __future__ import annotations

import dataclasses
import hashlib
from array import array
from collections.abc import Mapping, Sequence
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)


def prompt_hash(token_ids: Sequence[int]) -> str:
    """A short digest of token ids: decode must load KV computed for exactly its tokens."""
    return hashlib.blake2b(array("q", token_ids).tobytes(), digest_size=16).hexdigest()


@dataclasses.dataclass(frozen=True)
class RemotePrefill:
    """The validated ``do_remote_prefill`` part of a decode request's kv_transfer_params."""

    engine_id: str
    request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    prompt_hash: str
    side_channels: tuple[str, ...]
    tp_size: int
    expires_at: float

    @classmethod
    def parse(cls, params: Mapping[str, Any] | None) -> RemotePrefill | None:
        """None when the params are absent or not ours (then the request simply recomputes)."""
        if not params:
            return None
        try:
            block_ids = tuple(int(b) for b in params["remote_block_ids"])
            channels = tuple(str(c) for c in params["remote_side_channels"])
            out = cls(
                engine_id=str(params["remote_engine_id"]),
                request_id=str(params["remote_request_id"]),
                block_ids=block_ids,
                num_tokens=int(params["remote_num_tokens"]),
                prompt_hash=str(params["remote_prompt_hash"]),
                side_channels=channels,
                tp_size=int(params["remote_tp_size"]),
                expires_at=float(params["remote_expires_at"]),
            )
        except (KeyError, TypeError, ValueError):
            return None
        if out.num_tokens < 0 or out.tp_size < 1 or len(channels) != out.tp_size:
            return None
        return out


@dataclasses.dataclass(frozen=True)
class RemotePush:
    """The validated push part of a decode request's kv_transfer_params."""

    push_id: str
    engine_id: str
    side_channels: tuple[str, ...]
    tp_size: int

    @classmethod
    def parse(cls, params: Mapping[str, Any] | None) -> RemotePush | None:
        if not params or not params.get("push_id"):
            return None
        try:
            out = cls(
                push_id=str(params["push_id"]),
                engine_id=str(params["remote_engine_id"]),
                side_channels=tuple(str(c) for c in params["remote_side_channels"]),
                tp_size=int(params["remote_tp_size"]),
            )
        except (KeyError, TypeError, ValueError):
            return None
        if out.tp_size < 1 or len(out.side_channels) != out.tp_size or len(out.push_id) > 128:
            return None
        return out


@dataclasses.dataclass
class PushRecvSpec:
    """Decode side: ask the prefill to write its blocks ``first_block…`` into ``local_block_ids``.

    Empty ``local_block_ids``: nothing to receive, the prefill may free its blocks.
    """

    request_id: str
    local_block_ids: list[int]
    first_block: int
    num_tokens: int
    prompt_hash: str
    remote: RemotePush
    error: str | None = None


@dataclasses.dataclass
class PushSendStep:
    """Prefill side, one step: after this step's forward the request's blocks ``[0, ready)``
    hold their final KV in every layer; ``final``: the prompt is complete (``aborted``: the
    request ended without it)."""

    request_id: str
    push_id: str
    block_ids: list[int]
    ready: int
    num_tokens: int
    prompt_hash: str
    final: bool = False
    aborted: bool = False


@dataclasses.dataclass
class RecvSpec:
    """Read ``remote_block_ids`` of a prefill request into ``local_block_ids`` (same order).

    Empty ``local_block_ids``: nothing to read, only tell the prefill to free its blocks (the
    request was aborted, or the decode instance already had the whole prompt cached).
    ``error``: the scheduler side already knows the load cannot happen; the worker reports the
    local blocks as failed so vLLM recomputes them.
    """

    request_id: str
    local_block_ids: list[int]
    remote_block_ids: list[int]
    remote: RemotePrefill
    error: str | None = None


@dataclasses.dataclass
class PDConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]  # Any without vLLM
    recv: list[RecvSpec] = dataclasses.field(default_factory=list)
    send: dict[str, float] = dataclasses.field(default_factory=dict)  # request id -> lease (s)
    push_recv: list[PushRecvSpec] = dataclasses.field(default_factory=list)
    push_send: list[PushSendStep] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class PDHandshake(KVConnectorHandshakeMetadata):  # type: ignore[misc]
    """From each worker to its scheduler side: where that TP rank's side channel listens."""

    tp_rank: int
    side_channel: str
