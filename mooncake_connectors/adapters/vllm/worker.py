"""Worker side of the PD connector (runs in each vLLM worker, one per TP rank).

Both roles in one object, so ``kv_both`` instances work:

- prefill: registers the KV cache tensors with a :class:`TransferEngine` (remote READ only),
  serves its layout on the side channel, and holds finished requests' blocks until the decode
  side sends ``Done`` or the lease ends.
- decode: for each request the scheduler hands over, fetches the prefill's layout (once per
  prefill engine), READs every block of every layer in one batch straight into the blocks vLLM
  allocated, then tells the prefill it is done. A failure or a missed deadline turns into load
  errors for the affected blocks, which vLLM recomputes (``kv_load_failure_policy="recompute"``).

Layer-wise push (opt-in, see :mod:`.scheduler`): the decode worker sends the prefill worker a
:class:`PushTarget` for the blocks vLLM allocated; the prefill worker WRITEs each layer's finished
blocks from ``save_kv_layer`` (right after vLLM computed that layer) and, once the prompt is
complete and every write landed, answers :class:`PushDone` on the decode's side channel. A target
that arrives after some layers were computed first gets what is already done.

Loads run on a small thread pool so a slow or dead prefill never stalls the model runner.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
from typing import TYPE_CHECKING

from ...errors import ConfigError, MooncakeConnectorsError, TransferError
from ...transfer_core import Batch, TransferEngine
from ...types import Access, TransferOp, TransferStatus
from .config import PDConfig
from .layout import (
    check_compatible,
    layer_layouts,
    plan_reads,
    readers_per_source,
    register_spans,
    source_ranks,
)
from .metadata import PDConnectorMetadata, PDHandshake, PushRecvSpec, PushSendStep, RecvSpec
from .side_channel import (
    Done,
    PushDone,
    PushTarget,
    SideChannelClient,
    SideChannelServer,
    WorkerLayout,
)
from .stats import PDStats

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig

log = logging.getLogger(__name__)
_LOADERS = 4  # concurrent request loads (each is one batch spread over the engine's lanes)
_PUSH_GRACE = 2.0  # s a decode waits for PushDone past the deadline it gave the prefill


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


class _Refused(MooncakeConnectorsError):
    """A load that is not attempted (its reason is logged); its blocks are recomputed."""


class PDWorker:
    def __init__(
        self,
        config: PDConfig,
        vllm_config: VllmConfig,
        engine_id: str,
        num_blocks: int,
        num_kv_heads: int = 0,
    ) -> None:
        self.config = config
        self.engine_id = engine_id
        self.block_size: int = vllm_config.cache_config.block_size
        self.tp_size: int = vllm_config.parallel_config.tensor_parallel_size
        self.num_blocks = num_blocks
        self.num_kv_heads = num_kv_heads  # this rank's, from vLLM's KV cache spec
        self.tp_rank = 0
        self.engine: TransferEngine | None = None
        self.layout: WorkerLayout | None = None
        self._server: SideChannelServer | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(_LOADERS, "mc-pd-load")
        self._tls = threading.local()
        self._clients: list[SideChannelClient] = []
        self._lock = threading.Lock()
        self._layouts: dict[tuple[str, str], WorkerLayout] = {}
        self._silent: dict[str, float] = {}  # side channel -> until when it is taken as down
        self._sending: dict[str, float] = {}  # prefill request id -> lease deadline
        # Done received (maybe before the lease began): request id -> (first seen, readers, ranks)
        self._done: dict[str, tuple[float, int, set[int]]] = {}
        self._recv_done: set[str] = set()
        self._load_errors: set[int] = set()
        self.stats = PDStats()
        self._layer_names: dict[str, list[str]] = {}  # vLLM layer -> its entries in our layout
        self._pushes: dict[str, _Push] = {}  # prefill side, by push id
        self._step: list[tuple[_Push, PushSendStep]] = []  # pushes in the running forward
        self._step_meta: PDConnectorMetadata | None = None  # whose push progress _step holds
        # decode side: push id -> (spec, when to give up (monotonic))
        self._push_wait: dict[str, tuple[PushRecvSpec, float]] = {}

    # -- setup -------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self.tp_rank = get_tensor_model_parallel_rank()
        if not kv_caches:
            raise ConfigError("no KV cache tensors to register")
        layers = []
        for name, tensor in kv_caches.items():
            mine = layer_layouts(name, tensor, self.num_blocks, self.num_kv_heads)
            self._layer_names[name] = [lay.name for lay in mine]
            layers.extend(mine)
        first = next(iter(kv_caches.values()))
        location = f"cuda:{first.device.index or 0}" if first.device.type == "cuda" else "cpu:0"
        engine = TransferEngine(self.config.engine_config()).start()
        try:
            # Peers may only READ our KV cache (our own READs land in it all the same), unless
            # this instance accepts layer-wise pushes from prefill instances.
            engine.register_many(
                register_spans(layers),
                location=location,
                access=Access.READ_WRITE if self.config.accept_push else Access.READ,
                owner=list(kv_caches.values()),
            )
            port = self.config.side_channel_port
            self._server = SideChannelServer(
                self.config.host,
                port + self.tp_rank if port else 0,
                self._get_layout,
                self._on_done,
                on_push_target=self._on_push_target,
                on_push_done=self._on_push_done,
            )
        except BaseException:
            engine.close()
            raise
        self.engine = engine
        self.layout = WorkerLayout(
            engine_id=self.engine_id,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            segment=engine.segment_name,
            side_channel=self._server.endpoint,
            block_size=self.block_size,
            dtype=str(first.dtype),
            layers=layers,
        )
        log.info(
            "PD worker %d: %d layers, segment %s, side channel %s",
            self.tp_rank,
            len(kv_caches),
            engine.segment_name,
            self._server.endpoint,
        )

    def _get_layout(self) -> WorkerLayout:
        if self.layout is None:  # asked before register_kv_caches finished: no answer yet
            raise ConfigError("KV caches not registered yet")
        return self.layout

    def handshake(self) -> PDHandshake | None:
        if self._server is None:
            return None
        return PDHandshake(tp_rank=self.tp_rank, side_channel=self._server.endpoint)

    # -- prefill side ------------------------------------------------------------------------
    def _on_done(self, msg: Done) -> None:
        if msg.engine_id != self.engine_id:
            log.warning(
                "Done for engine %s reached engine %s; ignored", msg.engine_id, self.engine_id
            )
            return
        now = time.monotonic()
        with self._lock:
            for rid in msg.request_ids:
                first, _, ranks = self._done.get(rid, (now, msg.readers, set()))
                ranks.add(msg.reader)
                self._done[rid] = (first, max(1, msg.readers), ranks)

    # -- per step ----------------------------------------------------------------------------
    def start_load_kv(self, meta: PDConnectorMetadata) -> None:
        now = time.monotonic()
        if meta.send:
            with self._lock:
                for rid, lease in meta.send.items():
                    self._sending[rid] = now + lease
        for spec in meta.recv:
            self._pool.submit(self._load, spec)
        self.begin_step(meta)
        for pspec in meta.push_recv:
            self._expect_push(pspec)

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        now = time.monotonic()
        self._expire_pushes(now)
        with self._lock:
            sent = {
                rid
                for rid in self._sending
                if rid in self._done and len(self._done[rid][2]) >= self._done[rid][1]
            }
            expired = {rid for rid, end in self._sending.items() if end <= now} - sent
            for rid in sent | expired:
                del self._sending[rid]
                self._done.pop(rid, None)
            # Done notices for requests we never held (aborted prefills) do not pile up.
            horizon = now - self.config.kv_lease
            for rid in [r for r, (t, _, _) in self._done.items() if t < horizon]:
                del self._done[rid]
            recved, self._recv_done = self._recv_done, set()
        for rid in expired:
            log.warning("request %s: decode did not read its KV within the lease; freed", rid)
            self.stats.record_expired_lease()
        if expired and self._pushes:
            with self._lock:  # their blocks are free now: never write from them again
                for p in self._pushes.values():
                    if p.request_id in expired and p.error is None:
                        p.error = "the prefill's lease on the blocks ended"
        return (sent | expired) or None, recved or None

    def take_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    # -- layer-wise push: prefill side -------------------------------------------------------
    def begin_step(self, meta: PDConnectorMetadata) -> None:
        """Take this step's push progress, once: from the first ``save_kv_layer`` of its forward
        or from ``start_load_kv`` (which vLLM calls after the forward when loads are async)."""
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

    def _write(self, p: _Push, names: list[str] | None, upto: int) -> int:
        """Start writing blocks ``[sent, upto)`` of the named layers (all: None) to the target;
        returns the bytes. Caller holds the lock; the writes run on the transfer engine's lanes."""
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
            p.batches.append(self.engine.submit(reqs, timeout=left))
        except MooncakeConnectorsError as exc:
            p.error = f"push write failed: {exc}"
            return 0
        return sum(r.length for r in reqs)

    def save_kv_layer(self, layer_name: str, meta: PDConnectorMetadata) -> None:
        """vLLM finished this layer of the running forward: push its completed blocks."""
        if meta.push_send:
            self.begin_step(meta)
        if not self._step:
            return
        names = self._layer_names.get(layer_name)
        if not names:
            return
        with self._lock:
            for p, step in self._step:
                if p.target is not None and p.error is None:
                    p.overlapped += self._write(p, names, step.ready)

    def wait_for_save(self) -> None:
        """End of a forward: its blocks are complete in every layer; end finished pushes."""
        if not self._step:
            return
        done = []
        now = time.perf_counter()
        with self._lock:
            step, self._step = self._step, []
            for p, s in step:
                p.ready = max(p.ready, s.ready)
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
        with self._lock:
            stale = [k for k, p in self._pushes.items() if p.created < horizon and not p.finishing]
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

    # -- decode side: one request's load, on the pool ------------------------------------------
    def _client(self) -> SideChannelClient:
        client: SideChannelClient | None = getattr(self._tls, "client", None)
        if client is None:
            client = SideChannelClient(self.config.handshake_timeout)
            self._tls.client = client
            with self._lock:
                self._clients.append(client)
        return client

    def _remote_layout(self, engine_id: str, endpoint: str) -> WorkerLayout:
        key = (engine_id, endpoint)
        with self._lock:
            layout = self._layouts.get(key)
            silent_until = self._silent.get(endpoint, 0.0)
        if layout is None:
            if time.monotonic() < silent_until:
                # It just failed to answer: fail the loads queued behind it at once instead of
                # letting each wait out its own handshake deadline.
                raise _Refused(f"side channel {endpoint} did not answer a moment ago")
            try:
                layout = self._client().fetch_layout(endpoint)
            except TransferError:
                with self._lock:
                    self._silent[endpoint] = time.monotonic() + self.config.handshake_timeout
                raise
            if layout.engine_id != engine_id:
                raise _Refused(
                    f"{endpoint} now serves engine {layout.engine_id}, not {engine_id} "
                    "(prefill restarted?)"
                )
            assert self.layout is not None
            check_compatible(self.layout, layout)
            with self._lock:
                self._layouts[key] = layout
        return layout

    def _load(self, spec: RecvSpec) -> None:
        remote = spec.remote
        failed: set[int] = set()
        t0 = time.perf_counter()
        nbytes = nreqs = 0
        endpoints = list(remote.side_channels)  # until we know which ranks we read from
        readers = 1
        try:
            ranks = source_ranks(self.tp_rank, self.tp_size, remote.tp_size)
            readers = readers_per_source(self.tp_size, remote.tp_size)
            endpoints = [remote.side_channels[r] for r in ranks]
            if not spec.local_block_ids:
                return  # release only
            failed = set(spec.local_block_ids)  # until proven otherwise
            if spec.error:
                raise _Refused(spec.error)
            if time.time() + self.config.transfer_timeout > remote.expires_at:
                raise _Refused("the prefill's lease on these blocks ends before a read could")
            layouts = [self._remote_layout(remote.engine_id, ep) for ep in endpoints]
            assert self.layout is not None and self.engine is not None
            reqs, owners = plan_reads(
                self.layout, layouts, spec.local_block_ids, spec.remote_block_ids
            )
            t0 = time.perf_counter()
            batch = self.engine.submit(reqs, timeout=self.config.transfer_timeout)
            batch.wait()
            failed = set()
            first_error: BaseException | None = None
            for i, (status, err) in enumerate(zip(batch.statuses, batch.errors, strict=True)):
                if status is not TransferStatus.COMPLETED:
                    failed.update(owners[i])
                    first_error = first_error or err
            if failed:
                raise TransferError(f"{len(failed)} blocks failed: {first_error}")
            nreqs = len(reqs)
            nbytes = sum(r.length for r in reqs)
        except MooncakeConnectorsError as exc:
            log.warning(
                "request %s: KV load from %s failed, %d blocks will be recomputed: %s",
                spec.request_id,
                endpoints,
                len(failed),
                exc,
            )
        except Exception:  # never lose a request: anything else is a failed load too
            log.exception("request %s: KV load from %s failed", spec.request_id, endpoints)
            failed = set(spec.local_block_ids)
        finally:
            client = self._client()
            for ep in endpoints:
                client.notify_done(ep, remote.engine_id, [remote.request_id], self.tp_rank, readers)
            if spec.local_block_ids:
                if failed:
                    self.stats.record_failed_load()
                else:
                    self.stats.record_load(time.perf_counter() - t0, nbytes, nreqs)
                with self._lock:
                    self._load_errors.update(failed)
                    self._recv_done.add(spec.request_id)

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        if self.engine is not None:
            self.engine.close()  # loads still in flight fail now instead of at their deadline
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            clients, self._clients = self._clients, []
        for c in clients:  # after the pool: each client belongs to one of its threads
            c.close()
        self.engine = None
