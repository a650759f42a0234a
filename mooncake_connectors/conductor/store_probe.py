"""The store as the conductor's global cache index: which prompt prefixes the store holds.

Prefill instances that run ``MooncakeConnectorsStore`` (alone or under vLLM's ``MultiConnector``)
save every finished prompt's full blocks to the store under keys that depend only on the token
ids (and on model, layout and rank), and any instance loads a prefix another one saved. So the
proxy can compute the keys of a prompt itself and ask the store's master which exist: one
``Exists`` call per request, over one layer's keys of each block. The engine later checks every
layer and rank before it loads; a block present for the probed layer but not for another costs a
recompute, never a wrong answer.

Keys are ``{prefix}/{block hash}/{layer}``; ``prefix`` and ``layer`` are the deployment's (the
store connector's namespace, model, KV layout and rank-0 shard, and one of vLLM's layer names),
given as one template with ``{block}`` where the hash goes, e.g.
``vllm/Qwen%2FQwen3-0.6B/bfloat16.b16.h8x128/tp0-1.pp0-1/{block}/model.layers.0.self_attn.attn``.
The block hash is the chained blake2b of the store connector (16 bytes, hex), over full blocks of
the engine's block size, leaving out the block that holds the prompt's last token (the engine
always computes that token itself, so that block is never loaded).

Blocking I/O (a socket to the master); the proxy calls it on a worker thread.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from array import array
from collections.abc import Sequence

from ..errors import ConfigError, MooncakeConnectorsError
from ..store.link import Dialer, MasterLink
from ..store.protocol import Bools, Exists

BLOCK_FIELD = "{block}"


def store_block_hashes(token_ids: Sequence[int], block_size: int) -> list[str]:
    """The store connector's block hashes of a prompt (hex), in order.

    The same function as the vLLM store connector's (a test holds them equal); kept here because
    the conductor sits below the adapters.
    """
    if block_size <= 0:
        raise ConfigError(f"block size must be > 0, got {block_size}")
    n = max(0, len(token_ids) - 1) // block_size
    out: list[str] = []
    prev = b""
    for i in range(n):
        block = array("q", token_ids[i * block_size : (i + 1) * block_size])
        if sys.byteorder != "little":
            block.byteswap()
        prev = hashlib.blake2b(prev + block.tobytes(), digest_size=16).digest()
        out.append(prev.hex())
    return out


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

    def keys(self, token_ids: Sequence[int]) -> list[str]:
        hashes = store_block_hashes(token_ids, self.block_size)
        return [f"{self.head}{h}{self.tail}" for h in hashes]

    def held_blocks(self, token_ids: Sequence[int]) -> int:
        """Leading blocks of the prompt in the store (0 when the store does not answer in time:
        the request is then placed as if nothing could be loaded)."""
        keys = self.keys(token_ids)
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
