"""The ``rdma`` transport: one-sided RDMA READ/WRITE over RC queue pairs, sprayed over rails.

A slice from the engine is cut into work requests of ``slice_size`` bytes (64 KiB by default,
Mooncake's). Each goes to the rail that would finish it first, counting what the rail already
holds at its measured rate (TENT-style scoring), among the rails whose local NIC is nearest the
local memory (topology.py) and which are not cooling down. A rail that fails (error completion,
QP in ERR, no completion within ``rail_timeout``, NIC gone) cools down with the engine's
decaying backoff and its requests move to other rails; when none is left the slice fails with
TransportBroken and the engine moves it to the next transport (tcp) within its deadline. A
refused rkey or bounds is AccessViolation, never retried.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ....config import EngineConfig, ib_qos_from_env
from ....errors import (
    AccessViolation,
    ConfigError,
    MooncakeConnectorsError,
    TransferTimeout,
    TransportBroken,
    TransportClosed,
)
from ....types import LocationKind, TransferOp
from ...descriptor import RegionDesc, SegmentDesc
from ...health import PathHealth
from ...memory import Region
from ...transport import Slice, Transport, TransportContext, load_settings
from ..tcp_server import TcpServer
from . import control
from .direct import READY, Direct
from .fastverbs import fast_module
from .memlock import check_memlock
from .mrs import Registry
from .nicstate import NicState
from .passive import _REAP_EVERY, PassiveSide
from .preflight import open_nics
from .rails import WR, Rail, RailOwner, Work, too_late
from .settings import RdmaSettings as RdmaSettings  # where doctor and peers import it
from .topology import Topology
from .verbs import Nic, QpAddr, Verbs

log = logging.getLogger(__name__)


class _Peer:
    def __init__(self, desc: SegmentDesc, rails: list[Rail]) -> None:
        self.incarnation = _incarnation(desc)
        self.desc = desc
        self.rails = rails
        # the direct way's caches (direct.py), dropped when the descriptor changes
        self.direct_remote: Any = None
        self.direct_pick: Any = None


def _incarnation(d: SegmentDesc) -> tuple[object, ...]:
    return (d.host_id, d.pid, d.endpoints.get("rdma"), tuple(sorted(d.rdma_gids.items())))


class RdmaTransport(PassiveSide, Transport, RailOwner):
    name = "rdma"
    Settings = RdmaSettings

    def __init__(self, ctx: TransportContext) -> None:
        super().__init__(ctx)
        cfg: EngineConfig = ctx.config
        self.settings = st = load_settings(RdmaSettings, self.name, cfg)
        self.max_wr, self.signal_every, self.rail_timeout = (
            st.max_wr,
            st.signal_every,
            st.rail_timeout,
        )
        self.health = PathHealth(cfg.backoff_initial, cfg.backoff_max)
        self.verbs: Verbs | None = None
        self.nics: dict[str, NicState] = {}
        self.registry: Registry | None = None
        self.topology = Topology()
        self._peers: dict[str, _Peer] = {}
        self._passive: dict[tuple[str, str, str, bool], tuple[Nic, object]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._server: TcpServer | None = None
        self._closed = False
        self._reaped = -_REAP_EVERY
        self._direct: Direct | None = None

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> dict[str, str]:
        st = self.settings
        verbs = self.verbs = Verbs(st.verbs)
        check_memlock(st.min_memlock)
        env = ib_qos_from_env()
        tc = st.traffic_class if st.traffic_class >= 0 else env.get("traffic_class", 0)
        sl = st.service_level if st.service_level >= 0 else env.get("service_level", 0)
        opened, skipped = open_nics(verbs, st)  # the same choice `doctor` reports
        errors = [s.why for s in skipped]
        if not opened:
            raise ConfigError("no usable RDMA device: " + "; ".join(errors))
        for msg in errors:
            log.warning("rdma: skipping a device: %s", msg)
        for nic in opened:
            nic.traffic_class, nic.service_level = tc, sl
            state = NicState(nic, self._stop)
            self.nics[nic.name] = state
            state.thread.start()
        self.registry = Registry(opened, st.gpu_mr)
        self.topology = Topology.read(st.sysfs)
        if st.direct_qps and all(n.compiled for n in opened):
            self._direct = Direct(self, fast_module())
            self.runs_one = self.runs_inline = True
        self._server = TcpServer(self.ctx, control=self._on_connect, data=False, port=0)
        host = self.ctx.config.host
        host = f"[{host}]" if ":" in host else host
        return {"rdma": f"{host}:{self._server.port}"}

    def describe_segment(self) -> Mapping[str, object]:
        live = [s.nic for s in self.nics.values() if s.dead is None]
        return {
            "rdma_gids": {n.name: n.gid for n in live},
            "rdma_lids": {n.name: n.lid for n in live},
        }

    def describe_region(self, region: Region) -> Mapping[str, object]:
        if self.registry is None:
            return {}
        kind = region.to_desc().kind
        if kind not in (LocationKind.CPU, LocationKind.CUDA):
            return {}
        mr = self.registry.get(region)
        names = list(self.nics)
        near = self.topology.preferred(mr.where(), names)
        return {
            "rdma_rkeys": mr.rkeys(),
            "rdma_iova": dict(mr.iova),
            # peers aim at these NICs: a far one DMAs across the host bridge or the sockets
            "rdma_near": {n: 1 for n in near} if len(near) < len(names) else {},
        }

    def local_changed(self, epoch: int) -> None:
        """Deregister the MRs of regions that were unregistered, once nothing uses them."""
        if self.registry is None:
            return
        if self._direct is not None:
            self._direct.local_changed()
        live = {(r.addr, r.length) for r in self.ctx.local.regions()}
        for mr in self.registry.dropped(live):
            # Work requests finish or are failed by the engine at their deadline (which takes
            # their QP down); this waits for that, not longer.
            if not mr.drain(time.monotonic() + self.ctx.config.timeout + 1.0):
                log.warning("rdma: deregistering a region still in use; taking its rails down")
                for p in list(self._peers.values()):
                    for r in p.rails:
                        r.broke(TransportBroken("region deregistered while in use"), cool=False)
            self.registry.close(mr)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            peers = list(self._peers.values())
            self._peers.clear()
            passive = list(self._passive.values())
            self._passive.clear()
        self._stop.set()
        if self._direct is not None:
            self._direct.close()
        if self._server is not None:
            self._server.close()
        err = TransportClosed("rdma transport closed")
        for p in peers:
            for r in p.rails:
                r.close(err)
        for nic, qp in passive:
            nic.destroy(qp)
        for state in self.nics.values():
            state.wake.set()
            state.thread.join(1.0)
        # a caller still waiting on a direct QP (in C) is done within rail_timeout; its device
        # must outlive that wait, so a device is left open rather than closed under it
        busy = False
        for d in [r.direct for p in peers for r in p.rails if r.direct is not None]:
            if d.lock.acquire(timeout=self.rail_timeout + 1.0):
                d.take_down()
                d.lock.release()
            else:
                busy = True
        if busy:
            log.warning("rdma: a transfer still waits on a direct QP; its NICs are left open")
            return
        if self.registry is not None:
            self.registry.close_all()
        for state in self.nics.values():
            state.nic.close()

    # -- routing ----------------------------------------------------------------------------
    def serves(self, local: LocationKind, remote: LocationKind) -> bool:
        # host and GPU memory alike: GPU regions get dma-buf or peermem MRs (mrs.py)
        kinds = (LocationKind.CPU, LocationKind.CUDA)
        return local in kinds and remote in kinds

    def reachable(self, peer: SegmentDesc, region: RegionDesc) -> bool:
        if "rdma" not in peer.endpoints or not self.nics:
            return False
        return any(n in peer.rdma_gids for n in region.rdma_rkeys)

    def _peer(self, desc: SegmentDesc) -> _Peer:
        p = self._peers.get(desc.name)
        if p is not None and p.incarnation == _incarnation(desc):
            if p.desc is not desc:  # refreshed: its regions (and rkeys) may have changed
                p.desc, p.direct_remote, p.direct_pick = desc, None, None
            return p
        with self._lock:
            if self._closed:
                raise TransportClosed("rdma transport closed", peer=desc.name)
            p = self._peers.get(desc.name)
            if p is not None and p.incarnation == _incarnation(desc):
                return p
            old = p
            bw = 12.5e9  # a 100 Gbps guess until the first completions are measured
            rails = [
                Rail(self, desc.name, state, remote, bw)
                for state in self.nics.values()
                for remote in sorted(desc.rdma_gids)
            ]
            p = self._peers[desc.name] = _Peer(desc, rails)
        if old is not None:  # the peer restarted: its QPs are gone
            for r in old.rails:
                r.close(TransportBroken("peer restarted", peer=desc.name))
        return p

    def _pick(
        self, wr: WR, rails: list[Rail], now: float, extra: dict[int, int] | None = None
    ) -> Rail | None:
        ok = [
            r
            for r in rails
            if r.remote_nic in wr.rkeys
            and r.id not in wr.tried
            and r.nic.dead is None
            and not r.nic.down
            and self.health.usable(r.key, now)
        ]
        near = [r for r in ok if r.nic.nic.name in wr.work.preferred]
        pool = near or ok
        # and the remote NICs nearest the remote memory, as its owner published them
        if wr.work.remote_near:
            pool = [r for r in pool if r.remote_nic in wr.work.remote_near] or pool
        if not pool:
            return None
        if extra is None:
            return min(pool, key=lambda r: r.predicted(wr.length))
        # requests of this submission not yet enqueued count as load too
        return min(pool, key=lambda r: r.predicted(wr.length + extra.get(r.id, 0)))

    def submit(
        self, peer: SegmentDesc, slices: Sequence[Slice], *, inline_ok: bool = False
    ) -> None:
        try:
            p = self._peer(peer)
        except MooncakeConnectorsError as exc:
            for s in slices:
                s.complete(exc)
            return
        if slices and self._direct is not None and not self._closed:
            if not inline_ok:  # the direct QPs' thread takes it, unless it is busy
                if self._direct.offer(p, slices):
                    return
            elif self._direct.finish(slices, self._direct.run_slices(p, slices)):
                return  # the caller waits: run on the direct QPs from its thread
        self._rails(p, slices, inline_ok)

    def _rails(self, p: _Peer, slices: Sequence[Slice], inline_ok: bool = False) -> None:
        peer = p.desc
        size = self.settings.slice_size
        now = time.monotonic()
        by_rail: dict[int, tuple[Rail, list[WR]]] = {}
        extra: dict[int, int] = {}
        works: list[Work] = []
        for s, more in coalesce(slices, self._run_bytes(size)):
            s.path = "rdma"
            for m in more:
                m.path = "rdma"
            try:
                wrs = self._cut(s, size, p, more)
            except MooncakeConnectorsError as exc:
                if not more:
                    s.complete(exc)
                    continue
                # a coalesced range was refused: cut its slices one by one, each its own error
                wrs = []
                for one in (s, *more):
                    try:
                        wrs += self._cut(one, size, p)
                    except MooncakeConnectorsError as exc1:
                        one.complete(exc1)
            works.extend({id(w.work): w.work for w in wrs}.values())
            for wr in wrs:
                rail = self._pick(wr, p.rails, now, extra)
                if rail is None:
                    wr.end(TransportBroken("no usable rdma rail", peer=peer.name, path="rdma"))
                    continue
                by_rail.setdefault(rail.id, (rail, []))[1].append(wr)
                extra[rail.id] = extra.get(rail.id, 0) + wr.length
        for rail, wrs in by_rail.values():
            rail.enqueue(wrs)
        if inline_ok and by_rail:
            self._wait_inline(works, [r for r, _ in by_rail.values()])

    # -- one request whose caller waits: direct QPs (direct.py), on the compiled path only ---
    def run_one(
        self,
        peer: SegmentDesc,
        op: TransferOp,
        remote: int,
        local: int,
        length: int,
        deadline: float,
    ) -> MooncakeConnectorsError | bool:
        p = self._peers.get(peer.name)
        if p is None or p.desc is not peer:
            try:
                p = self._peer(peer)
            except MooncakeConnectorsError:
                return False
        if self._direct is None or self._closed:
            return False
        return self._direct.run(p, op, remote, local, length, deadline)

    def run_inline(self, peer: SegmentDesc, s: Slice) -> MooncakeConnectorsError | None:
        try:
            p = self._peer(peer)
        except MooncakeConnectorsError as exc:
            return exc
        s.path = "rdma"
        if self._direct is not None and s.local_device < 0:
            got = self._direct.run(
                p, s.op, s.remote_addr, s.local_addr, s.length, s.deadline, s.region
            )
            if got is True:
                return None
            if got is not False:
                return got
        # the rails, waited for here: a Slice of our own reports to this call, not the engine
        out: list[MooncakeConnectorsError | None] = []
        mine = Slice(s.op, s.local_addr, s.remote_addr, s.length, s.deadline,
                     lambda _s, err: out.append(err))  # fmt: skip
        mine.region, mine.local_device, mine.lane = s.region, s.local_device, s.lane
        self._rails(p, [mine], inline_ok=True)  # (the direct QPs just declined it)
        if out:
            return out[0]
        return TransferTimeout("the request's deadline passed on rdma", peer=peer.name)

    def _wait_inline(self, works: list[Work], rails: list[Rail]) -> None:
        """The caller waits anyway: poll its NICs from its thread (no hand-off to the poller
        and back), until its slices are done or their deadline passes. The engine does not
        watch such slices, so at the deadline their rails are taken down here: no late bytes."""
        deadline = min(w.slice.deadline for w in works)
        nics = {r.nic for r in rails}
        spins = 0
        while time.monotonic() < deadline and not self._closed:
            if all(w.done for w in works):
                return
            if any([state.poll_once() for state in nics]):
                spins = 0
                continue
            spins += 1
            time.sleep(0 if spins < 64 else 0.0002)
        if not all(w.done for w in works):
            for r in {r.id: r for w in works for r in w.peer.rails}.values():
                if any(wr.work in works for wr in [*r.outstanding, *r.queue]):
                    r.broke(TransportBroken("deadline passed", path=r.path), cool=False)

    def _run_bytes(self, size: int) -> int:
        """Bytes per request the rails queue: one WR of ``size`` on the pyverbs path; on the
        compiled path a run of WRs posted as one chain, at most a quarter of what a QP or the
        smallest CQ holds (so a run always fits once the rail drains)."""
        states = list(self.nics.values())
        if not states or not all(st.nic.compiled for st in states):
            return size
        slots = min(min(self.max_wr, st.nic.max_qp_wr, st.nic.cq_size) for st in states)
        return size * max(1, slots // 4)

    def _cut(self, s: Slice, size: int, peer: _Peer, more: tuple[Slice, ...] = ()) -> list[WR]:
        """Cut ``s`` (with ``more``, adjacent slices coalesced after it) into requests."""
        region, name = s.region, peer.desc.name
        length = s.length + sum(m.length for m in more)
        if region is None or not region.contains(s.remote_addr, length):
            raise AccessViolation("remote range outside the peer's region", peer=name, path="rdma")
        local = self.ctx.local.find(s.local_addr, length)
        if local is None or self.registry is None:
            raise AccessViolation("local range is not registered", peer=name, path="rdma")
        mr = self.registry.get(local)
        near = frozenset(self.topology.preferred(mr.where(), list(self.nics)))
        run = self._run_bytes(size)
        if run > size:
            # spread a request over the rails it may use: at least one run per rail
            rails = max(1, len(peer.rails))
            share = -(-length // rails)  # bytes per rail, rounded up to whole WRs
            run = min(run, max(size, -(-share // size) * size))
        work = Work(s, -(-length // run), near, peer, frozenset(region.rdma_near))
        work.more = more
        rkeys = region.rdma_rkeys
        # a peer's dma-buf MR is addressed from its iova: the shift from its address, per NIC
        shift = {n: base - region.addr for n, base in region.rdma_iova.items()}
        la, ra = s.local_addr, s.remote_addr
        if run == size:
            wrs = [
                WR(work, la + o, ra + o, min(size, length - o), mr, rkeys, shift)
                for o in range(0, length, size)
            ]
        else:
            wrs = []
            for o in range(0, length, run):
                n = min(run, length - o)
                wrs.append(WR(work, la + o, ra + o, n, mr, rkeys, shift, part=size,
                              parts=-(-n // size)))  # fmt: skip
        mr.acquire(len(wrs))
        return wrs

    # -- RailOwner --------------------------------------------------------------------------
    def exchange(self, rail: Rail, ours: QpAddr, direct: bool = False) -> QpAddr:
        p = self._peers.get(rail.peer)
        if p is None:
            raise TransportBroken("peer forgotten", peer=rail.peer)
        nic = rail.nic.nic
        req = control.ConnectRequest(
            self.ctx.segment_name(),
            nic.name,
            rail.remote_nic,
            ours.qpn,
            ours.psn,
            nic.gid,
            nic.lid,
            nic.mtu,
            direct,
        )
        deadline = time.monotonic() + self.ctx.config.connect_timeout
        return control.exchange(self.ctx, rail.peer, p.desc.endpoints["rdma"], req, deadline)

    def rail_ok(self, rail: Rail) -> None:
        self.health.succeeded(rail.key)

    def rail_failed(self, rail: Rail, err: MooncakeConnectorsError) -> None:
        if self.health.usable(rail.key):  # one failure breaks many requests: count it once
            delay = self.health.failed(rail.key)
            log.info("rdma rail %s cools down %.2fs: %s", rail.path, delay, err)

    def reroute(self, wr: WR, err: MooncakeConnectorsError) -> None:
        if self._closed:
            wr.end(TransportClosed("rdma transport closed", peer=None))
            return
        late = too_late(wr)
        if late is not None or wr.work.done:
            wr.end(late or err)
            return
        peer: _Peer = wr.work.peer
        rail = self._pick(wr, peer.rails, time.monotonic())
        if rail is None:
            wr.end(TransportBroken(f"every rdma rail failed; last error: {err}", path="rdma"))
            return
        rail.enqueue([wr])

    def abort(self, peer_name: str, lane: int) -> None:
        p = self._peers.get(peer_name)
        for r in p.rails if p is not None else []:
            r.broke(TransportBroken("aborted after a missed deadline", peer=peer_name), cool=False)

    def rail_stats(self, peer_name: str) -> dict[str, dict[str, float]]:
        """Per rail to ``peer_name`` ("LOCAL>REMOTE"): WRs carried (its direct QP's too),
        measured bytes/s, whether it is cooling down, whether its direct QP is connected and
        the WRs it carried."""
        p = self._peers.get(peer_name)
        now = time.monotonic()
        return {
            f"{r.nic.nic.name}>{r.remote_nic}": {
                "carried": float(r.carried + r.direct_carried),
                "bw": r.bw,
                "cooling": float(not self.health.usable(r.key, now)),
                "direct": float(r.direct is not None and r.direct.state == READY),
                "direct_carried": float(r.direct_carried),
            }
            for r in (p.rails if p is not None else [])
        }


def coalesce(slices: Sequence[Slice], limit: int) -> list[tuple[Slice, tuple[Slice, ...]]]:
    """Adjacent slices (same op, same deadline, local and remote ranges each continuing the
    previous one, as a layer's KV blocks often are) joined into one range of at most ``limit``
    bytes: each entry is the first slice and the ones that continue it."""
    out: list[tuple[Slice, tuple[Slice, ...]]] = []
    if not slices:
        return out
    head = slices[0]
    tail: list[Slice] = []
    end_l, end_r, total = head.local_addr + head.length, head.remote_addr + head.length, head.length
    for s in slices[1:]:
        if (
            s.local_addr == end_l
            and s.remote_addr == end_r
            and s.op is head.op
            and s.region is head.region
            and s.deadline == head.deadline
            and total + s.length <= limit
        ):
            tail.append(s)
            end_l += s.length
            end_r += s.length
            total += s.length
            continue
        out.append((head, tuple(tail)))
        head, tail = s, []
        end_l, end_r, total = s.local_addr + s.length, s.remote_addr + s.length, s.length
    out.append((head, tuple(tail)))
    return out
