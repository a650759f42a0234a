"""The store as the conductor's global cache index: which prompt prefixes the store holds.

Prefill instances that run ``MooncakeConnectorsStore`` (alone or under vLLM's ``MultiConnector``)
save every finished prompt's full blocks to the store under keys derived from their content
(token ids, cache_salt, LoRA adapter, multimodal inputs, prompt embeddings:
:mod:`mooncake_connectors.kv_keys`, the engine's own function), and any instance loads a prefix
another one saved. So the proxy can compute the keys of a prompt itself and ask the store's
master which exist: one ``Exists`` call per request, over one layer's keys of each block.

The proxy sees only the HTTP request, so this is an estimate, a placement hint: the engine
computes its own keys and checks every layer and rank before it loads, so the estimate never
causes a wrong load, only a better or worse placement. What the request body gives
(:func:`key_inputs_of`): ``cache_salt``. What it does not: the LoRA adapter's path, and the
engine's content hashes and placeholder positions of images, audio and video; requests carrying
those (or prompt embeddings) are not probed (0 blocks held), except LoRA requests, probed as
base-model ones (see docs/vllm.md, "Store keys").

Keys are ``{prefix}/{block hash}/{layer}``; ``prefix`` and ``layer`` are the deployment's (the
store connector's namespace, key version, model, KV layout and rank-0 shard, and one of vLLM's
layer names), given as one template with ``{block}`` where the hash goes, e.g.
``vllm/v2/Qwen%2FQwen3-0.6B/bfloat16.b16.h8x128/tp0-1.pp0-1/{block}/model.layers.0.self_attn.attn``.
Full blocks of the engine's block size are keyed, leaving out the block that holds the prompt's
last token (the engine always computes that token itself, so that block is never loaded).

Blocking I/O (a socket to the master); the proxy calls it on a worker thread.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import ConfigError, MooncakeConnectorsError
from ..kv_keys import KEY_VERSION, PLAIN, KeyInputs, prompt_block_hashes
from ..store.link import Dialer, MasterLink
from ..store.protocol import Bools, Exists

BLOCK_FIELD = "{block}"
_TEXT_PARTS = frozenset({"text", "refusal"})  # content parts that are text alone


def key_inputs_of(body: Mapping[str, Any]) -> KeyInputs | None:
    """The key inputs an OpenAI request body gives, or None when its keys cannot be computed
    here (prompt embeddings; a chat message with an image, audio, video or file part, whose
    content hash and placeholder positions only the engine knows)."""
    if body.get("prompt_embeds") is not None:
        return None
    messages = body.get("messages")
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, list) and any(
            not isinstance(part, Mapping) or part.get("type") not in _TEXT_PARTS for part in content
        ):
            return None
    salt = body.get("cache_salt")
    return KeyInputs(cache_salt=salt if isinstance(salt, str) and salt else None)


class StoreProbe:
    """Asks the store's master how many leading blocks of a prompt it holds."""

    def __init__(
        self,
        master: str,
        key_template: str,
        block_size: int,
        *,
        timeout: float = 1.0,
        auth_token: str | None = None,
    ) -> None:
        if key_template.count(BLOCK_FIELD) != 1:
            raise ConfigError(
                f"the store key template needs {BLOCK_FIELD} exactly once", template=key_template
            )
        if f"/{KEY_VERSION}/" not in key_template.split(BLOCK_FIELD)[0]:
            raise ConfigError(
                f"the store key template lacks the key version /{KEY_VERSION}/ after the "
                "namespace: it names keys of an older scheme, which no engine writes any more",
                template=key_template,
            )
        if block_size <= 0:
            raise ConfigError("block_size must be > 0", block_size=block_size)
        if not timeout > 0:
            raise ConfigError("the store probe's timeout must be > 0")
        self.head, self.tail = key_template.split(BLOCK_FIELD)
        self.block_size = block_size
        self.timeout = timeout
        token = auth_token or os.environ.get("MOONCAKE_CONNECTORS_STORE_TOKEN") or None
        self.link = MasterLink(master, timeout, Dialer(token))
        self.calls = 0
        self.errors = 0
        self.last_error = ""

    def keys(self, token_ids: Sequence[int], inputs: KeyInputs = PLAIN) -> list[str]:
        hashes = prompt_block_hashes(token_ids, self.block_size, inputs)
        return [f"{self.head}{h}{self.tail}" for h in hashes]

    def held_blocks(self, token_ids: Sequence[int], inputs: KeyInputs | None = PLAIN) -> int:
        """Leading blocks of the prompt in the store (0 when the store does not answer in time:
        the request is then placed as if nothing could be loaded). ``inputs`` None: the keys
        cannot be computed here (:func:`key_inputs_of`); 0 without asking."""
        if inputs is None:
            return 0
        keys = self.keys(token_ids, inputs)
        if not keys:
            return 0
        self.calls += 1
        try:
            reply = self.link.call(Exists(keys), time.monotonic() + self.timeout)
        except MooncakeConnectorsError as exc:  # master down, auth refused, bad reply
            self.errors += 1
            self.last_error = repr(exc)
            return 0
        if not isinstance(reply, Bools) or len(reply.values) != len(keys):
            self.errors += 1
            self.last_error = f"unexpected reply {type(reply).__name__}"
            return 0
        n = 0
        for present in reply.values:
            if not present:
                break
            n += 1
        return n

    def stats(self) -> dict[str, object]:
        return {"calls": self.calls, "errors": self.errors, "last_error": self.last_error}

    def close(self) -> None:
        self.link.close()
