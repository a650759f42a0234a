"""Content hashes that name KV blocks in the store: one derivation for every component.

Pure Python, no engine import: the vLLM store connector (which saves and loads by these names)
and the conductor's store probe (which only estimates what the store holds) both call
:func:`block_hashes`, so the two cannot diverge.

A block's KV depends on more than its token ids, so its hash covers everything vLLM's own prefix
cache folds into its block hashes:

- the token ids of the block and, through the chain, of every block before it;
- the LoRA adapter: its name and path (a name re-pointed at other weights, e.g. after a restart,
  must not reuse KV the store still holds from the old ones; vLLM's prefix cache keys it the
  same way). vLLM's integer ``lora_int_id`` is left out: each server numbers adapters in the
  order it loads them, so it differs between instances;
- multimodal inputs: each input's content identifier with its placeholder range (offset and
  length in the prompt), in every block the placeholder overlaps. Token ids alone cannot tell two
  images apart: their placeholders are the same token repeated;
- ``cache_salt`` (tenant isolation): in the root of the chain, so it reaches every block;
- prompt embeddings: one digest of each block's embedding bytes, given by the caller.

Digests are blake2b, keyed by nothing per process (unlike Python's ``hash``), over a fixed,
self-delimiting encoding, so any process on any host computes the same values. The namespace
of the key carries :data:`KEY_VERSION`; it changes whenever this derivation does, so new code
never reads an object written under an older scheme.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence

from .errors import ConfigError

KEY_VERSION = "v2"  # v1 (no version part): token ids only
_ROOT = b"mooncake-connectors kv block v2"
_DIGEST = 16


@dataclasses.dataclass(frozen=True)
class MultiModalInput:
    """One multimodal input: its content identifier and where its placeholder tokens are."""

    identifier: str
    offset: int
    length: int

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length <= 0:
            raise ConfigError(
                f"a multimodal placeholder needs offset >= 0 and length > 0, got "
                f"{self.offset}+{self.length}"
            )


@dataclasses.dataclass(frozen=True)
class KeyInputs:
    """What a prompt's KV depends on besides its token ids (all empty: a plain text prompt).

    ``embeds``: one digest per full block of the prompt's embeddings (:func:`embeds_digest`),
    empty when the prompt has none.
    """

    cache_salt: str | None = None
    lora_name: str | None = None
    lora_path: str | None = None
    multimodal: tuple[MultiModalInput, ...] = ()
    embeds: tuple[bytes, ...] = ()


PLAIN = KeyInputs()


def _field(data: bytes) -> bytes:
    return struct.pack("<I", len(data)) + data


def _text(value: str | None) -> bytes:
    # None and "" differ from any non-empty value; vLLM treats an empty salt as no salt too
    return b"\0" if not value else b"\1" + _field(value.encode())


def _root(inputs: KeyInputs) -> bytes:
    h = hashlib.blake2b(_ROOT, digest_size=_DIGEST)
    h.update(_text(inputs.cache_salt))
    h.update(_text(inputs.lora_name))
    h.update(_text(inputs.lora_path))
    return h.digest()


def embeds_digest(dtype: str, shape: Sequence[int], data: bytes) -> bytes:
    """Digest of one block's prompt embeddings (their dtype, shape and raw bytes)."""
    h = hashlib.blake2b(_field(dtype.encode()), digest_size=_DIGEST)
    h.update(struct.pack(f"<{len(shape)}q", *shape))
    h.update(data)
    return h.digest()


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    inputs: KeyInputs = PLAIN,
    *,
    limit: int | None = None,
) -> list[bytes]:
    """One digest per full block of ``block_size`` tokens, each naming everything before it.

    Digest i = blake2b(digest i-1, the tokens of block i, the multimodal inputs whose
    placeholders overlap block i, block i's embeddings digest); digest -1 covers the salt and the
    LoRA adapter. ``limit`` caps the number of blocks.
    """
    if block_size <= 0:
        raise ConfigError(f"block size must be > 0, got {block_size}")
    n = len(token_ids) // block_size
    if limit is not None:
        n = min(n, limit)
    if inputs.embeds and len(inputs.embeds) < n:
        raise ConfigError(
            f"{len(inputs.embeds)} prompt-embedding digests for {n} blocks: one per block needed"
        )
    mm = sorted(inputs.multimodal, key=lambda m: (m.offset, m.length, m.identifier))
    out: list[bytes] = []
    prev = _root(inputs)
    for i in range(n):
        start, end = i * block_size, (i + 1) * block_size
        block = array("q", token_ids[start:end])
        if sys.byteorder != "little":
            block.byteswap()  # the same digest on every host
        h = hashlib.blake2b(prev, digest_size=_DIGEST)
        h.update(block.tobytes())
        for m in mm:
            if m.offset < end and start < m.offset + m.length:
                h.update(
                    b"m" + _field(m.identifier.encode()) + struct.pack("<qq", m.offset, m.length)
                )
        if inputs.embeds:
            h.update(b"e" + inputs.embeds[i])
        prev = h.digest()
        out.append(prev)
    return out


def identity_digest(inputs: KeyInputs, num_tokens: int) -> bytes:
    """What the KV of a prompt's first ``num_tokens`` tokens depends on besides their ids, as
    one digest: the salt, the LoRA adapter, the multimodal inputs whose placeholders start
    before ``num_tokens``, the embeddings' block digests. Empty for a plain text prompt, so a
    digest over token ids alone stays what it was for those (PD's ``prompt_hash``)."""
    mm = sorted(
        (m for m in inputs.multimodal if m.offset < num_tokens),
        key=lambda m: (m.offset, m.length, m.identifier),
    )
    if not (inputs.cache_salt or inputs.lora_name or inputs.lora_path or mm or inputs.embeds):
        return b""
    h = hashlib.blake2b(_root(inputs), digest_size=_DIGEST)
    for m in mm:
        h.update(b"m" + _field(m.identifier.encode()) + struct.pack("<qq", m.offset, m.length))
    for e in inputs.embeds:
        h.update(b"e" + e)
    return h.digest()


def prompt_block_hashes(
    token_ids: Sequence[int], block_size: int, inputs: KeyInputs = PLAIN
) -> list[str]:
    """Hex digests of the prompt's full blocks, except that the last prompt token is never in
    one: vLLM computes at least one prompt token itself, so that block is never loaded."""
    limit = max(0, len(token_ids) - 1) // block_size if block_size > 0 else 0
    return [h.hex() for h in block_hashes(token_ids, block_size, inputs, limit=limit)]
