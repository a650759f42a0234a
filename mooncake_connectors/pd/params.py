"""The ``kv_transfer_params`` contract between the proxy, the prefill and the decode instance.

kv_transfer_params is a JSON object that travels in the OpenAI request and answer bodies. One
schema here serves every party that writes or reads it (the PD proxy, the vLLM connector's
scheduler side, the benchmark's own two-leg driver), so a key is spelled in one place only.

Pull (prefill first, then decode):

- the proxy sends the prefill request :class:`PrefillLeg` (``{"do_remote_decode": true}``);
- the prefill answers :class:`PullParams`: where the prompt's KV blocks are and until when;
- the proxy sends the decode request those params unchanged.

Layer-wise push (both legs at once): the prefill request is :class:`PrefillLeg` with a
``push_id``, the decode request :class:`PushParams` (the same id and the prefill's
:class:`PrefillEngine`, which the proxy learned from an earlier pull answer).

Field names are short in Python and keep their JSON keys (``remote_*``) on the wire. Decoding
checks types and ranges and raises :class:`~mooncake_connectors.errors.ProtocolError` naming the
offending key; unknown keys are ignored, because other connectors share the same object.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, TypeVar

import msgspec

from ..errors import ProtocolError

PUSH_ID_MAX = 128  # a push id names prefill-side state: a bounded key

_Channels = Annotated[tuple[str, ...], msgspec.Meta(min_length=1)]
_TpSize = Annotated[int, msgspec.Meta(ge=1)]
_BlockId = Annotated[int, msgspec.Meta(ge=0)]
_ENGINE_KEYS = {
    "engine_id": "remote_engine_id",
    "side_channels": "remote_side_channels",
    "tp_size": "remote_tp_size",
}


def prompt_hash(token_ids: Sequence[int], identity: bytes = b"") -> str:
    """A short digest of token ids and of what else their KV depends on: decode must load KV
    computed for exactly its tokens, under its LoRA adapter, for its images, with its
    ``cache_salt``. ``identity`` is :func:`~mooncake_connectors.kv_keys.identity_digest` of the
    request (empty for a plain text prompt, whose digest is then that of its ids alone)."""
    h = hashlib.blake2b(array("q", token_ids).tobytes(), digest_size=16)
    if identity:
        h.update(b"i" + identity)
    return h.hexdigest()


def _check_channels(side_channels: tuple[str, ...], tp_size: int) -> None:
    # One side channel per prefill TP rank: anything else would send a rank's notices astray.
    if len(side_channels) != tp_size:
        raise ValueError(f"{len(side_channels)} side channels for tp_size {tp_size}")


class PrefillLeg(msgspec.Struct, frozen=True):
    """The prefill request's params: compute the prompt and keep its KV for a decode instance;
    with ``push_id``, also write it layer by layer wherever that push's decode asks."""

    do_remote_decode: bool = True
    do_remote_prefill: bool = False
    push_id: Annotated[str, msgspec.Meta(min_length=1, max_length=PUSH_ID_MAX)] | None = None


class PrefillEngine(msgspec.Struct, frozen=True, rename=_ENGINE_KEYS):
    """Where a prefill instance's workers listen: what a pushed decode request needs."""

    engine_id: str
    side_channels: _Channels
    tp_size: _TpSize

    def __post_init__(self) -> None:
        _check_channels(self.side_channels, self.tp_size)


