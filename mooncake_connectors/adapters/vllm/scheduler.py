"""Scheduler-side bookkeeping of the PD connector (runs in vLLM's engine-core process).

Prefill side: a request sent with ``{"do_remote_decode": true}`` finishes normally; its blocks are
kept (``request_finished`` returns True) and its kv_transfer_params say where they are. The worker
frees them when the decode side reports it has read them, or when the lease ends.

Decode side: a request whose kv_transfer_params say ``do_remote_prefill`` is offered as an
asynchronous external hit for the prompt tokens the prefill computed (less what the local prefix
cache already has); once vLLM allocated blocks for them, the worker is told which remote blocks
go into which local ones.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from .config import PDConfig
from .metadata import PDConnectorMetadata, PDHandshake, RecvSpec, RemotePrefill, prompt_hash

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
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
        remote = RemotePrefill.parse(params)
        if remote is None:
            return 0, False
        count = self._loadable_tokens(request, remote) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # one transfer per request, even if rescheduled
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

    # -- both --------------------------------------------------------------------------------
    def build_connector_meta(self) -> PDConnectorMetadata:
        meta = PDConnectorMetadata(recv=self._recv, send=self._send)
        self._recv, self._send = [], {}
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        self._matched.pop(request.request_id, None)
        if not params:
            return False, None
        if params.get("do_remote_prefill"):
            # Decode side, finished before it was ever scheduled (aborted): free the prefill's
            # blocks now instead of at the end of their lease.
            params["do_remote_prefill"] = False
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
