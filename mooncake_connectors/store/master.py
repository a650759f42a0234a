"""The master: metadata and allocation only — no data passes through it.

    master = Master(MasterConfig(port=0)).start()      # in-process, or `mooncake-connectors master`
    master.address                                     # "127.0.0.1:PORT" for clients and servers

One thread runs the control plane (:class:`.rpc.FrameServer`) and owns :class:`.state.
MasterState`; housekeeping (put-lease expiry, deferred frees, TTLs, dead servers, watermark
eviction) runs in the same thread between requests. With ``metrics_port`` set, ``/metrics``
(Prometheus) and ``/health`` (JSON) are served over HTTP. With ``ha`` set the master campaigns
through etcd (:mod:`.ha`) and answers ``NOT_LEADER`` while it is a standby; a master that becomes
leader starts empty and servers re-report what they hold (:mod:`.recovery`).
"""

from __future__ import annotations

import http.server
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ..config import bearer_ok, info_needs_token
from ..errors import ConfigError
from ..netguard import GuardedHandler, GuardedHTTPServer
from ..tls import server_context
from .config import MasterConfig
from .protocol import (
    Allocs,
    Bools,
    Code,
    Codes,
    Committed,
    Count,
    DropFiles,
    Err,
    Exists,
    FilesLost,
    Get,
    Heartbeat,
    Hello,
    HelloOk,
    Hold,
    Locs,
    Mount,
    MountOk,
    Msg,
    Ok,
    Promote,
    Promoted,
    PutEnd,
    PutReserved,
    PutStart,
    Remove,
    RemoveAll,
    Report,
    Spill,
    SpillDone,
    Stats,
    StatsOk,
    Unmount,
)
from .records import HARD, SOFT
from .recovery import collect
from .rpc import Conn, FrameServer
from .state import MasterState

log = logging.getLogger(__name__)
_TICK = 0.05
_STALL = 0.25  # a loop turn longer than this: the master itself was busy, not its servers


