"""What the scheduler side tells its workers each step, and the block arithmetic behind it.

The scheduler side of an engine decides, per request, which local blocks a load fills from which
prefill blocks (:class:`RecvSpec`), where a push goes (:class:`PushRecvSpec`), and which of a
pushing prefill request's blocks are complete after a step (:class:`PushSendStep`); a
:class:`StepPlan` carries one step's worth to every TP rank. The functions here take the engine's
facts as plain values (token ids, block ids, ``block_size``), so the engine adapter only reads
them off its own request and block objects.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence

from ..kv_keys import PLAIN, KeyInputs, identity_digest
from .params import PullParams, PushParams, prompt_hash

log = logging.getLogger(__name__)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass
class RecvSpec:
    """Read ``remote_block_ids`` of a prefill request into ``local_block_ids`` (same order).

    Empty ``local_block_ids``: nothing to read, only tell the prefill to free its blocks (the
    request was aborted, or the decode instance already had the whole prompt cached).
    ``error``: the scheduler side already knows the load cannot happen; the worker reports the
    local blocks as failed so the engine recomputes them.
    """

    request_id: str
    local_block_ids: list[int]
    remote_block_ids: list[int]
    remote: PullParams
    error: str | None = None
    # Several KV cache groups: per group, (local, remote) block ids to copy for that group's
    # layers only (null blocks left out); ``local_block_ids`` then lists every group's.
    groups: list[tuple[list[int], list[int]]] | None = None
    # Read inside the step that schedules the request: the worker waits for it before the
    # forward and does not report it as received (vLLM never parked the request for it).
    sync: bool = False


@dataclasses.dataclass
class PushRecvSpec:
    """Decode side: ask the prefill to write its blocks ``first_block…`` into ``local_block_ids``.

    Empty ``local_block_ids``: nothing to receive, the prefill may free its blocks.
    """

    request_id: str
    local_block_ids: list[int]
    first_block: int
    num_tokens: int
    prompt_hash: str
    remote: PushParams
    error: str | None = None


@dataclasses.dataclass
class PushSendStep:
    """Prefill side, one step: after this step's forward the request's blocks ``[0, ready)``
    hold their final KV in every layer; ``final``: the prompt is complete (``aborted``: the
    request ended without it)."""

    request_id: str
    push_id: str
    block_ids: list[int]
    ready: int
    num_tokens: int
    prompt_hash: str
    final: bool = False
    aborted: bool = False


@dataclasses.dataclass
class StepPlan:
    """One step's instructions from the scheduler side to every worker."""

    recv: list[RecvSpec] = dataclasses.field(default_factory=list)
    send: dict[str, float] = dataclasses.field(default_factory=dict)  # request id -> lease (s)
    push_recv: list[PushRecvSpec] = dataclasses.field(default_factory=list)
    push_send: list[PushSendStep] = dataclasses.field(default_factory=list)


NULL_BLOCK = 0  # vLLM's null block: a sliding-window group's place holder for a freed block


def loadable_tokens(
    request_id: str,
    prompt: Sequence[int] | None,
    remote: PullParams,
    block_size: int,
    num_groups: int = 1,
    inputs: KeyInputs = PLAIN,
) -> int:
    """Prompt tokens whose KV the prefill holds for exactly this prompt and ``inputs`` (what
    else the KV depends on: LoRA adapter, multimodal inputs, ``cache_salt``; 0: none usable)."""
    groups = remote.groups()
    if len(groups) != num_groups:
        log.warning(
            "request %s: the prefill sent blocks of %d KV cache groups, this instance has %d "
            "(hybrid KV cache manager on one side only?); recomputing",
            request_id,
            len(groups),
            num_groups,
        )
        return 0
    if (
        prompt is None
        or not 0 < remote.num_tokens <= len(prompt)
        or any(len(g) < cdiv(remote.num_tokens, block_size) for g in groups)
    ):
        return 0
    n = remote.num_tokens
    if prompt_hash(prompt[:n], identity_digest(inputs, n)) != remote.prompt_hash:
        log.warning(
            "request %s: the prefill's KV is for other prompt tokens or other inputs (LoRA "
            "adapter, images or audio, cache_salt); recomputing",
            request_id,
        )
        return 0
    return remote.num_tokens


def _window(
    matched: int, num_external: int, block_ids: Sequence[int], block_size: int
) -> tuple[int, int, str | None]:
    """The blocks ``[start, end)`` an external hit of ``num_external`` of ``matched`` tokens
    fills, or an error when the allocation is not what the engine's scheduler should give."""
    local_hit = matched - num_external
    end = cdiv(matched, block_size)
    if local_hit < 0 or local_hit % block_size or len(block_ids) < end:
        return 0, end, f"unexpected allocation (local hit {local_hit}, {len(block_ids)} blocks)"
    return local_hit // block_size, end, None


def recv_spec(
    request_id: str,
    remote: PullParams,
    matched: int,
    num_external: int,
    block_ids: Sequence[int],
    block_size: int,
) -> RecvSpec:
    """The load for a decode request that was allocated ``block_ids`` for ``num_external`` of
    its ``matched`` loadable tokens (the rest hit the local prefix cache)."""
    spec = RecvSpec(request_id, [], [], remote)
    if num_external <= 0 or matched <= 0:
        return spec  # a full local prefix hit, or unusable remote KV: only release the prefill
    start, end, error = _window(matched, num_external, block_ids, block_size)
    spec.local_block_ids = list(block_ids[start:end])
    if error is not None:  # fail safe: the whole load is recomputed
        spec.error = error
    else:
        assert remote.block_ids is not None
        spec.remote_block_ids = list(remote.block_ids[start:end])
    return spec


