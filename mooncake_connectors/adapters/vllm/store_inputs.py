"""What a vLLM request's KV depends on besides its token ids, as store-key inputs.

Reads vLLM's :class:`~vllm.v1.request.Request` (attributes only, duck-typed) into
:class:`~mooncake_connectors.kv_keys.KeyInputs`: ``cache_salt``, the LoRA adapter's name and
path, each multimodal feature's ``identifier`` (vLLM's content hash of the item, LoRA-prefixed
where the encoder runs under an adapter) with its placeholder range, and one digest per block of
``prompt_embeds``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ...kv_keys import KeyInputs, MultiModalInput, embeds_digest

if TYPE_CHECKING:
    from vllm.v1.request import Request


def _embeds_digests(embeds: Any, blocks: int, block_size: int) -> tuple[bytes, ...]:
    import torch

    out = []
    for i in range(blocks):
        part = embeds[i * block_size : (i + 1) * block_size].detach().contiguous().cpu()
        raw = part.flatten().view(torch.uint8).numpy().tobytes()
        out.append(embeds_digest(str(part.dtype), tuple(part.shape), raw))
    return tuple(out)


def key_inputs(request: Request, block_size: int) -> KeyInputs:
    lora = getattr(request, "lora_request", None)
    multimodal = tuple(
        MultiModalInput(str(f.identifier), int(f.mm_position.offset), int(f.mm_position.length))
        for f in (getattr(request, "mm_features", None) or ())
    )
    embeds = getattr(request, "prompt_embeds", None)
    digests: tuple[bytes, ...] = ()
    if embeds is not None:
        digests = _embeds_digests(embeds, int(request.num_prompt_tokens) // block_size, block_size)
    return KeyInputs(
        cache_salt=getattr(request, "cache_salt", None) or None,
        lora_name=None if lora is None else str(lora.lora_name),
        lora_path=None if lora is None else str(lora.lora_path or ""),
        multimodal=multimodal,
        embeds=digests,
    )


def key_token_ids(request: Request) -> Sequence[int]:
    """The ids the key hashes: the prompt's, or zeros for a prompt given only as embeddings
    (their digests then name the content)."""
    ids: Sequence[int] | None = request.prompt_token_ids
    if ids is not None:
        return ids
    return [0] * int(request.num_prompt_tokens)
