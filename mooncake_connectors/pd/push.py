"""Layer-wise push, both sides of it, as part of a :class:`~.session.TransferSession`.

The decode worker sends the prefill worker a :class:`PushTarget` for the blocks its engine
allocated; the prefill worker WRITEs each layer's finished blocks from :meth:`save_kv_layer`
(right after the engine computed that layer) and, once the prompt is complete and every write
landed, answers :class:`PushDone` on the decode's side channel. A target that arrives after some
layers were computed first gets what is already done. The decode side gives up (the engine
recomputes) when no :class:`PushDone` comes by its deadline plus a grace for late writes.

:class:`LayerPush` shares the session's lock, pool, transfer engine and result sets; it is a
separate class so each half reads on its own.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from ..errors import ConfigError, MooncakeConnectorsError
from ..transfer_core import Batch, TransferEngine
from ..transfer_core.cuda_driver import Fence
from ..types import TransferOp, TransferStatus
from .layout import check_compatible, plan_reads
from .messages import PushDone, PushTarget, WorkerLayout
from .plan import PushRecvSpec, PushSendStep, StepPlan
from .settings import SessionSettings, SessionStats
from .side_channel import SideChannelClient

log = logging.getLogger(__name__)
_PUSH_GRACE = 2.0  # s a decode waits for PushDone past the deadline it gave the prefill
# Targets may come before the step that names their push; anyone reaching a plaintext side
# channel can send one (each up to a few MB decoded), so at most this many wait.
_EARLY_TARGETS = 32


@dataclasses.dataclass
class _Push:
    """Prefill side: one request being pushed (its target may arrive before or after it runs)."""

    push_id: str
    created: float
    request_id: str | None = None
    block_ids: list[int] = dataclasses.field(default_factory=list)
    num_tokens: int = 0
    prompt_hash: str = ""
    ready: int = 0  # blocks complete in every layer after the steps done so far
    final: bool = False
    target: PushTarget | None = None
    error: str | None = None
    sent: dict[str, int] = dataclasses.field(default_factory=dict)  # layer -> blocks written
    batches: list[Batch] = dataclasses.field(default_factory=list)
    finishing: bool = False
    final_at: float = 0.0
    overlapped: int = 0  # bytes whose write started inside a forward (save_kv_layer)
    after: Fence | None = None  # GPU KV: the end of the forward that made ``ready`` blocks


class LayerPush:
    """The push half of a transfer session. The attributes annotated here are the session's,
    shared with the pull half; the push state is set up by :meth:`_init_push`."""

    config: SessionSettings
    engine_id: str
    tp_size: int
    tp_rank: int
    engine: TransferEngine | None
    layout: WorkerLayout | None
    stats: SessionStats
    _lock: threading.Lock
    _pool: concurrent.futures.ThreadPoolExecutor
    _done: dict[str, tuple[float, int, set[int]]]
    _recv_done: set[str]
    _load_errors: set[int]
    _layer_names: dict[str, list[str]]

    def _init_push(self) -> None:
        self._pushes: dict[str, _Push] = {}  # prefill side, by push id
        self._step: list[tuple[_Push, PushSendStep]] = []  # pushes in the running forward
        self._step_meta: StepPlan | None = None  # whose push progress _step holds
        # decode side: push id -> (spec, when to give up (monotonic))
        self._push_wait: dict[str, tuple[PushRecvSpec, float]] = {}
        self.dropped_targets = 0  # push targets refused: no room for another early one
        # GPU KV caches: a Fence at where the engine's stream is now (the engine adapter sets
        # it), which push writes follow on the GPU; no host sync per layer.
        self.producer: Callable[[], Fence] | None = None

    def _client(self) -> SideChannelClient:
        raise NotImplementedError  # the session's, one per pool thread

    # -- layer-wise push: prefill side -------------------------------------------------------
    def begin_step(self, meta: StepPlan) -> None:
        """Take this step's push progress, once: from the first ``save_kv_layer`` of its forward
        or from ``start_load_kv`` (which vLLM calls after the forward when loads are async; the
        engine adapter calls both with the same plan object)."""
        if meta is self._step_meta:
            return
        self._step_meta = meta
        for step in meta.push_send:
            self._push_step(step)

    def _push_step(self, step: PushSendStep) -> None:
        with self._lock:
            p = self._pushes.get(step.push_id)
            if p is None:
                p = self._pushes[step.push_id] = _Push(step.push_id, time.monotonic())
            p.request_id = step.request_id
            p.block_ids = step.block_ids
            p.num_tokens, p.prompt_hash = step.num_tokens, step.prompt_hash
            self._check_target(p)
            if not step.aborted:
                self._step.append((p, step))
                return
            # Ended before its prompt was computed: nothing more comes; end the push now.
            p.final = True
            p.error = p.error or "the prefill request ended before its prompt was computed"
            if p.finishing:
                return
            p.finishing = True
        self._pool.submit(self._finish_push, p)

    def _check_target(self, p: _Push) -> None:
        """Refuse a target that does not fit this request (caller holds the lock)."""
        t = p.target
        if t is None or p.error or p.request_id is None or not t.block_ids:
            return
        if t.num_tokens != p.num_tokens or t.prompt_hash != p.prompt_hash:
            p.error = "the decode instance expects other prompt tokens"

    def _on_push_target(self, msg: PushTarget) -> None:
        """Side-channel thread: a decode worker says where to write push ``msg.push_id``."""
        error = None
        if msg.engine_id != self.engine_id:
            error = f"push meant for engine {msg.engine_id} reached {self.engine_id}"
        elif msg.block_ids and self.layout is None:
            error = "KV caches not registered yet"
        elif msg.block_ids and self.layout is not None:
            if (msg.target.tp_size, msg.target.tp_rank) != (self.tp_size, self.tp_rank):
                error = (
                    f"push needs equal TP ranks (prefill {self.tp_rank}/{self.tp_size}, "
                    f"decode {msg.target.tp_rank}/{msg.target.tp_size})"
                )
            else:
                try:
                    check_compatible(msg.target, self.layout)
                except ConfigError as exc:
                    error = str(exc)
        finish = False
        with self._lock:
            p = self._pushes.get(msg.push_id)
            if p is None:
                early = sum(q.request_id is None for q in self._pushes.values())
                if early >= _EARLY_TARGETS:  # the decode gives up at its deadline and recomputes
                    self.dropped_targets += 1
                    return
                p = self._pushes[msg.push_id] = _Push(msg.push_id, time.monotonic())
            if p.target is not None:
                return  # a duplicate
            p.target = msg
            if error and not p.error:
                p.error = error
            self._check_target(p)
            if p.error is None:
                self._write(p, None, p.ready)  # what earlier steps already computed
            if p.final and not p.finishing:
                p.finishing = finish = True
        if finish:
            self._pool.submit(self._finish_push, p)

    def _write(
        self, p: _Push, names: list[str] | None, upto: int, after: Fence | None = None
    ) -> int:
        """Start writing blocks ``[sent, upto)`` of the named layers (all: None) to the target,
        after ``after`` (else ``p.after``) on GPU KV caches; returns the bytes. Caller holds the
        lock; the writes run on the transfer engine's lanes."""
        t = p.target
        if t is None or p.error is not None or not t.block_ids or self.engine is None:
            return 0
        assert self.layout is not None
        end = min(upto, t.first_block + len(t.block_ids), len(p.block_ids))
        groups: dict[tuple[int, int], list[str]] = {}
        for name in names if names is not None else [lay.name for lay in self.layout.layers]:
            start = max(p.sent.get(name, 0), t.first_block)
            if start < end:
                groups.setdefault((start, end), []).append(name)
                p.sent[name] = end
        if not groups:
            return 0
        left = t.expires_at - time.time()
        if left <= 0:
            p.error = "the decode's deadline for this push passed"
            return 0
        try:
            reqs = []
            for (start, stop), layers in groups.items():
                part, _ = plan_reads(
                    self.layout,
                    [t.target],
                    p.block_ids[start:stop],
                    t.block_ids[start - t.first_block : stop - t.first_block],
                    op=TransferOp.WRITE,
                    layers=layers,
                )
                reqs.extend(part)
            fence = after if after is not None else p.after
            p.batches.append(self.engine.submit(reqs, timeout=left, after=fence))
        except MooncakeConnectorsError as exc:
            p.error = f"push write failed: {exc}"
            return 0
        return sum(r.length for r in reqs)

    def save_kv_layer(self, layer_name: str, meta: StepPlan) -> None:
        """The engine finished this layer of the running forward: push its completed blocks."""
        if meta.push_send:
            self.begin_step(meta)
        if not self._step:
            return
        names = self._layer_names.get(layer_name)
        if not names:
            return
        with self._lock:
            fence = None
            for p, step in self._step:
                if p.target is not None and p.error is None:
                    if fence is None and self.producer is not None:
                        fence = self.producer()  # this layer's KV is queued before here
                    p.overlapped += self._write(p, names, step.ready, fence)

    def wait_for_save(self) -> None:
        """End of a forward: its blocks are complete in every layer; end finished pushes."""
        if not self._step:
            return
        done = []
        now = time.perf_counter()
        fence = None if self.producer is None else self.producer()  # the forward's end
        with self._lock:
            step, self._step = self._step, []
            for p, s in step:
                p.ready = max(p.ready, s.ready)
                p.after = fence if fence is not None else p.after
                if s.final:
                    p.final, p.final_at = True, now
                if p.final and not p.finishing and (p.target is not None or p.error):
                    p.finishing = True
                    done.append(p)
        for p in done:
            self._pool.submit(self._finish_push, p)

    def _finish_push(self, p: _Push) -> None:
        """Pool thread: catch up, wait for every write, tell the decode, free the blocks."""
        try:
            with self._lock:
                self._write(p, None, p.ready)
                batches = list(p.batches)
            nbytes = nreqs = 0
            for b in batches:
                b.wait()
                for status, err, req in zip(b.statuses, b.errors, b.requests, strict=True):
                    if status is not TransferStatus.COMPLETED:
                        p.error = p.error or f"push write failed: {err}"
                    nbytes += req.length
                nreqs += len(b.requests)
            t = p.target
            if t is not None and t.block_ids and p.error is None:
                want = min(t.first_block + len(t.block_ids), len(p.block_ids))
                if p.ready < want:
                    p.error = f"only {p.ready} of {want} blocks were computed"
            tail = time.perf_counter() - p.final_at if p.final_at else 0.0
            if t is not None:
                if p.error and t.block_ids:
                    log.warning("push %s (request %s) failed: %s", p.push_id, p.request_id, p.error)
                msg = PushDone(
                    p.push_id, p.error is None, p.error or "", nbytes, nreqs, tail, p.overlapped
                )
                self._client().send(t.target.side_channel, msg)
        finally:
            with self._lock:
                self._pushes.pop(p.push_id, None)
                if p.request_id is not None:
                    self._done[p.request_id] = (time.monotonic(), 1, {0})

    def _expire_pushes(self, now: float) -> None:
        """Pushes whose target or request never came within the lease are forgotten; a decode
        waiting past its deadline recomputes."""
        horizon = now - self.config.kv_lease
        # A target no step of ours named: its decode gave up by now (and it holds a slot).
        unnamed = now - self.config.transfer_timeout - _PUSH_GRACE
        with self._lock:
            stale = [
                k
                for k, p in self._pushes.items()
                if not p.finishing
                and (p.created < horizon or (p.request_id is None and p.created < unnamed))
            ]
            for k in stale:
                del self._pushes[k]
            late = [k for k, (_, until) in self._push_wait.items() if until <= now]
        for k in late:
            self._push_failed(k, "no push arrived by the deadline")

    # -- layer-wise push: decode side --------------------------------------------------------
    def _expect_push(self, spec: PushRecvSpec) -> None:
        if spec.local_block_ids:
            with self._lock:
                self._push_wait[spec.remote.push_id] = (
                    spec,
                    time.monotonic() + self.config.transfer_timeout + _PUSH_GRACE,
                )
        self._pool.submit(self._send_target, spec)

    def _send_target(self, spec: PushRecvSpec) -> None:
        remote = spec.remote
        if spec.error:
            self._push_failed(remote.push_id, spec.error)
            return
        if remote.tp_size != self.tp_size or self.layout is None:
            self._push_failed(remote.push_id, "push needs equal TP sizes")
            return
        msg = PushTarget(
            remote.push_id,
            remote.engine_id,
            self.layout,
            spec.first_block,
            spec.local_block_ids,
            spec.num_tokens,
            spec.prompt_hash,
            time.time() + self.config.transfer_timeout,
        )
        if not self._client().send(remote.side_channels[self.tp_rank], msg):
            self._push_failed(remote.push_id, f"cannot reach {remote.side_channels[self.tp_rank]}")

    def _on_push_done(self, msg: PushDone) -> None:
        if not msg.ok:
            self._push_failed(msg.push_id, msg.error or "the prefill gave up")
            return
        with self._lock:
            entry = self._push_wait.pop(msg.push_id, None)
            if entry is None:
                return  # already given up on (then its blocks were recomputed)
            self._recv_done.add(entry[0].request_id)
        self.stats.record_push(msg.tail_s, msg.nbytes, msg.nreqs, msg.overlapped)

    def _push_failed(self, push_id: str, why: str) -> None:
        with self._lock:
            entry = self._push_wait.pop(push_id, None)
            if entry is None:
                return
            spec = entry[0]
            self._load_errors.update(spec.local_block_ids)
            self._recv_done.add(spec.request_id)
        log.warning(
            "request %s: KV push failed, %d blocks will be recomputed: %s",
            spec.request_id,
            len(spec.local_block_ids),
            why,
        )
        self.stats.record_failed_load()
