"""The transfer engine: segments, batched one-sided READ/WRITE, failover, deadlines.

    engine = TransferEngine(EngineConfig(metadata="memory")).start()
    buf = engine.allocate_buffer(1 << 20)          # or engine.register(numpy_array)
    batch = engine.submit([TransferRequest(TransferOp.READ, "peer", buf.addr, remote, n)])
    batch.wait(5.0); batch.raise_for_status()

Each request is checked locally (its local range must be registered) and against the target's
descriptor, cut into slices of at most ``slice_size`` bytes, and the slices are spread over the
lanes of the best transport that reaches the target memory. A slice that fails with a retryable
error moves to another lane, then another transport, within the request's deadline; the failing
path cools down (PathHealth). A slice still in flight at its deadline fails the request with
TransferTimeout and its lane is torn down so no late bytes land in memory the caller reuses.
"""

from __future__ import annotations

import bisect
import contextlib
import heapq
import itertools
import logging
import os
import threading
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from ..config import EngineConfig, is_loopback
from ..errors import (
    AccessViolation,
    ConfigError,
    MetadataError,
    MooncakeConnectorsError,
    NoPathAvailable,
    SegmentNotFound,
    TransferError,
    TransferTimeout,
    TransportBroken,
    TransportClosed,
)
from ..types import Access, LocationKind, TransferOp, TransferStatus, parse_location
from . import fastpath, metrics
from .batch import Batch, TransferRequest, check_request, with_ops
from .descriptor import (
    ENGINE_REGION_FIELDS,
    ENGINE_SEGMENT_FIELDS,
    RegionDesc,
    SegmentDesc,
    host_id,
    merge_fields,
)
from .gpu_memory import check_device_ranges, check_host_ranges
from .health import PathHealth
from .memory import LocalSegment, Region, SharedBuffer, buffer_region, unmapped
from .metadata import MetadataBackend, open_metadata, scheme_of
from .metadata.lease import Publication
from .transport import TRANSPORTS, Slice, Transport, TransportContext

if TYPE_CHECKING:
    from .cuda_driver import Fence

log = logging.getLogger(__name__)
_ids = itertools.count(1)  # unique default names for engines without a tcp port
_READ = int(Access.READ)
_WRITE = int(Access.WRITE)
_CPU = LocationKind.CPU
_CUDA = LocationKind.CUDA
_WATCH_PERIOD = 0.25  # seconds; deadlines are enforced within this granularity


class _PeerView:
    """A peer's descriptor with a sorted region index and the transports that reach each."""

    __slots__ = ("desc", "regions", "routes", "starts")

    def __init__(self, desc: SegmentDesc) -> None:
        self.desc = desc
        self.regions = sorted(desc.regions, key=lambda r: r.addr)
        self.starts = [r.addr for r in self.regions]
        self.routes: dict[tuple[int, str], list[tuple[Transport, list[int]]]] = {}

    def find(self, addr: int, length: int) -> RegionDesc | None:
        i = bisect.bisect_right(self.starts, addr) - 1
        if i < 0:
            return None
        r = self.regions[i]
        return r if addr + length <= r.addr + r.length else None


class _Slice(Slice):
    __slots__ = ("batch", "index", "peer", "transport", "tried")

    batch: Batch
    index: int
    peer: SegmentDesc
    region: RegionDesc  # set for every engine slice (Optional only on the base class)
    transport: Transport
    tried: set[tuple[str, int]] | None  # (transport, lane) attempts; made at the first retry

    @property
    def key(self) -> tuple[str, str, int]:
        """The path this attempt takes (what PathHealth tracks)."""
        return (self.peer.name, self.transport.name, self.lane)


