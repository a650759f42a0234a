"""Scheduler-side bookkeeping of the store connector (runs in vLLM's engine-core process).

Load: a new request's prompt is cut into vLLM blocks and each full block gets its chained hash
over its tokens and everything else its KV depends on (:mod:`.store_keys`, :mod:`.store_inputs`).
Beyond the blocks vLLM's own prefix cache already has, the store is asked
(one ``batch_exists`` for every layer of every TP rank) how many following blocks it holds
without a gap; those tokens are offered as an asynchronous external hit. Once vLLM has allocated
blocks for them, the workers are told which keys go into which blocks.

Save: when a request finishes normally, its full prompt blocks are handed to the workers, which
write those the store lacks; vLLM keeps the blocks until the workers report the save done. With
``save_during_prefill`` (default), each step also hands over the full prompt blocks it completes
(``step`` saves, written after that step's forward pass), so a long prompt prefilled in chunks is
in the store before its request ends; the finish-time save then covers what is left.

Several KV cache groups (vLLM's hybrid KV cache manager, e.g. sliding-window and full-attention
layers): each group has its own blocks, and a sliding-window group holds only the blocks of its
window (vLLM's null block, id 0, stands for the others). A save writes every block each group
still holds; a hit ends at a block where every group has what vLLM allocates for it there (all
blocks from the lookup's first for full attention, the window's for sliding window); a load reads
only the blocks vLLM allocated. A step save writes what each group holds of the blocks its step
completed: a sliding-window group's blocks that leave the window are freed at the next step, so
the workers finish a step's saves before the next step's forward pass may write those blocks
(:mod:`.store_worker`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from ...errors import ConfigError
from ...store.guarded import FAILED, GuardedStore
from ..keys import Shard
from .store_config import StoreConnectorConfig
from .store_events import StoreEventLog
from .store_inputs import key_inputs, key_token_ids
from .store_keys import BlockKeys, layout_tag, prompt_block_hashes
from .store_lookup import PENDING, Lookups
from .store_step_saves import step_saves

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


@dataclasses.dataclass
class BlockSpec:
    """Load (or save) the blocks ``block_ids`` of request ``request_id``, whose chained hashes are
    ``hashes`` (same order). ``error``: the scheduler already knows the load cannot happen; the
    worker reports the blocks as failed so vLLM recomputes them."""

    request_id: str
    block_ids: list[int]
    hashes: list[str]
    error: str | None = None
    # Saves only, for the KV event announcing the saved blocks (:mod:`.store_events`): the
    # blocks' token ids, vLLM's per-block extra keys as its events publish them, the LoRA name.
    token_ids: list[int] = dataclasses.field(default_factory=list)
    extra_keys: list[tuple[Any, ...] | None] | None = None
    lora_name: str | None = None
    # Several KV cache groups: groups[g][i] is group g's block for hashes[i], 0 (vLLM's null
    # block) where the group holds none; block_ids then lists every group's blocks.
    groups: list[list[int]] = dataclasses.field(default_factory=list)
    # A save of the blocks this step completes (``save_during_prefill``): written after the
    # step's forward pass and not reported done (the request still runs). ``parent``: the chained
    # hash of the block before ``hashes[0]``, None from the prompt's first block.
    step: bool = False
    parent: str | None = None


@dataclasses.dataclass
class StoreConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]  # Any without vLLM
    loads: list[BlockSpec] = dataclasses.field(default_factory=list)
    saves: list[BlockSpec] = dataclasses.field(default_factory=list)
    # Preempted requests with step saves issued: their freed blocks must not be overwritten
    # before those saves have read them (the worker waits in ``handle_preemptions``).
    preempted: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Hit:
    start: int  # first block looked up (vLLM's local prefix hit, in blocks)
    end: int  # one past the last block the store holds without a gap


def block_keys(
    config: StoreConnectorConfig,
    vllm_config: VllmConfig,
    kv_cache_config: KVCacheConfig,
    group_index: int = 0,
) -> tuple[BlockKeys, list[str]]:
    """The key scheme of TP rank 0 and the layer names of one KV cache group, identical on
    scheduler and workers. Each key names its layer, so groups never share a key."""
    pc = vllm_config.parallel_config
    if pc.pipeline_parallel_size != 1:
        raise ConfigError("the store connector does not support pipeline parallelism yet")
    group = kv_cache_config.kv_cache_groups[group_index]
    spec = group.kv_cache_spec
    layout = layout_tag(
        str(spec.dtype),
        vllm_config.cache_config.block_size,
        int(getattr(spec, "num_kv_heads", 0) or 0),
        int(getattr(spec, "head_size", 0) or 0),
    )
    model = config.model_name or str(vllm_config.model_config.model)
    shard = Shard(False, 0, pc.tensor_parallel_size)
    return BlockKeys(config.namespace, model, layout, shard), list(group.layer_names)


def group_windows(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> list[int] | None:
    """Per KV cache group, its sliding window in tokens (0: full attention); None for one
    full-attention group (the plain layout). Other kinds of group are refused."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    groups = kv_cache_config.kv_cache_groups
    specs = [g.kv_cache_spec for g in groups]
    if len(groups) == 1 and not isinstance(specs[0], SlidingWindowSpec):
        return None
    windows = []
    for i, spec in enumerate(specs):
        if type(spec) not in (FullAttentionSpec, SlidingWindowSpec):
            raise ConfigError(
                f"KV cache group {i}: this connector handles full and sliding-window "
                f"attention groups, not {type(spec).__name__}"
            )
        if spec.block_size != vllm_config.cache_config.block_size:
            raise ConfigError(
                f"KV cache group {i}: block size {spec.block_size}, the connector needs every "
                f"group's to be {vllm_config.cache_config.block_size}"
            )
        if isinstance(spec, SlidingWindowSpec):
            # vLLM keeps extra_retained_tokens below the window too
            windows.append(max(1, spec.sliding_window + spec.extra_retained_tokens))
        else:
            windows.append(0)
    return windows