def recv_spec_groups(
    request_id: str,
    remote: PullParams,
    matched: int,
    num_external: int,
    groups: Sequence[Sequence[int]],
    block_size: int,
) -> RecvSpec:
    """:func:`recv_spec` for several KV cache groups: ``groups`` are each group's allocated
    block ids (:data:`NULL_BLOCK` where vLLM put its null block). A block that is null on the
    decode side is not read; one the decode needs but the prefill already freed (null there)
    fails the load."""
    spec = RecvSpec(request_id, [], [], remote)
    if num_external <= 0 or matched <= 0:
        return spec
    theirs = remote.groups()
    pairs: list[tuple[list[int], list[int]]] = []
    for g, (local, rem) in enumerate(zip(groups, theirs, strict=True)):
        start, end, error = _window(matched, num_external, local, block_size)
        lo, ro = [], []
        for i in range(start, min(end, len(local), len(rem))):
            if local[i] == NULL_BLOCK:
                continue
            lo.append(local[i])
            ro.append(rem[i])
            if rem[i] == NULL_BLOCK and spec.error is None:
                spec.error = f"KV cache group {g}: block {i} was already freed by the prefill"
        if error is not None and spec.error is None:
            spec.error = f"KV cache group {g}: {error}"
        spec.local_block_ids.extend(lo)
        pairs.append((lo, ro))
    if spec.error is None:
        spec.groups = pairs
    return spec


def push_recv_spec(
    request_id: str,
    remote: PushParams,
    prompt: Sequence[int] | None,
    matched: int,
    num_external: int,
    block_ids: Sequence[int],
    block_size: int,
    inputs: KeyInputs = PLAIN,
) -> PushRecvSpec:
    """Where a push into this decode request goes (no blocks: the prefill need not push)."""
    spec = PushRecvSpec(request_id, [], 0, matched, "", remote)
    if num_external <= 0 or matched <= 0 or prompt is None:
        return spec
    spec.prompt_hash = prompt_hash(prompt[:matched], identity_digest(inputs, matched))
    start, end, error = _window(matched, num_external, block_ids, block_size)
    spec.first_block = start
    spec.local_block_ids = list(block_ids[start:end])
    spec.error = error
    return spec


def handover(
    engine_id: str,
    request_id: str,
    prompt: Sequence[int],
    num_tokens: int,
    groups: Sequence[Sequence[int]],
    side_channels: Sequence[str],
    block_size: int,
    lease: float,
    inputs: KeyInputs = PLAIN,
) -> PullParams:
    """The params a finished prefill request answers with: its first ``num_tokens`` prompt
    tokens' blocks of each KV cache group (``groups``), kept for ``lease`` seconds."""
    n = cdiv(num_tokens, block_size)
    ids = tuple(tuple(g[:n]) for g in groups)
    return PullParams(
        engine_id=engine_id,
        request_id=request_id,
        block_ids=ids[0] if len(ids) == 1 else None,
        group_block_ids=ids if len(ids) > 1 else None,
        num_tokens=num_tokens,
        prompt_hash=prompt_hash(prompt[:num_tokens], identity_digest(inputs, num_tokens)),
        side_channels=tuple(side_channels),
        tp_size=len(side_channels),
        # The worker's lease starts a little later than this, so decode errs on the safe side.
        expires_at=time.time() + lease,
    )


class PushProgress:
    """Prefill side of pushes: which blocks of each pushing request are complete after a step.

    The engine adapter reports each scheduled step of a pushing request (its blocks, tokens
    computed before the step, tokens scheduled in it); :meth:`take` hands out the
    :class:`PushSendStep` s to put into the next :class:`StepPlan`.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._pushing: dict[str, PushSendStep] = {}
        self._out: list[PushSendStep] = []

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._pushing

    def __bool__(self) -> bool:
        return bool(self._pushing)

    def start(
        self, request_id: str, push_id: str, prompt: Sequence[int], inputs: KeyInputs = PLAIN
    ) -> None:
        digest = prompt_hash(prompt, identity_digest(inputs, len(prompt)))
        self._pushing[request_id] = PushSendStep(request_id, push_id, [], 0, len(prompt), digest)

    def advance(
        self,
        request_id: str,
        new_blocks: list[int] | None,
        replace: bool,
        computed: int,
        scheduled: int,
    ) -> None:
        """One step of ``request_id``: ``new_blocks`` were allocated (``replace``: they are all
        its blocks), and ``scheduled`` tokens computed after ``computed`` ones."""
        st = self._pushing[request_id]
        if new_blocks is not None:
            st.block_ids = new_blocks if replace else st.block_ids + new_blocks
        done = computed + scheduled
        final = done >= st.num_tokens
        bs = self.block_size
        ready = cdiv(st.num_tokens, bs) if final else done // bs
        if ready > st.ready or final:
            st.ready = min(ready, len(st.block_ids))
            st.final = final
            self._out.append(dataclasses.replace(st, block_ids=list(st.block_ids)))
        if final:
            del self._pushing[request_id]

    def end(self, request_id: str) -> None:
        """The request finished: a push still waiting for its prompt ends with it."""
        st = self._pushing.pop(request_id, None)
        if st is not None:
            self._out.append(dataclasses.replace(st, final=True, aborted=True))

    def take(self) -> list[PushSendStep]:
        out, self._out = self._out, []
        return out
