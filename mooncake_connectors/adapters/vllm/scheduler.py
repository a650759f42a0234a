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

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any

from .config import PDConfig
from .metadata import (
    PDConnectorMetadata,
    PDHandshake,
    PushRecvSpec,
    PushSendStep,
    RecvSpec,
    RemotePrefill,
    RemotePush,
    prompt_hash,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PDScheduler:
    def __init__(self, config: PDConfig, vllm_config: VllmConfig, engine_id: str) -> None:
        self.config = config
        self.engine_id = engine_id
        self.block_size: int = vllm_config.cache_config.block_size
        self.tp_size: int = vllm_config.parallel_config.tensor_parallel_size
        self.side_channels: list[str] | None = None  # per TP rank, from the workers' handshake
        self._recv: list[RecvSpec] = []
        self._send: dict[str, float] = {}
        self._matched: dict[str, int] = {}  # request id -> loadable tokens (memo)
        self._push_recv: list[PushRecvSpec] = []
        # prefill side: request id -> its push step state (blocks so far, blocks announced)
        self._pushing: dict[str, PushSendStep] = {}
        self._push_out: list[PushSendStep] = []

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
    def _loadable_tokens(self, request: Request, remote: RemotePrefill) -> int:
        """Prompt tokens whose KV the prefill holds for exactly this prompt (0: none usable)."""
        known = self._matched.get(request.request_id)
        if known is not None:
            return known
        n = 0
        prompt = request.prompt_token_ids
        if (
            prompt is not None
            and 0 < remote.num_tokens <= len(prompt)
            and len(remote.block_ids) >= _cdiv(remote.num_tokens, self.block_size)
        ):
            if prompt_hash(prompt[: remote.num_tokens]) == remote.prompt_hash:
                n = remote.num_tokens
            else:
                log.warning(
                    "request %s: prefill KV is for other prompt tokens; recomputing",
                    request.request_id,
                )
        self._matched[request.request_id] = n
        return n

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        if params.get("push_id"):
            count = self._pushable_tokens(request) - num_computed_tokens
            return (count, True) if count > 0 else (0, False)
        remote = RemotePrefill.parse(params)
        if remote is None:
            return 0, False
        count = self._loadable_tokens(request, remote) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def _pushable_tokens(self, request: Request) -> int:
        """Prompt tokens a push will deliver (0: this request computes its prompt itself)."""
        known = self._matched.get(request.request_id)
        if known is not None:
            return known
        n = 0
        remote = RemotePush.parse(request.kv_transfer_params)
        prompt = request.prompt_token_ids
        if remote is None:
            log.warning("request %s: push parameters not understood", request.request_id)
        elif not self.config.accept_push:
            log.warning(
                "request %s asks for a layer-wise push but this instance does not accept pushes "
                "(kv_connector_extra_config accept_push); computing the prompt",
                request.request_id,
            )
        elif remote.tp_size != self.tp_size:
            log.warning(
                "request %s: push needs equal TP sizes (prefill %d, decode %d); computing the "
                "prompt",
                request.request_id,
                remote.tp_size,
                self.tp_size,
            )
        elif prompt:
            n = len(prompt)
        self._matched[request.request_id] = n
        return n

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        if not params:
            return
        if params.get("do_remote_decode") and params.get("push_id"):
            self._start_push(request)
            return
        if not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # one transfer per request, even if rescheduled
        if params.get("push_id"):
            self._push_target(request, blocks, num_external_tokens)
            return
        remote = RemotePrefill.parse(params)
        if remote is None:
            log.warning(
                "request %s: kv_transfer_params not understood: %s", request.request_id, params
            )
            return
        n = self._matched.pop(request.request_id, 0)
        if num_external_tokens <= 0 or n <= 0:
            # A full local prefix hit, or unusable remote KV: only let the prefill free its blocks.
            self._recv.append(RecvSpec(request.request_id, [], [], remote))
            return
        local_hit = n - num_external_tokens
        end = _cdiv(n, self.block_size)
        (block_ids,) = blocks.get_block_ids()  # one KV cache group (no hybrid allocator)
        spec = RecvSpec(request.request_id, [], [], remote)
        if local_hit < 0 or local_hit % self.block_size or len(block_ids) < end:
            # Never expected from vLLM's scheduler; fail safe by recomputing the whole load.
            spec.local_block_ids = list(block_ids[:end])
            spec.error = f"unexpected allocation (local hit {local_hit}, {len(block_ids)} blocks)"
        else:
            start = local_hit // self.block_size
            spec.local_block_ids = list(block_ids[start:end])
            spec.remote_block_ids = list(remote.block_ids[start:end])
        self._recv.append(spec)

    def _push_target(self, request: Request, blocks: KVCacheBlocks, num_external: int) -> None:
        remote = RemotePush.parse(request.kv_transfer_params)
        n = self._matched.pop(request.request_id, 0)
        if remote is None:
            return
        spec = PushRecvSpec(request.request_id, [], 0, n, "", remote)
        prompt = request.prompt_token_ids
        if num_external > 0 and n > 0 and prompt is not None:
            local_hit = n - num_external
            end = _cdiv(n, self.block_size)
            (block_ids,) = blocks.get_block_ids()
            spec.prompt_hash = prompt_hash(prompt[:n])
            if local_hit < 0 or local_hit % self.block_size or len(block_ids) < end:
                spec.local_block_ids = list(block_ids[:end])
                spec.error = f"unexpected allocation (local hit {local_hit}, {len(block_ids)})"
            else:
                spec.first_block = local_hit // self.block_size
                spec.local_block_ids = list(block_ids[spec.first_block : end])
        self._push_recv.append(spec)  # empty blocks: the prefill need not push, only free

    # -- prefill side of a push --------------------------------------------------------------
    def _start_push(self, request: Request) -> None:
        # Its blocks come from each step's scheduler output (under vLLM's MultiConnector this
        # connector may be handed no blocks here).
        prompt = request.prompt_token_ids
        push_id = str((request.kv_transfer_params or {}).get("push_id", ""))
        if prompt is None or not push_id or len(push_id) > 128:
            return
        self._pushing[request.request_id] = PushSendStep(
            request.request_id, push_id, [], 0, len(prompt), prompt_hash(prompt)
        )

    def _push_steps(self, out: SchedulerOutput) -> None:
        """Which blocks of each pushing request are complete after this step's forward."""
        if not self._pushing:
            return
        progress: dict[str, tuple[list[int] | None, int, bool]] = {}
        for new in out.scheduled_new_reqs:
            if new.req_id in self._pushing:
                progress[new.req_id] = (list(new.block_ids[0]), new.num_computed_tokens, True)
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            if rid in self._pushing:
                added = cached.new_block_ids[i]
                progress[rid] = (
                    None if added is None else list(added[0]),
                    cached.num_computed_tokens[i],
                    rid in cached.resumed_req_ids,
                )
        for rid, (block_ids, computed, replace) in progress.items():
            st = self._pushing[rid]
            if block_ids is not None:
                st.block_ids = block_ids if replace else st.block_ids + block_ids
            done = computed + out.num_scheduled_tokens.get(rid, 0)
            final = done >= st.num_tokens
            ready = _cdiv(st.num_tokens, self.block_size) if final else done // self.block_size
            if ready > st.ready or final:
                st.ready = min(ready, len(st.block_ids))
                st.final = final
                self._push_out.append(dataclasses.replace(st, block_ids=list(st.block_ids)))
            if final:
                del self._pushing[rid]

    # -- both --------------------------------------------------------------------------------
    def build_connector_meta(self, out: SchedulerOutput | None = None) -> PDConnectorMetadata:
        if out is not None:
            self._push_steps(out)
        meta = PDConnectorMetadata(
            recv=self._recv, send=self._send, push_recv=self._push_recv, push_send=self._push_out
        )
        self._recv, self._send, self._push_recv, self._push_out = [], {}, [], []
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        self._matched.pop(request.request_id, None)
        st = self._pushing.pop(request.request_id, None)
        if st is not None:  # ended before its prompt was complete: the push ends with it
            self._push_out.append(dataclasses.replace(st, final=True, aborted=True))
        if not params:
            return False, None
        if params.get("do_remote_prefill"):
            # Decode side, finished before it was ever scheduled (aborted): free the prefill's
            # blocks now instead of at the end of their lease.
            params["do_remote_prefill"] = False
            if params.get("push_id"):
                pushed = RemotePush.parse(params)
                if pushed is not None:
                    self._push_recv.append(PushRecvSpec(request.request_id, [], 0, 0, "", pushed))
                return False, None
            remote = RemotePrefill.parse(params)
            if remote is not None:
                self._recv.append(RecvSpec(request.request_id, [], [], remote))
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        # Prefill side.
        if request.status not in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        ):
            return False, None  # aborted or failed: nothing to hand over
        prompt = request.prompt_token_ids
        num_tokens = min(request.num_computed_tokens, request.num_prompt_tokens)
        if not block_ids or prompt is None or num_tokens <= 0:
            return False, None
        if self.side_channels is None:
            log.warning(
                "no worker handshake yet; request %s is not handed over", request.request_id
            )
            return False, None
        blocks = list(block_ids[: _cdiv(num_tokens, self.block_size)])
        self._send[request.request_id] = self.config.kv_lease
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id,
            "remote_block_ids": blocks,
            "remote_num_tokens": num_tokens,
            "remote_prompt_hash": prompt_hash(prompt[:num_tokens]),
            "remote_side_channels": list(self.side_channels),
            "remote_tp_size": self.tp_size,
            # The worker's lease starts a little later than this, so decode errs on the safe side.
            "remote_expires_at": time.time() + self.config.kv_lease,
        }
