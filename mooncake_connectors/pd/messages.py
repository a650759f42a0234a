"""The PD side channel's messages (msgspec msgpack structs), and the KV layout they carry.

A prefill worker answers :class:`LayoutRequest` with its :class:`WorkerLayout` and takes
:class:`Done` notices; with layer-wise push it takes a :class:`PushTarget` and answers
:class:`PushDone` on the decode worker's own side channel. :func:`decode` turns any malformed
frame into :class:`~mooncake_connectors.errors.ProtocolError`.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from ..errors import ProtocolError

# Bounds a decoded message must keep, checked by msgspec before it builds the lists, so a hostile
# peer's message costs its own size at most: far above what a real engine sends (one request id
# per Done, a few hundred layers, the blocks of one request).
MAX_ID = 1024  # characters of a request, push or engine id
MAX_DONE_IDS = 1024  # request ids in one Done (our sender puts one)
MAX_LAYERS = 1 << 12
MAX_BLOCKS = 1 << 17  # block ids in one PushTarget: 2M tokens of 16-token blocks
MAX_RANKS = 1 << 12  # TP ranks
Id = Annotated[str, msgspec.Meta(max_length=MAX_ID)]
Rank = Annotated[int, msgspec.Meta(ge=0, lt=MAX_RANKS)]


class LayerLayout(msgspec.Struct, frozen=True, array_like=True):
    """Where one layer's KV blocks are: block ``b`` is ``block_bytes`` at ``addr + b*stride``.

    ``head_bytes``: when KV heads are the outermost dimension inside a block (vLLM's CPU layout),
    the bytes of one head's part of a block, so a range of heads is one contiguous range; 0 when
    heads are interleaved (then blocks move only whole, between equal TP sizes).
    """

    name: Id
    addr: int
    stride: int
    block_bytes: int
    num_blocks: int
    head_bytes: int = 0


class WorkerLayout(msgspec.Struct, frozen=True):
    """What a peer needs to read this worker's KV blocks."""

    engine_id: str
    tp_rank: int
    tp_size: int
    segment: str  # transfer-engine segment name
    side_channel: str  # tcp://host:port of this worker's ROUTER socket
    block_size: int  # tokens per (scheduler) block
    dtype: str
    layers: Annotated[list[LayerLayout], msgspec.Meta(max_length=MAX_LAYERS)]
    # vLLM's hybrid KV cache manager: the engine's layer names of each KV cache group, and each
    # group's kind ("full", or "sliding:<window tokens>"); None: one group of every layer.
    groups: Annotated[list[list[str]], msgspec.Meta(max_length=MAX_LAYERS)] | None = None
    group_kinds: Annotated[list[str], msgspec.Meta(max_length=MAX_LAYERS)] | None = None


class LayoutRequest(msgspec.Struct, tag="layout"):
    nonce: int


class LayoutReply(msgspec.Struct, tag="layout_reply"):
    nonce: int
    layout: WorkerLayout


class Done(msgspec.Struct, tag="done"):
    """The sender has finished reading (or gave up on) these requests' blocks.

    ``reader`` is the sender's TP rank, ``readers`` how many decode ranks read this prefill
    rank's blocks (more than one when decode has the larger TP): the blocks are freed once all
    of them are done.
    """

    engine_id: Id
    request_ids: Annotated[list[Id], msgspec.Meta(max_length=MAX_DONE_IDS)]
    reader: Rank = 0
    readers: Annotated[int, msgspec.Meta(ge=1, le=MAX_RANKS)] = 1


class PushTarget(msgspec.Struct, tag="push_target"):
    """Where a decode worker wants prefill request ``push_id``'s KV written.

    Prefill block ``first_block + i`` of the request goes to the decode block ``block_ids[i]``.
    ``num_tokens`` and ``prompt_hash`` name the prompt the decode side expects; a prefill computing
    other tokens refuses. Nothing may be written after ``expires_at`` (wall clock): the decode side
    gives up then and reuses the blocks. Empty ``block_ids``: the decode needs nothing (aborted,
    or fully cached); the prefill frees the request's blocks.
    """

    push_id: Id
    engine_id: Id  # the prefill engine the sender means
    target: WorkerLayout
    first_block: int
    block_ids: Annotated[list[int], msgspec.Meta(max_length=MAX_BLOCKS)]
    num_tokens: int
    prompt_hash: str
    expires_at: float


class PushDone(msgspec.Struct, tag="push_done"):
    """From the prefill worker to the decode worker's side channel: the push ended."""

    push_id: str
    ok: bool
    error: str = ""
    nbytes: int = 0
    nreqs: int = 0
    tail_s: float = 0.0  # from the end of the prefill's last forward to the last byte written
    overlapped: int = 0  # bytes written from save_kv_layer, while the forward was running


Message = LayoutRequest | LayoutReply | Done | PushTarget | PushDone
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    try:
        return _decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"bad side-channel message: {exc}") from exc