class Master:
    def __init__(self, config: MasterConfig | None = None) -> None:
        self.cfg = config or MasterConfig()
        self.state = MasterState(self.cfg)
        self.leader = self.cfg.ha is None
        self.rpc: FrameServer | None = None
        self._election: Any = None
        self._http: http.server.ThreadingHTTPServer | None = None
        self._next_tick = 0.0
        self._turn = 0.0  # when the loop last came back to us (monotonic)
        # What servers hold must be on its way to them before a put is acknowledged, with HA or
        # without: a new leader, or a single master restarted, rebuilds only from what servers
        # re-report, so a delta still waiting for the next tick would be an acknowledged put lost.
        self._sync_holdings = True
        self._snapshot: dict[str, float] = {}
        self._handlers: dict[type, Callable[[Conn, Any, float], Msg | None]] = {
            Hello: self._hello,
            Mount: self._mount,
            Unmount: self._unmount,
            Heartbeat: self._heartbeat,
            PutStart: self._put_start,
            PutEnd: self._put_end,
            PutReserved: self._put_reserved,
            Get: self._get,
            Exists: self._exists,
            Remove: self._remove,
            RemoveAll: self._remove_all,
            Report: self._report,
            SpillDone: self._files_done,
            Promoted: self._files_done,
            FilesLost: self._files_lost,
            Stats: self._stats,
        }

    # -- lifecycle --------------------------------------------------------------------------
    @property
    def address(self) -> str:
        if self.rpc is None:
            raise ConfigError("master not started")
        return self.cfg.advertise or self.rpc.address

    @property
    def metrics_port(self) -> int | None:
        return None if self._http is None else int(self._http.server_address[1])

    def start(self) -> Master:
        cfg = self.cfg
        self.rpc = FrameServer(
            cfg.host,
            cfg.port,
            self._handle,
            tick=self._tick,
            max_frame=cfg.max_frame,
            max_inflight=cfg.max_inflight,
            max_buffered=cfg.max_buffered,
            frame_timeout=cfg.frame_timeout,
            name="mc-store-master",
            token=cfg.auth_token,
            tls=cfg.tls,
        )
        self.rpc.start()
        if cfg.metrics_port is not None:
            self._serve_http(cfg.host, cfg.metrics_port)
        if cfg.ha is not None:
            from .ha import LeaderElection

            self._election = LeaderElection(
                cfg.ha, self.address, cfg.ha_lease_ttl, self._on_leadership
            ).start()
        log.info("store master on %s (%s)", self.address, "HA" if cfg.ha else "single")
        return self

    def close(self) -> None:
        if self._election is not None:
            self._election.stop()
        if self.rpc is not None:
            self.rpc.stop()
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()

    def __enter__(self) -> Master:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait(self) -> None:
        """Block until the control plane stops (the CLI's foreground mode)."""
        t = self.rpc._thread if self.rpc is not None else None
        while t is not None and t.is_alive():
            t.join(timeout=1.0)

    def _on_leadership(self, leading: bool) -> None:
        def switch() -> None:
            # A new leader starts from nothing: servers re-report what they hold.
            self.state = MasterState(self.cfg)
            self.leader = leading

        if self.rpc is not None:
            self.rpc.call_soon(switch)

    # -- loop -------------------------------------------------------------------------------
    def _tick(self) -> float:
        now = time.monotonic()
        if self._turn and now - self._turn > _STALL:
            self._excuse(now - self._turn)
        self._turn = now
        if now >= self._next_tick:
            if self.leader:
                self.state.tick(now)
                self._flush()
            self._snapshot = self._stats_now()
            self._next_tick = now + _TICK
        return self._next_tick - now

    def _excuse(self, busy: float) -> None:
        """The loop was busy for ``busy`` seconds (a large request, a rebuild, a pause of the
        process): heartbeats sent meanwhile still wait unread in their sockets, so that time is
        not counted against any server; a server is declared gone only after server_ttl of this
        master listening and hearing nothing."""
        for rec in self.state.servers.values():
            rec.last_seen += busy

    def _handle(self, conn: Conn, msg: Msg, flags: int) -> Msg | None:
        if not self.leader:  # clients and servers read the leader from etcd themselves
            return Err(int(Code.NOT_LEADER), f"{self.address} is a standby master")
        handler = self._handlers.get(type(msg))
        if handler is None:
            return Err(int(Code.INVALID), f"{type(msg).__name__} is not a master request")
        reply = handler(conn, msg, time.monotonic())
        dirty = self.state.dirty
        if dirty and (
            self._sync_holdings or any(r.spills or r.dropfiles or r.promotes for r in dirty)
        ):
            self._flush()
        return reply

    def _flush(self) -> None:
        """Send servers their holdings deltas, spills and file drops (before any reply)."""
        rpc = self.rpc
        if rpc is None:  # not serving (state driven directly): kept until there is a way out
            return
        keep = set()
        for rec in self.state.dirty:
            conn = rec.conn
            if conn is None or conn.closed:
                keep.add(rec)  # delivered once it reconnects (its next heartbeat)
                continue
            # Drops before spills: a spill into a full SSD comes with the drop that makes its
            # room, and the server, which works through them in order, refuses a write past
            # its budget (the spill would fail and its object be dropped as well).
            orders: tuple[tuple[list[Any], Callable[[Any], Msg]], ...] = (
                (rec.ops, Hold),
                (rec.dropfiles, DropFiles),
                (rec.spills, Spill),
                (rec.promotes, Promote),
            )
            for items, message in orders:
                if items:
                    rpc.push(conn, message(items))
            rec.ops, rec.spills, rec.dropfiles, rec.promotes = [], [], [], []
        self.state.dirty = keep

    # -- handlers ---------------------------------------------------------------------------
    def _hello(self, conn: Conn, msg: Hello, now: float) -> Msg:
        cfg = self.cfg
        return HelloOk(
            cfg.metadata,
            cfg.stripe_size,
            int(cfg.put_lease_ttl * 1000),
            int(cfg.read_lease_ttl * 1000),
            int(cfg.heartbeat_interval * 1000),
            self.state.epoch,
            cfg.max_frame,
        )

    def _mount(self, conn: Conn, msg: Mount, now: float) -> Msg:
        rec = self.state.server(msg.client_id, conn, now)
        try:
            seg = self.state.mount(
                rec,
                msg.segment,
                msg.base,
                msg.size,
                msg.host_id,
                msg.endpoint,
                msg.ssd_size,
                msg.recover,
            )
        except (ConfigError, ValueError) as exc:
            return Err(int(Code.INVALID), str(exc))
        conn.data = rec
        return MountOk(seg.id)

    def _unmount(self, conn: Conn, msg: Unmount, now: float) -> Msg:
        rec = self.state.servers.get(msg.client_id)
        if rec is None or not self.state.unmount(rec, msg.segment, now):
            return Err(int(Code.NOT_FOUND), f"no segment {msg.segment!r} of {msg.client_id}")
        return Ok()

    def _heartbeat(self, conn: Conn, msg: Heartbeat, now: float) -> Msg:
        rec = self.state.servers.get(msg.client_id)
        if rec is None or not rec.alive:
            return Err(int(Code.UNKNOWN_CLIENT), "unknown server: mount again")
        rec.last_seen = now
        rec.conn = conn
        conn.data = rec
        if rec.ops or rec.spills or rec.dropfiles or rec.promotes:
            self.state.dirty.add(rec)
        return Ok()

    def _put_start(self, conn: Conn, msg: PutStart, now: float) -> Msg:
        if len(msg.keys) != len(msg.sizes):
            return Err(int(Code.INVALID), "keys and sizes differ in length")
        flags = (HARD if msg.hard_pin else 0) | (SOFT if msg.soft_pin else 0)
        codes, stripes = self.state.put_start(
            msg.put_id,
            msg.keys,
            msg.sizes,
            msg.replicas,
            msg.ttl_ms,
            flags,
            msg.preferred,
            now,
        )
        spare = None
        if msg.reserve and len(msg.keys) == 1 and codes[0] == Code.OK:
            spare = self.state.reserve(msg.sizes[0], len(stripes[0][0]) if stripes[0] else 1, now)
        return Allocs(codes, stripes, spare)

    def _put_reserved(self, conn: Conn, msg: PutReserved, now: float) -> Msg:
        flags = (HARD if msg.hard_pin else 0) | (SOFT if msg.soft_pin else 0)
        code, nrep = self.state.commit_reserved(msg.rid, msg.key, msg.size, flags, msg.ttl_ms, now)
        if code == Code.PUT_EXPIRED:
            code = self._expired(msg.rid, msg.key, now)
        spare = None
        if code == Code.OK and msg.refill and nrep:  # (no nrep: a repeat this master never saw)
            spare = self.state.reserve(msg.size, nrep, now)
        return Committed(code, spare)

    def _put_end(self, conn: Conn, msg: PutEnd, now: float) -> Msg:
        codes = self.state.put_end(msg.put_id, msg.commit, msg.revoke, now)
        for i, key in enumerate(msg.commit):
            if codes[i] == Code.PUT_EXPIRED:
                codes[i] = self._expired(msg.put_id, key, now)
        return Codes(codes)

    def _expired(self, put_id: int, key: str, now: float) -> int:
        """The answer to a commit of an allocation this master does not know."""
        if (put_id, key) in self.state.recent:
            return Code.OK  # a repeated commit whose first reply was lost
        if self.state.settling(now):
            return Code.BUSY  # a new master: its servers may still re-report this commit
        return Code.PUT_EXPIRED

    def _get(self, conn: Conn, msg: Get, now: float) -> Msg:
        return Locs(self.state.get(msg.keys, now))

    def _exists(self, conn: Conn, msg: Exists, now: float) -> Msg:
        return Bools(self.state.exists(msg.keys, now))

    def _remove(self, conn: Conn, msg: Remove, now: float) -> Msg:
        return Codes(self.state.remove(msg.keys, msg.force, now))

    def _remove_all(self, conn: Conn, msg: RemoveAll, now: float) -> Msg:
        return Count(self.state.remove_all(msg.force, now))

    def _report(self, conn: Conn, msg: Report, now: float) -> Msg:
        rec = self.state.servers.get(msg.client_id)
        if rec is None or not rec.alive:
            return Err(int(Code.UNKNOWN_CLIENT), "mount before reporting")
        collect(self.state, rec, msg.parts, msg.done, now)
        return Ok()

    def _files_done(self, conn: Conn, msg: SpillDone | Promoted, now: float) -> Msg:
        done = self.state.spill_done if isinstance(msg, SpillDone) else self.state.promote_done
        for fid, ok in msg.results:
            done(msg.client_id, fid, ok, now)
        return Ok()

    def _files_lost(self, conn: Conn, msg: FilesLost, now: float) -> Msg:
        rec = self.state.servers.get(msg.client_id)
        if rec is not None:
            for fid in msg.file_ids:
                self.state.file_lost(rec, fid)
        return Ok()

    def _stats(self, conn: Conn, msg: Stats, now: float) -> Msg:
        return StatsOk(self._stats_now())

    def _stats_now(self) -> dict[str, float]:
        unsent = float(self.rpc.buffered) if self.rpc is not None else 0.0
        return {**self.state.stats(), "leader": float(self.leader), "unsent_bytes": unsent}

    # -- /metrics and /health ---------------------------------------------------------------
    def _serve_http(self, host: str, port: int) -> None:
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        master = self
        token = self.cfg.auth_token or ""
        tls = self.cfg.tls
        # with mutual TLS every scraper already presented a CA-signed certificate
        guarded = info_needs_token(host, token) and not (tls is not None and tls.mutual)
        registry = CollectorRegistry(auto_describe=False)
        counters = set(self.state.counters)

        class Collector:
            def collect(self) -> Iterator[Any]:
                for name, value in sorted(master._snapshot.items()):
                    full = f"mooncake_connectors_store_{name}"
                    if name in counters:
                        yield CounterMetricFamily(full, f"store master: {name}", value=value)
                    else:
                        yield GaugeMetricFamily(full, f"store master: {name}", value=value)

        registry.register(Collector())  # type: ignore[arg-type]

        class Handler(GuardedHandler):
            def log_message(self, format: str, *args: object) -> None:
                log.debug("http %s", format % args)

            def do_GET(self) -> None:
                if guarded and not bearer_ok(self.headers.get("Authorization"), token):
                    self.send_error(401, "missing or wrong token")
                    return
                if self.path.startswith("/metrics"):
                    body, ctype = generate_latest(registry), "text/plain; version=0.0.4"
                elif self.path.startswith("/health"):
                    snap = master._snapshot
                    body = json.dumps(
                        {
                            "status": "ok",
                            "role": "leader" if master.leader else "standby",
                            "address": master.address,
                            "keys": int(snap.get("keys", 0)),
                            "servers": int(snap.get("servers", 0)),
                        }
                    ).encode()
                    ctype = "application/json"
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        ctx = server_context(tls) if tls is not None and tls.cert is not None else None
        self._http = GuardedHTTPServer((host, port), Handler, tls=ctx)
        threading.Thread(target=self._http.serve_forever, name="mc-store-http", daemon=True).start()