def first_held(window: int, end: int, block_size: int) -> int:
    """The first block a group of that sliding window holds when ``end`` blocks are computed
    (vLLM's sliding-window manager frees the blocks wholly before the window; 0: full)."""
    if window <= 0:
        return 0
    return max(0, end * block_size - window + 1) // block_size


class StoreScheduler:
    def __init__(
        self,
        config: StoreConnectorConfig,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        *,
        load: bool = True,
        save: bool = True,
    ) -> None:
        self.config = config
        self.block_size: int = vllm_config.cache_config.block_size
        self.tp_size: int = vllm_config.parallel_config.tensor_parallel_size
        self.keys, self.layers = block_keys(config, vllm_config, kv_cache_config)
        # several KV cache groups (None: one full-attention group): per group, its keys, layers
        # and sliding window
        self.windows = group_windows(vllm_config, kv_cache_config)
        self.groups = [
            block_keys(config, vllm_config, kv_cache_config, g)
            for g in range(len(kv_cache_config.kv_cache_groups))
        ]
        self.load = load
        self.save = save
        # Connecting happens in the background; a lookup never waits for an absent store.
        self.store = GuardedStore(
            config.client_config(config.lookup_timeout),
            cooldown=config.cooldown,
            name="store scheduler",
        )
        self._hashes: dict[str, list[str]] = {}  # request id -> chained hashes of its prompt
        self._hits: dict[str, _Hit] = {}
        # Requests a load was issued for. One load per request: if it failed, vLLM reschedules
        # the request and asks again, and the store may still list the lost blocks (a dead
        # server's objects stay listed until the master notices); a second try would fail the
        # same way, over and over.
        self._loaded: set[str] = set()
        self._loads: list[BlockSpec] = []
        self._saves: list[BlockSpec] = []
        # save_during_prefill: the requests that may be scheduled, and per request how many of
        # its blocks, from the first, were handed to the workers already (step saves issued)
        self._requests: dict[str, Request] = {}
        self._handed: dict[str, int] = {}
        self.events = StoreEventLog(self.tp_size)
        # lookup_async: batch_exists off the scheduler loop, a miss once past twice its deadline
        self.lookups = Lookups(2 * config.lookup_timeout) if config.lookup_async else None

    def _prompt_hashes(self, request: Request) -> list[str]:
        hashes = self._hashes.get(request.request_id)
        if hashes is None:
            bs = self.block_size
            hashes = prompt_block_hashes(key_token_ids(request), bs, key_inputs(request, bs))
            self._hashes[request.request_id] = hashes
        return hashes

    def _held_blocks(self, hashes: list[str], first: int = 0) -> int:
        """How many of ``hashes``, from the first, the store holds for every layer and rank;
        ``first``: the block index of ``hashes[0]``."""
        if not hashes or self.store.ready() is None:
            return 0
        if self.windows is not None:
            return self._held_group_blocks(hashes, first)
        keys = []
        for r in range(self.tp_size):
            keys.extend(self.keys.for_rank(r).keys(hashes, self.layers))
        present = self.store.call("lookup", lambda client: client.batch_exists(keys))
        if present is FAILED:
            return 0
        # keys are rank-major, then block, then layer
        n = len(hashes)
        span = len(self.layers)
        for b in range(n):
            for r in range(self.tp_size):
                at = r * n * span + b * span
                if not all(present[at : at + span]):
                    return b
        return n

    def _held_group_blocks(self, hashes: list[str], first: int) -> int:
        """Several KV cache groups: the most of ``hashes`` whose end every group can serve."""
        assert self.windows is not None
        keys = []
        for r in range(self.tp_size):
            for keys_g, layers in self.groups:
                keys.extend(keys_g.for_rank(r).keys(hashes, layers))
        present = self.store.call("lookup", lambda client: client.batch_exists(keys))
        if present is FAILED:
            return 0
        n = len(hashes)
        held = [[True] * n for _ in self.groups]  # held[g][b]: every layer of every rank
        at = 0
        for _ in range(self.tp_size):
            for g, (_, layers) in enumerate(self.groups):
                span = len(layers)
                for b in range(n):
                    held[g][b] = held[g][b] and all(present[at : at + span])
                    at += span
        for k in range(n, 0, -1):
            end = first + k
            if all(
                all(
                    held[g][b - first]
                    for b in range(max(first, first_held(w, end, self.block_size)), end)
                )
                for g, w in enumerate(self.windows)
            ):
                return k
        return 0

    # -- load --------------------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        rid = request.request_id
        if self.save and self.config.save_during_prefill:
            self._requests[rid] = request  # step saves
        if not self.load or rid in self._loaded:
            return 0, False
        start = num_computed_tokens // self.block_size
        hit = self._hits.get(rid)
        if hit is None or start < hit.start:  # asked again with less cached locally: look again
            hashes = self._prompt_hashes(request)
            if start >= len(hashes) or self.store.ready() is None:
                held = 0
            elif self.lookups is None:
                held = self._held_blocks(hashes[start:], start)
            else:
                got = self.lookups.poll(
                    rid, start, lambda: self._held_blocks(hashes[start:], start)
                )
                if got is PENDING:
                    return None, False  # vLLM skips the request this step, asks again next
                assert isinstance(got, int)
                held = got
            hit = _Hit(start, start + held)
            self._hits[rid] = hit
        count = hit.end * self.block_size - num_computed_tokens
        return (count, self.config.load_async) if count > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if num_external_tokens <= 0:
            return  # nothing to load (or the second call, after the load)
        rid = request.request_id
        hit = self._hits.pop(rid, None)
        hashes = self._hashes.get(rid, [])
        self._loaded.add(rid)
        if self.windows is not None:
            self._load_groups(rid, hit, hashes, blocks, num_external_tokens)
            return
        (block_ids,) = blocks.get_block_ids()  # one KV cache group (checked at start)
        if hit is None:
            end = min(len(block_ids), -(-num_external_tokens // self.block_size))
            self._loads.append(BlockSpec(rid, list(block_ids[:end]), [], "no lookup recorded"))
            return
        local = hit.end * self.block_size - num_external_tokens
        start, end = local // self.block_size, hit.end
        if local < 0 or local % self.block_size or len(block_ids) < end or len(hashes) < end:
            # Never expected from vLLM's scheduler; fail safe: recompute the whole load.
            end = min(end, len(block_ids))
            self._loads.append(
                BlockSpec(
                    rid,
                    list(block_ids[max(0, start) : end]),
                    [],
                    f"unexpected allocation (local hit {local}, {len(block_ids)} blocks)",
                )
            )
            return
        self._loads.append(BlockSpec(rid, list(block_ids[start:end]), hashes[start:end]))
        if rid in self._requests:  # loaded from the store: nothing there to save again
            self._handed[rid] = max(self._handed.get(rid, 0), end)

    def _load_groups(
        self,
        rid: str,
        hit: _Hit | None,
        hashes: list[str],
        blocks: KVCacheBlocks,
        num_external_tokens: int,
    ) -> None:
        """Several KV cache groups: load each group's allocated blocks of the hit."""
        ids = [[0 if b.is_null else b.block_id for b in g] for g in blocks.blocks]
        end = -(-num_external_tokens // self.block_size) if hit is None else hit.end
        local = end * self.block_size - num_external_tokens
        start = max(0, local // self.block_size)
        groups = [g[start:end] for g in ids]
        flat = [b for g in groups for b in g if b]
        if hit is None or local < 0 or local % self.block_size or len(hashes) < end:
            why = "no lookup recorded" if hit is None else f"unexpected allocation (local {local})"
            self._loads.append(BlockSpec(rid, flat, [], why))
            return
        if any(len(g) < end - start for g in groups):
            self._loads.append(BlockSpec(rid, flat, [], "fewer blocks allocated than the hit"))
            return
        self._loads.append(BlockSpec(rid, flat, hashes[start:end], groups=groups))
        if rid in self._requests:  # loaded from the store: nothing there to save again
            self._handed[rid] = max(self._handed.get(rid, 0), end)

    # -- both --------------------------------------------------------------------------------
    def build_connector_meta(self, out: object = None) -> StoreConnectorMetadata:
        if self._requests and out is not None:
            step_saves(self, out)
        meta = StoreConnectorMetadata(loads=self._loads, saves=self._saves)
        self._loads, self._saves = [], []
        preempted = getattr(out, "preempted_req_ids", None)
        if preempted:
            meta.preempted = [r for r in preempted if self._handed.get(r, 0) > 0]
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int] | tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``block_ids``: the request's blocks, or with several KV cache groups (vLLM's
        ``request_finished_all_groups``) each group's, 0 where a group holds none."""
        from vllm.v1.request import RequestStatus

        rid = request.request_id
        self._hits.pop(rid, None)
        self._loaded.discard(rid)
        if self.lookups is not None:
            self.lookups.forget(rid)
        hashes = self._hashes.pop(rid, None)
        self._requests.pop(rid, None)
        handed = self._handed.pop(rid, 0)
        if not self.save or request.status not in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        ):
            # Aborted or failed: its KV past the handed blocks may be incomplete. Step saves
            # already issued may still read its blocks: an empty save, queued behind them on
            # the worker, reports the request done once they have.
            if handed <= 0:
                return False, None
            self._saves.append(BlockSpec(rid, [], [], step=False))
            return True, None
        if hashes is None:
            hashes = self._prompt_hashes(request)
            self._hashes.pop(rid, None)
        computed = min(request.num_computed_tokens, request.num_prompt_tokens)
        per_group = block_ids if isinstance(block_ids, tuple) else (block_ids,)
        n = min(len(hashes), computed // self.block_size, *(len(g) for g in per_group))
        if handed > 0:  # step saves issued: the rest, queued behind them (maybe none)
            first = min(handed, max(n, 0))
            self._saves.append(self._rest_spec(request, per_group, hashes, first, n))
            return True, None
        if n <= 0 or self.store.ready() is None:
            return False, None
        if self.windows is None:
            self._saves.append(self._save_spec(request, list(per_group[0][:n]), hashes[:n]))
            return True, None
        groups = [list(g[:n]) for g in per_group]
        spec = self._save_spec(request, [b for g in groups for b in g if b], hashes[:n])
        spec.groups = groups
        self._saves.append(spec)
        return True, None  # vLLM keeps the blocks until the workers report the save done

    def _rest_spec(
        self,
        request: Request,
        per_group: tuple[list[int], ...] | list[list[int]],
        hashes: list[str],
        first: int,
        end: int,
    ) -> BlockSpec:
        """The save of the prompt's blocks ``first`` to ``end`` (exclusive), after the blocks
        before ``first`` were handed over: ``per_group`` is each KV cache group's block list
        (one list with one group)."""
        if self.windows is None:
            spec = self._save_spec(request, list(per_group[0][first:end]), hashes[first:end], first)
        else:
            groups = [list(g[first:end]) for g in per_group]
            flat = [b for g in groups for b in g if b]  # 0: vLLM's null block, none held
            spec = self._save_spec(request, flat, hashes[first:end], first)
            spec.groups = groups
        spec.parent = hashes[first - 1] if first else None
        return spec

    def _save_spec(
        self, request: Request, block_ids: list[int], hashes: list[str], first: int = 0
    ) -> BlockSpec:
        """The save of ``block_ids``, the prompt's blocks from its ``first`` on."""
        from vllm.v1.core.kv_cache_utils import (
            generate_block_hash_extra_keys,
            to_event_extra_keys,
        )

        bs, extra, mm = self.block_size, [], 0
        for b in range(first, first + len(hashes)):
            keys, mm = generate_block_hash_extra_keys(request, b * bs, (b + 1) * bs, mm)
            extra.append(keys)
        lora = getattr(request, "lora_request", None)
        return BlockSpec(
            request.request_id,
            block_ids,
            hashes,
            token_ids=list(key_token_ids(request)[first * bs : (first + len(hashes)) * bs]),
            extra_keys=to_event_extra_keys(extra),
            lora_name=None if lora is None else str(lora.lora_name),
        )

    # -- KV events ---------------------------------------------------------------------------
    def add_events(self, events: list[Any]) -> None:
        self.events.add(events)

    def take_events(self) -> list[Any]:
        return self.events.take()

    def shutdown(self) -> None:
        if self.lookups is not None:
            self.lookups.close()
        self.store.close()