class PullParams(
    msgspec.Struct,
    frozen=True,
    rename=_ENGINE_KEYS
    | {
        "request_id": "remote_request_id",
        "block_ids": "remote_block_ids",
        "group_block_ids": "remote_group_block_ids",
        "num_tokens": "remote_num_tokens",
        "prompt_hash": "remote_prompt_hash",
        "expires_at": "remote_expires_at",
    },
):
    """The prefill's answer, and the decode request's params: the prompt's KV is on a prefill.

    ``block_ids`` hold the first ``num_tokens`` prompt tokens, whose :func:`prompt_hash` is
    ``prompt_hash``; the prefill frees them at ``expires_at`` (wall clock, s) at the latest.
    With several KV cache groups (vLLM's hybrid KV cache manager) ``group_block_ids`` holds each
    group's block ids instead (0, vLLM's null block, where a sliding-window group already freed
    a block) and ``block_ids`` is absent, so a decode that knows only one group refuses the
    params (missing ``remote_block_ids``) instead of reading one group's blocks for every layer.
    """

    engine_id: str
    request_id: str
    num_tokens: Annotated[int, msgspec.Meta(ge=0)]
    prompt_hash: str
    side_channels: _Channels
    tp_size: _TpSize
    expires_at: float
    block_ids: tuple[_BlockId, ...] | None = None
    group_block_ids: (
        Annotated[tuple[tuple[_BlockId, ...], ...], msgspec.Meta(min_length=2)] | None
    ) = None
    do_remote_prefill: bool = True
    do_remote_decode: bool = False

    def __post_init__(self) -> None:
        _check_channels(self.side_channels, self.tp_size)
        if (self.block_ids is None) == (self.group_block_ids is None):
            raise ValueError("exactly one of remote_block_ids, remote_group_block_ids")

    def groups(self) -> tuple[tuple[int, ...], ...]:
        """Each KV cache group's block ids (one group: ``block_ids``)."""
        if self.group_block_ids is not None:
            return self.group_block_ids
        assert self.block_ids is not None
        return (self.block_ids,)


class PushParams(msgspec.Struct, frozen=True, rename=_ENGINE_KEYS):
    """The decode request's params for a layer-wise push from the prefill engine named here."""

    push_id: Annotated[str, msgspec.Meta(min_length=1, max_length=PUSH_ID_MAX)]
    engine_id: str
    side_channels: _Channels
    tp_size: _TpSize
    do_remote_prefill: bool = True

    def __post_init__(self) -> None:
        _check_channels(self.side_channels, self.tp_size)

    @classmethod
    def to(cls, engine: PrefillEngine, push_id: str) -> PushParams:
        return cls(push_id, engine.engine_id, engine.side_channels, engine.tp_size)


Params = PrefillLeg | PrefillEngine | PullParams | PushParams
P = TypeVar("P", PrefillLeg, PrefillEngine, PullParams, PushParams)


def encode(params: Params) -> dict[str, Any]:
    """``params`` as the JSON object that goes into a request or answer body (lists, not
    tuples, so it compares equal to what the other side reads back; no absent ``push_id``)."""
    out: dict[str, Any] = msgspec.json.decode(msgspec.json.encode(params))
    return {k: v for k, v in out.items() if v is not None}


def decode(params: Mapping[str, Any] | None, kind: type[P]) -> P:
    """Validate a kv_transfer_params object as ``kind``; ProtocolError says what is wrong."""
    if not isinstance(params, Mapping):
        raise ProtocolError(
            f"kv_transfer_params ({kind.__name__}) must be an object, got {type(params).__name__}"
        )
    try:
        return msgspec.convert(dict(params), kind)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"kv_transfer_params are not valid {kind.__name__}: {exc}") from exc


def _flag(params: Mapping[str, Any] | None, key: str) -> bool:
    return bool(params.get(key)) if isinstance(params, Mapping) else False


def wants_remote_prefill(params: Mapping[str, Any] | None) -> bool:
    """The decode request says its prompt's KV comes from a prefill (pull or push)."""
    return _flag(params, "do_remote_prefill")


def wants_remote_decode(params: Mapping[str, Any] | None) -> bool:
    """The prefill request says a decode instance will take over its KV."""
    return _flag(params, "do_remote_decode")


def is_push(params: Mapping[str, Any] | None) -> bool:
    """Either leg of a layer-wise push (both carry its ``push_id``)."""
    return _flag(params, "push_id")


def release(params: dict[str, Any]) -> None:
    """Mark a decode request's params as used: one transfer per request, even if rescheduled."""
    params["do_remote_prefill"] = False
