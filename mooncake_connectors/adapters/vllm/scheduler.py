"""Scheduler-side bookkeeping of the PD connector (runs in vLLM's engine-core process).

Prefill side: a request sent with ``{"do_remote_decode": true}`` finishes normally; its blocks are
kept (``request_finished`` returns True) and its kv_transfer_params say where they are. The worker
frees them when the decode side reports it has read them, or when the lease ends.

Decode side: a request whose kv_transfer_params say ``do_remote_prefill`` is offered as an
asynchronous external hit for the prompt tokens the prefill computed (less what the local prefix
cache already has); once vLLM allocated blocks for them, the worker is told which remote blocks
go into which local ones.

Layer-wise push (both legs at once, ``push_id`` in both requests' params): the decode side offers
the whole prompt as an asynchronous hit and, once blocks are allocated, has its worker send them
to the prefill worker as a push target; the prefill side tells its workers every step which of the
request's blocks are complete after that step's forward, so they write each layer as it is done.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, TypeVar

from ...errors import ProtocolError
from ...pd import params as pdp
from ...pd.params import PullParams, PushParams
from ...pd.plan import (
    PushProgress,
    PushRecvSpec,
    RecvSpec,
    handover,
    loadable_tokens,
    push_recv_spec,
    recv_spec,
    recv_spec_groups,
)
from .config import PDConfig
from .metadata import PDConnectorMetadata, PDHandshake
from .store_inputs import key_inputs
from .store_scheduler import group_windows

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


_P = TypeVar("_P", PullParams, PushParams)


def _decode(
    params: dict[str, Any] | None, kind: type[_P], request_id: str, warn: bool
) -> _P | None:
    """The request's pull or push params; None when they are not ours (it then simply
    recomputes). ``warn``: say why, once per request (its params are read more than once)."""
    try:
        return pdp.decode(params, kind)
    except ProtocolError as exc:
        if warn:
            log.warning("request %s: %s; computing the prompt", request_id, exc)
        return None


def _block_ids(blocks: KVCacheBlocks, num_external: int) -> list[int]:
    if num_external <= 0:
        return []  # nothing to load into (and the blocks may not be ours to read)
    (block_ids,) = blocks.get_block_ids()  # one KV cache group (no hybrid allocator)
    return list(block_ids)


def kv_groups(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None
) -> tuple[list[list[str]], list[str]] | None:
    """Several KV cache groups (vLLM's hybrid KV cache manager): each group's layer names and
    kind ("full", "sliding:<tokens kept>"); None for one full-attention group. Groups other
    than full and sliding-window attention raise ConfigError (:func:`group_windows`)."""
    if kv_cache_config is None:
        return None
    windows = group_windows(vllm_config, kv_cache_config)
    if windows is None:
        return None
    names = [list(g.layer_names) for g in kv_cache_config.kv_cache_groups]
    return names, [f"sliding:{w}" if w else "full" for w in windows]


def block_bytes(kv_cache_config: KVCacheConfig | None) -> int:
    """KV bytes one block of every layer holds on one worker (0: unknown)."""
    if kv_cache_config is None:
        return 0
    try:
        return sum(
            int(g.kv_cache_spec.page_size_bytes) * len(g.layer_names)
            for g in kv_cache_config.kv_cache_groups
        )
    except (AttributeError, TypeError, ValueError):
        return 0


class PDScheduler:
    def __init__(
        self,
        config: PDConfig,
        vllm_config: VllmConfig,
        engine_id: str,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        self.config = config
        self.engine_id = engine_id
        groups = kv_groups(vllm_config, kv_cache_config)
        self.num_groups = 1 if groups is None else len(groups[0])
        self.block_size: int = vllm_config.cache_config.block_size
        self.tp_size: int = vllm_config.parallel_config.tensor_parallel_size
        self.side_channels: list[str] | None = None  # per TP rank, from the workers' handshake
        self._recv: list[RecvSpec] = []
        self._send: dict[str, float] = {}
        self._matched: dict[str, int] = {}  # request id -> loadable tokens (memo)
        self._block_bytes = block_bytes(kv_cache_config)
        self._sync: set[str] = set()  # offered as a hit loaded inside the scheduling step
        self._push_recv: list[PushRecvSpec] = []
        self._pushing = PushProgress(self.block_size)  # prefill side

    # -- handshake ---------------------------------------------------------------------------
    def set_handshakes(self, handshakes: dict[int, Any]) -> None:
        channels: dict[int, str] = {}
        for rank, hs in handshakes.items():
            if not isinstance(hs, PDHandshake):
                raise TypeError(f"expected PDHandshake from TP rank {rank}, got {type(hs)}")
            channels[rank] = hs.side_channel
        if sorted(channels) != list(range(self.tp_size)):
            raise ValueError(
                f"handshakes from TP ranks {sorted(channels)}, need 0..{self.tp_size - 1}"
            )
        self.side_channels = [channels[r] for r in range(self.tp_size)]

    # -- decode side -------------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not pdp.wants_remote_prefill(params):
            return 0, False
        rid = request.request_id
        n = self._matched.get(rid)
        if n is None:
            n = self._pushable_tokens(request) if pdp.is_push(params) else self._loadable(request)
            self._matched[rid] = n
            log.debug("timeline %s scheduler_sees %d", rid, n)
        count = n - num_computed_tokens
        if count <= 0:
            return 0, False
        if not pdp.is_push(params) and self._loads_inline(count):
            # vLLM computes at least one token in the step that schedules the request: the
            # last prompt token's KV is computed here, not read (its block still is).
            last = request.num_prompt_tokens - 1
            if n > last:
                n = self._matched[rid] = last
                count = n - num_computed_tokens
            if count > 0:
                self._sync.add(rid)
                return count, False
            self._sync.discard(rid)
            return 0, False
        self._sync.discard(rid)
        return count, True

    def _loads_inline(self, tokens: int) -> bool:
        """Small hand-overs are read inside the step that schedules the request: an
        asynchronous load costs two engine steps more (one reports it done, the next schedules
        the request), a small read less than that, though it holds up the step's other
        requests for as long as it takes."""
        blocks = -(-tokens // self.block_size)
        size = blocks * self._block_bytes
        return 0 < size <= self.config.sync_load_max_bytes

    def _loadable(self, request: Request) -> int:
        remote = _decode(request.kv_transfer_params, PullParams, request.request_id, warn=False)
        if remote is None:
            return 0
        return loadable_tokens(
            request.request_id,
            request.prompt_token_ids,
            remote,
            self.block_size,
            self.num_groups,
            key_inputs(request, self.block_size),
        )

    def _pushable_tokens(self, request: Request) -> int:
        """Prompt tokens a push will deliver (0: this request computes its prompt itself)."""
        remote = _decode(request.kv_transfer_params, PushParams, request.request_id, warn=True)
        prompt = request.prompt_token_ids
        if remote is None:
            return 0
        if self.num_groups > 1:
            log.warning(
                "request %s asks for a layer-wise push, which does not handle several KV cache "
                "groups yet (hybrid KV cache manager); computing the prompt",
                request.request_id,
            )
            return 0
        if not self.config.accept_push:
            log.warning(
                "request %s asks for a layer-wise push but this instance does not accept pushes "
                "(kv_connector_extra_config accept_push); computing the prompt",
                request.request_id,
            )
            return 0
        if remote.tp_size != self.tp_size:
            log.warning(
                "request %s: push needs equal TP sizes (prefill %d, decode %d); computing the "
                "prompt",
                request.request_id,
                remote.tp_size,
                self.tp_size,
            )
            return 0
        return len(prompt) if prompt else 0

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        rid = request.request_id
        if params is None:
            return
        if pdp.wants_remote_decode(params) and pdp.is_push(params):
            self._start_push(request)
            return
        if not pdp.wants_remote_prefill(params):
            return
        pdp.release(params)  # one transfer per request, even if rescheduled
        n = self._matched.pop(rid, 0)
        if pdp.is_push(params):
            pushed = _decode(params, PushParams, rid, warn=False)
            if pushed is not None:
                self._push_recv.append(
                    push_recv_spec(
                        rid,
                        pushed,
                        request.prompt_token_ids,
                        n,
                        num_external_tokens,
                        _block_ids(blocks, num_external_tokens),
                        self.block_size,
                        key_inputs(request, self.block_size),
                    )
                )
            return
        remote = _decode(params, PullParams, rid, warn=True)
        if remote is not None:
            log.debug("timeline %s allocated %d", rid, num_external_tokens)
            if self.num_groups > 1:
                # vLLM's null block (id 0) stands where a sliding-window group needs no block
                groups = blocks.get_block_ids() if num_external_tokens > 0 else ()
                spec = recv_spec_groups(
                    rid, remote, n, num_external_tokens, groups, self.block_size
                )
            else:
                block_ids = _block_ids(blocks, num_external_tokens)
                spec = recv_spec(rid, remote, n, num_external_tokens, block_ids, self.block_size)
            spec.sync = rid in self._sync and num_external_tokens > 0
            self._recv.append(spec)
        self._sync.discard(rid)

    # -- prefill side of a push --------------------------------------------------------------
    def _start_push(self, request: Request) -> None:
        # Its blocks come from each step's scheduler output (under vLLM's MultiConnector this
        # connector may be handed no blocks here).
        prompt = request.prompt_token_ids
        try:
            leg = pdp.decode(request.kv_transfer_params, pdp.PrefillLeg)
        except ProtocolError as exc:
            log.warning("request %s: %s", request.request_id, exc)
            return
        if leg.push_id is not None and self.num_groups > 1:
            log.warning(
                "request %s: no layer-wise push with several KV cache groups; its KV is handed "
                "over for a pull when it finishes",
                request.request_id,
            )
            return
        if prompt is not None and leg.push_id is not None:
            inputs = key_inputs(request, self.block_size)
            self._pushing.start(request.request_id, leg.push_id, prompt, inputs)

    def _push_steps(self, out: SchedulerOutput) -> None:
        """Tell the progress of each pushing request scheduled in this step."""
        if not self._pushing:
            return
        for new in out.scheduled_new_reqs:
            if new.req_id in self._pushing:
                scheduled = out.num_scheduled_tokens.get(new.req_id, 0)
                self._pushing.advance(
                    new.req_id, list(new.block_ids[0]), True, new.num_computed_tokens, scheduled
                )
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            if rid in self._pushing:
                added = cached.new_block_ids[i]
                self._pushing.advance(
                    rid,
                    None if added is None else list(added[0]),
                    rid in cached.resumed_req_ids,
                    cached.num_computed_tokens[i],
                    out.num_scheduled_tokens.get(rid, 0),
                )

    # -- both --------------------------------------------------------------------------------
    def build_connector_meta(self, out: SchedulerOutput | None = None) -> PDConnectorMetadata:
        if out is not None:
            self._push_steps(out)
            if log.isEnabledFor(logging.DEBUG):
                for new in out.scheduled_new_reqs:
                    log.debug("timeline %s scheduled", new.req_id)
        meta = PDConnectorMetadata(
            recv=self._recv,
            send=self._send,
            push_recv=self._push_recv,
            push_send=self._pushing.take(),
        )
        self._recv, self._send, self._push_recv = [], {}, []
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int] | tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``block_ids``: the request's blocks (one KV cache group) or each group's
        (``request_finished_all_groups``)."""
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        rid = request.request_id
        self._matched.pop(rid, None)
        self._sync.discard(rid)
        self._pushing.end(rid)
        if not params:
            return False, None
        if pdp.wants_remote_prefill(params):
            # Decode side, finished before it was ever scheduled (aborted): free the prefill's
            # blocks now instead of at the end of their lease.
            pdp.release(params)
            if pdp.is_push(params):
                pushed = _decode(params, PushParams, rid, warn=False)
                if pushed is not None:
                    self._push_recv.append(PushRecvSpec(rid, [], 0, 0, "", pushed))
            else:
                remote = _decode(params, PullParams, rid, warn=False)
                if remote is not None:
                    self._recv.append(RecvSpec(rid, [], [], remote))
            return False, None
        if not pdp.wants_remote_decode(params):
            return False, None
        # Prefill side.
        if request.status not in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        ):
            return False, None  # aborted or failed: nothing to hand over
        prompt = request.prompt_token_ids
        num_tokens = min(request.num_computed_tokens, request.num_prompt_tokens)
        groups = list(block_ids) if isinstance(block_ids, tuple) else [block_ids]
        if len(groups) != self.num_groups:
            log.warning(
                "request %s: blocks of %d KV cache groups, expected %d; not handed over",
                rid,
                len(groups),
                self.num_groups,
            )
            return False, None
        if not any(groups) or prompt is None or num_tokens <= 0:
            return False, None
        if self.side_channels is None:
            log.warning("no worker handshake yet; request %s is not handed over", rid)
            return False, None
        lease = self.config.kv_lease
        self._send[rid] = lease
        log.debug("timeline %s handover %d", rid, num_tokens)
        out = handover(
            self.engine_id,
            rid,
            prompt,
            num_tokens,
            groups,
            self.side_channels,
            self.block_size,
            lease,
            key_inputs(request, self.block_size),
        )
        return True, pdp.encode(out)