class TransferEngine:
    """Owns this process's segment, its transports and its view of peers."""

    def __init__(self, config: EngineConfig | None = None, **overrides: Any) -> None:
        if config is None:
            from ..config import engine_config_from_env

            config = engine_config_from_env(**overrides)
        elif overrides:
            config = config.replace(**overrides)
        self.config = config
        self.local = LocalSegment()
        self.health = PathHealth(config.backoff_initial, config.backoff_max)
        self.metadata: MetadataBackend | None = None
        self.transports: list[Transport] = []
        self._name = ""
        self._peers: dict[str, _PeerView] = {}
        self._routes: dict[str, fastpath.Route] = {}  # per peer, for fastpath.run
        self._peer_lock = threading.Lock()
        self._rr = itertools.count()
        self._stop = threading.Event()
        self._watch: list[tuple[float, int, _Slice, int]] = []
        self._watch_lock = threading.Lock()
        self._watch_cv = threading.Condition(self._watch_lock)
        self._seq = itertools.count()
        self._embedded_server: Any = None
        self._owned_buffers: dict[int, SharedBuffer] = {}
        self._started = False
        self._closed = False
        self._publish_lock = threading.Lock()
        self._publication: Publication | None = None

    # -- lifecycle --------------------------------------------------------------------------
    @property
    def segment_name(self) -> str:
        if not self._started:
            raise ConfigError("engine not started")
        return self._name

    def start(self) -> TransferEngine:
        if self._started:
            return self
        cfg = self.config
        self.metadata = self._open_metadata()
        ctx = TransportContext(cfg, self.local, lambda: self._name, self.refresh_peer, self._stop)
        endpoints: dict[str, str] = {}
        try:
            for name in cfg.transports:
                t = TRANSPORTS.get(name)(ctx)
                endpoints.update(t.start())
                self.transports.append(t)
            tcp = endpoints.get("tcp")
            preferred = cfg.segment_name or tcp or f"{cfg.host}:pid{os.getpid()}-{next(_ids)}"
            self._name = self.metadata.segment_name(preferred)
            self._endpoints = endpoints
            self._started = True
            # (a server this process embeds goes with it: nothing to withdraw from it at exit)
            self._publication = Publication(
                self.metadata, cfg.metadata_lease, withdraw_at_exit=self._embedded_server is None
            )
            self._publish()
        except BaseException:
            self._started = True
            self.close()
            raise
        if cfg.metrics_port is not None:
            metrics.serve(cfg.host, cfg.metrics_port, cfg.auth_token, cfg.tls)
        threading.Thread(target=self._watchdog, name="mc-engine-watchdog", daemon=True).start()
        log.info(
            "segment %s up: transports %s, metadata %s",
            self._name,
            [t.name for t in self.transports],
            cfg.metadata,
        )
        return self

    def _open_metadata(self) -> MetadataBackend:
        cfg = self.config
        backend = open_metadata(cfg.metadata, cfg)
        if scheme_of(cfg.metadata) != "http" or not cfg.metadata_autostart:
            return backend
        from urllib.parse import urlsplit

        u = urlsplit(cfg.metadata)
        if not u.hostname or not is_loopback(u.hostname):
            return backend
        try:
            backend.get("__probe__")
        except MetadataError:
            from .metadata.http import MetadataHTTPServer

            try:
                self._embedded_server = MetadataHTTPServer(
                    u.hostname,
                    u.port or 80,
                    path=u.path or "/metadata",
                    token=cfg.auth_token,
                    tls=cfg.tls if u.scheme == "https" else None,
                ).start()
                log.info("started the embedded metadata server at %s", self._embedded_server.url)
            except OSError as exc:  # another process won the race; use it
                log.debug("embedded metadata server not started: %s", exc)
        return backend

    def _descriptor(self) -> SegmentDesc:
        ts = self.transports
        regions = [
            merge_fields(
                r.to_desc(), [(t.name, t.describe_region(r)) for t in ts], ENGINE_REGION_FIELDS
            )
            for r in self.local.regions()
        ]
        desc = SegmentDesc(
            name=self._name,
            host_id=host_id(),
            pid=os.getpid(),
            epoch=self.local.epoch,
            endpoints=self._endpoints,
            regions=regions,
            auth=self.config.auth_token is not None,
        )
        return merge_fields(
            desc, [(t.name, t.describe_segment()) for t in ts], ENGINE_SEGMENT_FIELDS
        )

    def _publish(self) -> None:
        if not self._started or self._closed or self.metadata is None:
            return
        with self._publish_lock:
            desc = self._descriptor()
            if self._publication is not None:
                self._publication.publish(desc)
            else:
                self.metadata.publish_segment(desc)
            for t in self.transports:
                t.local_changed(desc.epoch)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        with self._watch_cv:
            self._watch_cv.notify_all()
        if self._publication is not None:
            self._publication.stop()
        if self.metadata is not None and self._name:
            try:
                self.metadata.remove_segment(self._name)
            except MetadataError as exc:
                log.warning("could not unpublish segment %s: %s", self._name, exc)
        for t in self.transports:
            t.close()
        if self.metadata is not None:
            self.metadata.close()
        if self._embedded_server is not None:
            self._embedded_server.stop()
        for buf in self._owned_buffers.values():
            buf.close()
        self._owned_buffers.clear()

    def abandon(self) -> None:
        """For a finalizer at interpreter exit: mark the engine closed and wait for nothing
        (its threads may be frozen). Sockets and memory go with the process; the descriptor
        was withdrawn at ``atexit`` where that could be done, and its lease ends it otherwise
        (``metadata.lease``)."""
        self._closed = True
        self._stop.set()

    def __enter__(self) -> TransferEngine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- memory -----------------------------------------------------------------------------
    def register(
        self, buffer: Any, *, location: str | None = None, access: Access | None = None
    ) -> Region:
        """Register a numpy array, torch tensor, SharedBuffer or buffer-protocol object."""
        try:
            region = buffer_region(buffer, location=location, access=access)
            if region.device >= 0:
                check_device_ranges([(region.addr, region.length)], region.location)
            elif region.kind is _CPU:
                check_host_ranges([(region.addr, region.length)], region.location)
            region = self.local.add(region)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        self._publish_added([region])
        return region

    def register_raw(
        self,
        addr: int,
        length: int,
        *,
        location: str = "cpu:0",
        access: Access = Access.READ_WRITE,
        owner: Any = None,
    ) -> Region:
        """Register memory the host engine owns, by address; keep it alive while registered."""
        return self.register_many([(addr, length)], location=location, access=access, owner=owner)[
            0
        ]

    def register_many(
        self,
        ranges: Iterable[tuple[int, int]],
        *,
        location: str = "cpu:0",
        access: Access = Access.READ_WRITE,
        owner: Any = None,
        check: bool = True,
    ) -> list[Region]:
        """Register several raw ranges with one descriptor update. Host memory is checked to be
        mapped (and writable for WRITE access): a bad address is an AccessViolation here, not a
        crash later; ``check=False`` skips that for memory the caller knows is its own."""
        out = []
        try:
            kind = parse_location(location)[0]
            spans = [(int(addr), int(length)) for addr, length in ranges]
            if kind is _CUDA:  # always: a host pointer taken for a GPU's would crash a copy
                check_device_ranges(spans, location)
            elif check:
                check_host_ranges(spans, location)
            if check and kind is _CPU:
                # every range before any is registered: a refusal leaves none behind
                bad = unmapped(
                    [(a, n) if a >= 0 else (0, 0) for a, n in spans],
                    write=bool(access & Access.WRITE),
                )
                if bad:
                    raise bad[min(bad)]
            for addr, length in spans:
                out.append(self.local.add(Region(addr, length, location, access, owner=owner)))
        except ValueError as exc:
            self._publish_added(out)
            raise ConfigError(str(exc)) from exc
        self._publish_added(out)
        return out

    def _publish_added(self, added: list[Region]) -> None:
        """Publish after adding ``added``. A transport that cannot describe them (an rdma MR
        that does not register, e.g. GPU memory without dma-buf or peermem) raises from the
        descriptor: they are removed again, so the failure leaves nothing registered and every
        later publish, which would otherwise retry and raise on them, works."""
        try:
            self._publish()
        except MooncakeConnectorsError:
            for region in added:
                with contextlib.suppress(ConfigError):
                    self.local.remove(region.addr)
            self._publish()
            raise

    def unregister(self, region: Region | int) -> None:
        addr = region.addr if isinstance(region, Region) else int(region)
        self.local.remove(addr)
        self._publish()

    def allocate_buffer(self, size: int) -> SharedBuffer:
        """A pre-faulted memfd buffer, registered; same-host peers copy it at memcpy speed."""
        buf = SharedBuffer(size)
        try:
            self.register(buf)
        except BaseException:
            buf.close()
            raise
        self._owned_buffers[buf.addr] = buf
        return buf

    def free_buffer(self, addr: int) -> None:
        buf = self._owned_buffers.pop(addr, None)
        if buf is None:
            raise ConfigError(f"no buffer allocated by this engine at {addr:#x}")
        self.unregister(addr)
        buf.close()

    # -- peers ------------------------------------------------------------------------------
    def peer(self, name: str, timeout: float | None = None) -> SegmentDesc:
        """The (cached) descriptor of segment ``name``; a lookup takes at most ``timeout``
        (TransferTimeout), else the metadata backend's own timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        return self._view(name, deadline).desc

    def _view(self, name: str, deadline: float | None = None) -> _PeerView:
        pv = self._peers.get(name)
        if pv is None:
            self._refresh_by(name, deadline)
            pv = self._peers[name]
        return pv

    def _refresh_by(self, name: str, deadline: float | None) -> None:
        """``refresh_peer`` within ``deadline``. Backends bound a lookup by connect_timeout
        only; when less time is left, the lookup runs in a helper thread (it finishes within
        its own timeout and fills the cache) and the caller stops waiting at its deadline."""
        left = None if deadline is None else deadline - time.monotonic()
        if left is None or left >= self.config.connect_timeout:
            self.refresh_peer(name)
            return
        done: list[BaseException | None] = []

        def lookup() -> None:
            try:
                self.refresh_peer(name)
                done.append(None)
            except BaseException as exc:  # handed to the waiting caller
                done.append(exc)

        t = threading.Thread(target=lookup, name="mc-engine-lookup", daemon=True)
        t.start()
        t.join(max(0.0, left))
        if not done:
            raise TransferTimeout(
                "looking up the segment's descriptor outlasted the request's deadline",
                peer=name,
            )
        if done[0] is not None:
            raise done[0]

    def prepare(self, name: str, timeout: float | None = None) -> None:
        """Ready the paths to segment ``name`` ahead of large transfers with it (tcp: the
        pooled connections and the threads a striped transfer drives), so the first of them
        pays no setup; blocks for up to about ``timeout`` (else ``connect_timeout``) per
        connection. Best effort: a peer that cannot be reached now is no error here (its
        transfers say so)."""
        if not self._started or self._closed:
            return
        limit = self.config.connect_timeout if timeout is None else timeout
        try:
            desc = self.peer(name, limit)
        except MooncakeConnectorsError as exc:
            log.debug("prepare %s: no descriptor: %s", name, exc)
            return
        # Only the transport each pair of memory kinds takes first (as ``_plan`` picks it): the
        # others would carry nothing (tcp beside shm on one host).
        kinds = {r.kind for r in self.local.regions()} or {_CPU}
        chosen: list[Transport] = []
        for region in desc.regions:
            for lkind in kinds:
                t = next(
                    (
                        t
                        for t in self.transports
                        if t.serves(lkind, region.kind) and t.reachable(desc, region)
                    ),
                    None,
                )
                if t is not None and t not in chosen:
                    chosen.append(t)
        for t in chosen:
            try:
                t.prepare(desc, limit)
            except Exception:  # a hook that must not raise did: the transfers set up anew
                log.warning("transport %s could not prepare %s", t.name, name, exc_info=True)

    def refresh_peer(self, name: str) -> SegmentDesc:
        """Fetch ``name``'s descriptor again (after it registered or unregistered memory)."""
        if self.metadata is None:
            raise ConfigError("engine not started")
        desc = self._descriptor() if name == self._name else self.metadata.lookup_segment(name)
        with self._peer_lock:
            self._peers[name] = _PeerView(desc)
        if name != self._name:
            for t in self.transports:
                t.peer_seen(desc)
        return desc

    # -- transfers --------------------------------------------------------------------------
    def submit(
        self,
        requests: Sequence[TransferRequest],
        timeout: float | None = None,
        *,
        after: Fence | None = None,
        _inline: bool = False,
    ) -> Batch:
        """Start every request; returns at once. Check per-request status on the Batch.

        ``after``: a point in the application's GPU stream (``cuda_driver.Fence``, e.g. after
        the kernel that wrote the KV cache) that copies of local GPU memory must follow; GPU
        copy streams wait for it on the GPU, other paths on the host."""
        if not self._started or self._closed:
            raise TransportClosed("engine is not running")
        deadline = time.monotonic() + (self.config.timeout if timeout is None else timeout)
        batch = Batch(with_ops(requests), deadline)
        groups: dict[tuple[int, str], tuple[Transport, SegmentDesc, list[_Slice]]] = {}
        slice_size = self.config.slice_size
        # The plan of the request before, for the next one of the same op and peer whose ranges
        # fall in the same local registration and remote region (a layer's KV blocks): what
        # _plan would find again. Not while a path cools down (its lanes are chosen per plan).
        last: tuple[Any, ...] | None = None
        for i, req in enumerate(batch.requests):
            if (
                last is not None
                and req.op is last[0]
                and req.target == last[1]
                and type(req.length) is int
                and type(req.local_addr) is int
                and type(req.remote_addr) is int
                and req.length > 0
                and last[2] <= req.local_addr
                and req.local_addr + req.length <= last[3]
                and last[4] <= req.remote_addr
                and req.remote_addr + req.length <= last[5]
            ):
                peer, region, transport, lanes, local = last[6]
            else:
                try:
                    plan = self._plan(req, deadline)
                except MooncakeConnectorsError as exc:
                    batch._fail(i, exc)
                    continue
                peer, region, transport, lanes, local = plan
                last = None
                if local is not None and not self.health.any_failing():
                    last = (req.op, req.target, local.addr, local.end, region.addr,
                            region.addr + region.length, plan)  # fmt: skip
            if req.length == 0 or local is None:
                with batch._lock:
                    batch._finish(i, TransferStatus.COMPLETED, None)
                continue
            n = -(-req.length // slice_size)
            batch._left[i] = n
            lane0 = next(self._rr)
            for k in range(n):
                off = k * slice_size
                s = _Slice(
                    req.op,
                    req.local_addr + off,
                    req.remote_addr + off,
                    min(slice_size, req.length - off),
                    deadline,
                    self._on_slice,
                )
                s.batch, s.index, s.peer, s.region, s.transport = batch, i, peer, region, transport
                if local.device < 0:  # GPU memory is never viewed as host memory
                    s.local_mv = local.slice(s.local_addr, s.length)
                s.local_device = local.device
                if local.device >= 0:
                    s.after = after
                s.lane = lanes[(lane0 + k) % len(lanes)]
                s.tried = None
                group = groups.get((id(transport), peer.name))
                if group is None:
                    group = groups[(id(transport), peer.name)] = (transport, peer, [])
                group[2].append(s)
        for transport, peer, slices in groups.values():
            # A synchronous submission runs in this thread, bounded by kernel socket timeouts
            # or a plain memcpy; only slices that may sit in a queue need the watchdog (GPU
            # slices may: transports hand them to staging or copy streams).
            if not _inline or slices[0].local_device >= 0 or slices[-1].local_device >= 0:
                self._watch_slices(slices)
            if after is not None and not transport.orders_after:
                _host_wait(after, deadline, slices)
            transport.submit(peer, slices, inline_ok=_inline)
        return batch

    def _plan(
        self, req: TransferRequest, deadline: float | None = None
    ) -> tuple[SegmentDesc, RegionDesc, Transport, list[int], Region | None]:
        # The data path: plain int arithmetic here, no enum operations (they cost microseconds).
        op = req.op
        if op is not TransferOp.READ and op is not TransferOp.WRITE:
            raise ConfigError(f"unknown transfer op {op!r}: expected a TransferOp")
        length = req.length
        if type(length) is not int or type(req.local_addr) is not int:
            check_request(req)
        if type(req.remote_addr) is not int or type(req.target) is not str:
            check_request(req)
        if not req.target.isascii():
            check_request(req)
        if length < 0 or req.local_addr < 0 or req.remote_addr < 0:
            raise ConfigError(f"negative address or length in {req}")
        local = None
        if length:
            local = self.local.find(req.local_addr, length)
            if local is None:
                raise AccessViolation(
                    f"local range {req.local_addr:#x}+{length} is not registered with this engine",
                    peer=req.target,
                    path="local",
                )
            if op is TransferOp.READ and not local.writable:
                raise AccessViolation(
                    "READ destination is read-only local memory", peer=req.target, path="local"
                )
        try:
            pv = self._view(req.target, deadline)
        except SegmentNotFound:
            raise
        except MetadataError as exc:
            raise TransportBroken(
                f"cannot look up segment: {exc.message}", peer=req.target
            ) from exc
        need = _READ if op is TransferOp.READ else _WRITE
        span = length or 1
        region = pv.find(req.remote_addr, span)
        if region is None or not need & region.access:
            self._refresh_by(req.target, deadline)  # it may have registered since we looked
            pv = self._peers[req.target]
            region = pv.find(req.remote_addr, span)
            if region is None:
                raise AccessViolation(
                    f"{req.remote_addr:#x}+{length} is not inside a registered region",
                    peer=req.target,
                )
            if not need & region.access:
                raise AccessViolation(
                    f"region at {region.addr:#x} does not allow {op.name}", peer=req.target
                )
        peer = pv.desc
        lkind = _CPU if local is None else local.kind
        route_key = (region.addr, lkind._value_)  # (Enum hashing runs Python code)
        routes = pv.routes.get(route_key)
        if routes is None:
            routes = [
                (t, list(range(t.lanes(peer))))
                for t in self.transports
                if t.serves(lkind, region.kind) and t.reachable(peer, region)
            ]
            pv.routes[route_key] = routes
        if not routes:
            raise NoPathAvailable(
                f"no enabled transport ({[t.name for t in self.transports]}) moves "
                f"{lkind.value} memory here to {region.location} memory of this peer",
                peer=req.target,
            )
        if not self.health.any_failing():
            t, lanes = routes[0]
            return peer, region, t, lanes, local
        now = time.monotonic()
        for t, lanes in routes:
            ok = [ln for ln in lanes if self.health.usable((peer.name, t.name, ln), now)]
            if ok:
                return peer, region, t, ok, local
        t, lanes = routes[0]  # every lane is cooling down: try the preferred one anyway
        return peer, region, t, lanes, local

    def _on_slice(self, s: Slice, err: MooncakeConnectorsError | None) -> None:
        assert isinstance(s, _Slice)
        with self._watch_lock:
            if s._done:
                return  # already timed out by the watchdog
            if err is None or not self._retryable(s, err):
                s._done = True
        if err is None:
            if self.health.any_recorded():
                self.health.succeeded(s.key)
            metrics.moved(s.transport.name, s.op._name_, s.length)
            s.batch._slice_done(s.index, None)
            return
        metrics.slice_failed(s.transport.name, type(err).__name__)
        if not s._done:
            if self.health.usable(s.key):  # one broken lane fails many slices: count it once
                self.health.failed(s.key)
            self._retry(s, err)
        else:
            s.batch._slice_done(s.index, err)

    def _retryable(self, s: _Slice, err: MooncakeConnectorsError) -> bool:
        return (
            isinstance(err, TransportBroken)
            and not self._closed
            and time.monotonic() < s.deadline
            and s.batch._status[s.index] is TransferStatus.PENDING
        )

    def _retry(self, s: _Slice, err: MooncakeConnectorsError) -> None:
        """Move ``s`` to another usable path, or wait for one to cool down, within its deadline."""
        now = time.monotonic()
        if s.tried is None:
            s.tried = {(s.transport.name, s.lane)}
        tried_before = s.tried
        options: list[tuple[Transport, int]] = []
        lkind = _CUDA if s.local_device >= 0 else _CPU
        for t in self.transports:
            if t.serves(lkind, s.region.kind) and t.reachable(s.peer, s.region):
                options.extend((t, ln) for ln in range(t.lanes(s.peer)))
        fresh = [
            (t, ln)
            for t, ln in options
            if (t.name, ln) not in tried_before
            and self.health.usable((s.peer.name, t.name, ln), now)
        ]
        usable = fresh or [
            (t, ln) for t, ln in options if self.health.usable((s.peer.name, t.name, ln), now)
        ]
        if usable:
            t, ln = usable[0]
            self._resubmit(s, t, ln)
            return
        if options:
            t, ln = min(options, key=lambda o: self.health.ready_at((s.peer.name, o[0].name, o[1])))
            at = self.health.ready_at((s.peer.name, t.name, ln))
            if at < s.deadline:
                timer = threading.Timer(max(0.0, at - now), self._resubmit, args=(s, t, ln))
                timer.daemon = True
                timer.start()
                return
        with self._watch_lock:
            s._done = True
        tried = ", ".join(f"{t} lane {ln}" for t, ln in sorted(tried_before))
        s.batch._slice_done(
            s.index,
            TransportBroken(
                f"every path failed before the deadline (tried {tried}); last error: {err}",
                peer=s.peer.name,
                path=s.path,
            ),
        )

    def _resubmit(self, s: _Slice, t: Transport, lane: int) -> None:
        if self._closed:
            with self._watch_lock:
                s._done = True
            s.batch._slice_done(s.index, TransportClosed("engine closed", peer=s.peer.name))
            return
        metrics.retried(t.name)
        log.debug("retrying %s slice to %s on %s lane %d", s.op.name, s.peer.name, t.name, lane)
        s.transport, s.lane = t, lane
        if s.tried is None:
            s.tried = set()
        s.tried.add((t.name, lane))
        s.attempts += 1
        self._watch_slices([s])  # a retried slice may wait on a lane: watch its deadline
        if s.after is not None and not t.orders_after:
            _host_wait(s.after, s.deadline, [s])
        t.submit(s.peer, [s])

    # -- deadlines --------------------------------------------------------------------------
    def _watch_slices(self, slices: list[_Slice]) -> None:
        with self._watch_cv:
            heap = self._watch
            # Finished slices leave the heap lazily; compact when they dominate it.
            if len(heap) > 4096:
                heap[:] = [e for e in heap if not e[2]._done]
                heapq.heapify(heap)
            wake = not heap or slices[0].deadline < heap[0][0]
            for s in slices:
                heapq.heappush(heap, (s.deadline, next(self._seq), s, 0))
            # The watchdog sleeps at most _WATCH_PERIOD; wake it only for an earlier deadline.
            if wake and slices[0].deadline - time.monotonic() < _WATCH_PERIOD:
                self._watch_cv.notify()

    def _watchdog(self) -> None:
        while not self._stop.is_set():
            expired: list[_Slice] = []
            with self._watch_cv:
                now = time.monotonic()
                while self._watch and (self._watch[0][2]._done or self._watch[0][0] <= now):
                    _, _, s, _ = heapq.heappop(self._watch)
                    if not s._done:
                        s._done = True
                        expired.append(s)
                if not expired:
                    wait = self._watch[0][0] - now if self._watch else _WATCH_PERIOD
                    self._watch_cv.wait(min(max(wait, 0.001), _WATCH_PERIOD))
                    continue
            for s in expired:
                # Tear the lane down before the caller hears of the timeout: once it does, it may
                # reuse the buffer, and no late bytes may land there.
                s.transport.abort(s.peer.name, s.lane)
                s.batch._slice_done(
                    s.index,
                    TransferTimeout(
                        f"{s.op.name} of {s.length} bytes missed its deadline",
                        peer=s.peer.name,
                        path=s.path,
                    ),
                )

    # -- sync helpers -----------------------------------------------------------------------
    def transfer(
        self,
        requests: Sequence[TransferRequest],
        timeout: float | None = None,
        *,
        after: Fence | None = None,
    ) -> None:
        """Submit, wait, and raise the first error (``after``: as for :meth:`submit`)."""
        if after is None and len(requests) == 1 and self._transfer_one(requests[0], timeout):
            return
        self.run(requests, timeout, after=after).raise_for_status()

    def run(
        self,
        requests: Sequence[TransferRequest],
        timeout: float | None = None,
        *,
        after: Fence | None = None,
    ) -> Batch:
        """Submit and wait, moving in this thread what its transports can move here (a shared-
        memory copy, a direct tcp exchange) instead of handing it to their threads; returns the
        finished Batch, each request's status and error on it, and raises for none of them.
        For a caller that waits anyway and wants per-request outcomes: a hand-off to another
        thread costs a wake-up, and where the cores are busy (an inference engine's worker
        spinning on the same core) a time slice."""
        batch = self.submit(requests, timeout, after=after, _inline=True)
        if batch._pending:
            batch.wait()
        return batch

    def _transfer_one(self, req: TransferRequest, timeout: float | None) -> bool:
        """``transfer`` of one request that fits one slice, to a peer already known, over a
        transport that runs it from this thread (``Transport.run_inline``): no Batch and no
        completion callbacks while all goes well. False, having done nothing, for any other
        request. An attempt that fails goes on as a submitted slice's failed first attempt
        does (retry, failover, cool-down), and a request refused by planning is reported as
        ``submit`` reports it."""
        if (
            type(req.op) is not TransferOp
            or type(req.length) is not int
            or not 0 < req.length <= self.config.slice_size
            or req.target not in self._peers  # (a first lookup takes the general path)
            or not self._started
            or self._closed
        ):
            return False
        t0 = time.perf_counter()
        deadline = time.monotonic() + (self.config.timeout if timeout is None else timeout)
        first: MooncakeConnectorsError | None = None  # a failed attempt on the short way
        route = self._routes.get(req.target)
        if route is not None:
            got = fastpath.run(self, route, req, deadline, t0)
            if got is True:
                return True
            if got is not False:
                first = got
        epoch = self.local.epoch  # (before the plan: a change meanwhile makes a stale route)
        try:
            peer, region, transport, lanes, local = self._plan(req, deadline)
        except MooncakeConnectorsError as exc:
            Batch((req,), deadline)._fail(0, exc)  # counted as ``submit`` counts it
            raise
        if not transport.runs_inline or local is None or local.device >= 0:
            return False
        s = _Slice(req.op, req.local_addr, req.remote_addr, req.length, deadline, self._on_slice)
        s.index, s.peer, s.region, s.transport = 0, peer, region, transport
        s.local_mv = local.slice(req.local_addr, req.length)
        s.lane = lanes[next(self._rr) % len(lanes)]
        s.tried = None
        err = first if first is not None else transport.run_inline(peer, s)
        if err is None:
            if self.health.any_recorded():
                self.health.succeeded(s.key)
            op = req.op._name_
            metrics.moved(transport.name, op, req.length)
            metrics.finished(op, "COMPLETED", time.perf_counter() - t0)
            if transport.runs_one:
                fastpath.remember(self, req.target, epoch, region, transport, local)
            return True
        batch = Batch((req,), deadline)
        batch._t0 = t0
        batch._left[0] = 1
        s.batch = batch
        self._on_slice(s, err)
        if batch._pending:
            batch.wait()
        batch.raise_for_status()
        return True

    def read(
        self,
        target: str,
        local_addr: int,
        remote_addr: int,
        length: int,
        timeout: float | None = None,
        *,
        after: Fence | None = None,
    ) -> None:
        req = TransferRequest(TransferOp.READ, target, local_addr, remote_addr, length)
        self.transfer([req], timeout, after=after)

    def write(
        self,
        target: str,
        local_addr: int,
        remote_addr: int,
        length: int,
        timeout: float | None = None,
        *,
        after: Fence | None = None,
    ) -> None:
        req = TransferRequest(TransferOp.WRITE, target, local_addr, remote_addr, length)
        self.transfer([req], timeout, after=after)


def _host_wait(fence: Fence, deadline: float, slices: Sequence[Slice]) -> None:
    """A path without a copy stream of ours (RDMA from GPU memory) follows the fence of its
    slices of local GPU memory from the host; a fence not reached by the deadline leaves the
    slices to time out."""
    if any(s.after is not None for s in slices) and not fence.wait(deadline):
        log.warning("the application's GPU stream did not reach the transfer's fence in time")


__all__ = ["Batch", "TransferEngine", "TransferError", "TransferRequest"]
