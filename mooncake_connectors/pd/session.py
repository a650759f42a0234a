"""A worker's PD transfer session: one per TP rank, engine-free, both roles in one object (so an
instance that both prefills and decodes works).

- prefill: registers the KV cache tensors with a :class:`TransferEngine` (peers may only READ),
  serves its layout on the side channel, and holds finished requests' blocks until every decode
  reader sends ``Done`` or the lease ends.
- decode: for each :class:`~.plan.RecvSpec`, fetches the prefill's layout (once per prefill
  engine), READs every block of every layer in one batch straight into the blocks the engine
  allocated, then tells the prefill it is done. A failure or a missed deadline turns into load
  errors for the affected blocks, which the engine recomputes.
- layer-wise push: see :mod:`.push`.

The engine adapter supplies the plain facts (``block_size``, ``tp_size``, ``tp_rank``, the block
count, KV heads per rank), settings (:class:`~.settings.SessionSettings`) and a stats sink, and
forwards each step's :class:`~.plan.StepPlan`. Loads run on a small thread pool so a slow or dead
prefill never stalls the model runner.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

from ..config import for_gpu
from ..errors import ConfigError, LoadRefused, MooncakeConnectorsError, TransferError
from ..netguard import RateLimitedLog
from ..transfer_core import TransferEngine
from ..types import Access, TransferStatus
from .curve import CurveIdentity
from .layout import (
    check_compatible,
    layer_layouts,
    plan_reads,
    readers_per_source,
    register_spans,
    source_ranks,
)
from .messages import Done, WorkerLayout
from .plan import RecvSpec, StepPlan
from .push import LayerPush
from .settings import SessionSettings, SessionStats
from .side_channel import SideChannelClient, SideChannelServer

log = logging.getLogger(__name__)
_LOADERS = 4  # concurrent request loads (each is one batch spread over the engine's lanes)
# A Done may beat the scheduler's plan that hands its request over (the decode read before our
# next step): such ids wait here, at most this many and this long. Anyone who reaches a plaintext
# side channel can send Done, so ids we do not hold must not cost more than this.
_EARLY_DONE = 4096
_EARLY_WAIT = 30.0  # s; many scheduler steps


class TransferSession(LayerPush):
    """One TP rank's transfers. The engine adapter calls :meth:`register` once, then each step
    :meth:`start_load_kv` with the step's plan and :meth:`get_finished` /
    :meth:`take_load_errors` for what to report back; layer-wise push adds
    :meth:`save_kv_layer` and :meth:`wait_for_save` around each forward."""

    def __init__(
        self,
        config: SessionSettings,
        engine_id: str,
        *,
        block_size: int,
        tp_size: int,
        num_blocks: int,
        num_kv_heads: int = 0,
        stats: SessionStats,
        groups: list[list[str]] | None = None,
        group_kinds: list[str] | None = None,
    ) -> None:
        self.config = config
        self.engine_id = engine_id
        self.block_size = block_size
        self.tp_size = tp_size
        self.num_blocks = num_blocks
        self.num_kv_heads = num_kv_heads  # this rank's, from the engine's KV cache spec
        self.tp_rank = 0
        self.engine: TransferEngine | None = None
        self.layout: WorkerLayout | None = None
        self._server: SideChannelServer | None = None
        self._curve: CurveIdentity | None = None  # with mutual TLS: the side channel's keys
        self._pool = concurrent.futures.ThreadPoolExecutor(_LOADERS, "mc-pd-load")
        # loads read inside the scheduling step: never queued behind large asynchronous ones
        self._inline_pool = concurrent.futures.ThreadPoolExecutor(_LOADERS, "mc-pd-inline")
        self._tls = threading.local()
        self._clients: list[SideChannelClient] = []
        self._lock = threading.Lock()
        self._layouts: dict[tuple[str, str], WorkerLayout] = {}
        self._unprepared: list[str] = []  # segments of layouts fetched, whose paths are not ready
        self._silent: dict[str, float] = {}  # side channel -> until when it is taken as down
        self._sending: dict[str, float] = {}  # prefill request id -> lease deadline
        # Done received for a held request: request id -> (first seen, readers, ranks)
        self._done: dict[str, tuple[float, int, set[int]]] = {}
        self._early: dict[str, tuple[float, int, set[int]]] = {}  # the same, not held (yet)
        self.dropped_done = 0  # Done ids refused: not held and no room among the early ones
        self._foreign = RateLimitedLog(log)  # anyone can send those: one line now and then
        self._recv_done: set[str] = set()
        self._load_errors: set[int] = set()
        self.stats = stats
        self._layer_names: dict[str, list[str]] = {}  # engine layer -> its entries in our layout
        # several KV cache groups: each group's engine layer names and kind (None: one group)
        self.groups = groups
        self.group_kinds = group_kinds
        self._group_entries: list[set[str]] = []  # per group, its entries in our layout
        self._init_push()

    # -- setup -------------------------------------------------------------------------------
    def register(self, kv_caches: Mapping[str, Any], tp_rank: int) -> None:
        """Register this rank's KV cache tensors (torch tensors, read only for their geometry,
        device and dtype) and open the side channel."""
        self.tp_rank = tp_rank
        if not kv_caches:
            raise ConfigError("no KV cache tensors to register")
        layers = []
        for name, tensor in kv_caches.items():
            mine = layer_layouts(name, tensor, self.num_blocks, self.num_kv_heads)
            self._layer_names[name] = [lay.name for lay in mine]
            layers.extend(mine)
        if self.groups is not None:
            unknown = [n for g in self.groups for n in g if n not in self._layer_names]
            if unknown:
                raise ConfigError(f"KV cache group layers without a KV cache tensor: {unknown[:3]}")
            self._group_entries = [
                {e for n in g for e in self._layer_names[n]} for g in self.groups
            ]
        first = next(iter(kv_caches.values()))
        on_gpu = first.device.type == "cuda"
        location = f"cuda:{first.device.index or 0}" if on_gpu else "cpu:0"
        cfg = self.config.engine_config()
        if on_gpu:  # same-host peers copy GPU to GPU; tcp stages for the rest
            cfg = cfg.replace(transports=for_gpu(cfg.transports))
        tls = cfg.tls
        if tls is not None and tls.mutual:
            self._curve = CurveIdentity.from_tls(tls)
        elif tls is not None:
            log.warning("TLS without tls_ca: the side channel stays unauthenticated plaintext")
        engine = TransferEngine(cfg).start()
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
                curve=self._curve,
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
            groups=self.groups,
            group_kinds=self.group_kinds,
        )
        log.info(
            "PD worker %d: %d layers, segment %s, side channel %s",
            self.tp_rank,
            len(kv_caches),
            engine.segment_name,
            self._server.endpoint,
        )

    def _get_layout(self) -> WorkerLayout:
        if self.layout is None:  # asked before register() finished: no answer yet
            raise ConfigError("KV caches not registered yet")
        return self.layout

    @property
    def side_channel(self) -> str | None:
        """Where this rank's side channel listens (None before :meth:`register`)."""
        return None if self._server is None else self._server.endpoint

    # -- prefill side ------------------------------------------------------------------------
    def _on_done(self, msg: Done) -> None:
        if msg.engine_id != self.engine_id:
            self._foreign.warning(
                "Done for engine %s reached engine %s; ignored", msg.engine_id, self.engine_id
            )
            return
        if msg.reader >= msg.readers:
            self.dropped_done += len(msg.request_ids)
            return
        now = time.monotonic()
        with self._lock:
            for rid in msg.request_ids:
                log.debug("timeline %s done_received", rid)
                table = self._done if rid in self._sending else self._early
                if table is self._early and rid not in table and len(table) >= _EARLY_DONE:
                    # Full: keep the ones already waiting (a flood cannot push a real one out).
                    self.dropped_done += 1
                    continue
                first, _, ranks = table.get(rid, (now, msg.readers, set()))
                ranks.add(msg.reader)
                table[rid] = (first, msg.readers, ranks)

    # -- per step ----------------------------------------------------------------------------
    def start_load_kv(self, meta: StepPlan) -> None:
        now = time.monotonic()
        if meta.send:
            with self._lock:
                for rid, lease in meta.send.items():
                    self._sending[rid] = now + lease
                    early = self._early.pop(rid, None)
                    if early is not None:
                        self._done.setdefault(rid, early)
        inline = []
        for spec in meta.recv:
            log.debug("timeline %s load_queued", spec.request_id)
            pool = self._inline_pool if spec.sync else self._pool
            future = pool.submit(self._load, spec)
            if spec.sync:
                inline.append((spec, future))
        if inline:
            self._wait_inline(inline)
        self.begin_step(meta)
        for pspec in meta.push_recv:
            self._expect_push(pspec)

    def _wait_inline(self, loads: list[tuple[RecvSpec, concurrent.futures.Future[None]]]) -> None:
        """The loads vLLM scheduled in this very step: the forward must not start before
        their KV is in place. Each ends by its own deadlines (layout exchange, then the read);
        one still running past both has its blocks reported failed (recomputed)."""
        limit = self.config.handshake_timeout + self.config.transfer_timeout + 5.0
        _, late = concurrent.futures.wait([f for _, f in loads], timeout=limit)
        for spec, future in loads:
            if future in late:
                log.error(
                    "request %s: KV load still running after %.0f s; its blocks are recomputed",
                    spec.request_id,
                    limit,
                )
                with self._lock:
                    self._load_errors.update(spec.local_block_ids)

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
                log.debug("timeline %s blocks_freed", rid)
                del self._sending[rid]
                self._done.pop(rid, None)
            # Done notices for requests we never held (aborted prefills) do not pile up.
            horizon = now - self.config.kv_lease
            for rid in [r for r, (t, _, _) in self._done.items() if t < horizon]:
                del self._done[rid]
            horizon = now - min(self.config.kv_lease, _EARLY_WAIT)
            for rid in [r for r, (t, _, _) in self._early.items() if t < horizon]:
                del self._early[rid]
            recved, self._recv_done = self._recv_done, set()
        for rid in recved:
            log.debug("timeline %s load_reported", rid)
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

    # -- decode side: one request's load, on the pool ------------------------------------------
    def _client(self) -> SideChannelClient:
        client: SideChannelClient | None = getattr(self._tls, "client", None)
        if client is None:
            client = SideChannelClient(self.config.handshake_timeout, self._curve)
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
                raise LoadRefused(f"side channel {endpoint} did not answer a moment ago")
            try:
                layout = self._client().fetch_layout(endpoint)
            except TransferError:
                with self._lock:
                    self._silent[endpoint] = time.monotonic() + self.config.handshake_timeout
                raise
            if layout.engine_id != engine_id:
                raise LoadRefused(
                    f"{endpoint} now serves engine {layout.engine_id}, not {engine_id} "
                    "(prefill restarted?)"
                )
            assert self.layout is not None
            check_compatible(self.layout, layout)
            with self._lock:
                self._layouts[key] = layout
                self._unprepared.append(layout.segment)
        return layout

    def _prepare_paths(self) -> None:
        """After a load (off its path): ready the transfer engine's paths to prefill engines
        first met in it, so a later, larger load does not set them up (tcp: the connections
        and threads of a striped read, which a first small load never needed)."""
        with self._lock:
            segments, self._unprepared = self._unprepared, []
        engine = self.engine
        for segment in segments:
            if engine is not None:
                engine.prepare(segment, self.config.handshake_timeout)

    def _load(self, spec: RecvSpec) -> None:
        remote = spec.remote
        log.debug("timeline %s load_start", spec.request_id)
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
                raise LoadRefused(spec.error)
            if time.time() + self.config.transfer_timeout > remote.expires_at:
                raise LoadRefused("the prefill's lease on these blocks ends before a read could")
            layouts = [self._remote_layout(remote.engine_id, ep) for ep in endpoints]
            assert self.layout is not None and self.engine is not None
            if spec.groups is None:
                reqs, owners = plan_reads(
                    self.layout, layouts, spec.local_block_ids, spec.remote_block_ids
                )
            else:
                if len(spec.groups) != len(self._group_entries):
                    raise LoadRefused(
                        f"blocks of {len(spec.groups)} KV cache groups, this worker has "
                        f"{len(self._group_entries)}"
                    )
                reqs, owners = [], []
                for (lo, ro), entries in zip(spec.groups, self._group_entries, strict=True):
                    r, o = plan_reads(self.layout, layouts, lo, ro, layers=entries)
                    reqs += r
                    owners += o
            t0 = time.perf_counter()
            log.debug("timeline %s transfer_submit %d", spec.request_id, len(reqs))
            # In this thread, as few calls as the transports can make: in vLLM's worker process
            # each hand-off, and each call that lets go of the interpreter lock, waits for the
            # engine's busy Python thread to give the lock back (up to 5 ms).
            batch = self.engine.run(reqs, timeout=self.config.transfer_timeout)
            log.debug("timeline %s transfer_end", spec.request_id)
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
                    if not spec.sync:  # vLLM parked the request until this is reported
                        self._recv_done.add(spec.request_id)
            if self._unprepared:
                self._prepare_paths()

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        if self.engine is not None:
            self.engine.close()  # loads still in flight fail now instead of at their deadline
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._inline_pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            clients, self._clients = self._clients, []
        for c in clients:  # after the pool: each client belongs to one of its threads
            c.close()
        self.engine = None
