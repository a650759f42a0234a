"""The fetcher: pull every chunk of one pinned version from the swarm, verify, serve onward.

The main thread plans (rarest first, at most ``k`` requests in flight per holder) and keeps the
books; worker threads each ask a holder for a grant, READ the chunk through the transfer engine
straight into the destination's registered memory, and hash it there. A chunk that passes is
served onward at once (the holder's grant server answers from the same bitmap); one that fails
marks that holder bad for that chunk, and the chunk goes back to the pool for another holder.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import MetadataError, MooncakeConnectorsError
from ..transfer_core.engine import TransferEngine
from ..transfer_core.memory import Region
from .manifest import FetchFailed, Manifest, digest
from .records import Catalog, bitmap, merge
from .schedule import PeerView, pick
from .serve import Answer, Grant, GrantClient, Have, Holder, Served

log = logging.getLogger(__name__)


@dataclass
class FetchStats:
    """What one fetch did; ``verified`` chunks were already in place (a resumed fetch)."""

    name: str
    version: int
    chunks: int
    total_bytes: int
    verified: int = 0
    fetched: int = 0
    fetched_bytes: int = 0
    corrupt: int = 0  # chunks that failed their hash (each refetched from another holder)
    refusals: int = 0  # grants answered wait/missing/capped, or not answered
    peers: int = 0  # holders known at the last look
    from_holder: dict[str, int] = field(default_factory=dict)  # bytes per holder
    seconds: float = 0.0

    @property
    def done_bytes(self) -> int:
        return self.fetched_bytes + self.verified_bytes

    verified_bytes: int = 0


@dataclass
class _Outcome:
    chunk: int
    holder: str
    status: str  # ok | corrupt | dead | wait | missing | capped | refused | broken
    have: bytes = b""
    wait: float = 0.0
    error: str = ""


class Fetcher:
    def __init__(
        self,
        engine: TransferEngine,
        catalog: Catalog,
        holder: Holder,
        manifest: Manifest,
        regions: list[Region | None],
        *,
        k: int = 4,
        parallel: int = 8,
        grant_timeout: float = 2.0,
        refresh: float = 0.5,
        seed: int | None = None,
        share: bool = True,
        on_progress: Callable[[FetchStats], None] | None = None,
    ) -> None:
        self.engine = engine
        self.catalog = catalog
        self.holder = holder
        self.m = manifest
        self.regions = regions
        self.k = k
        self.parallel = parallel
        self.grant_timeout = grant_timeout
        self.refresh = refresh
        self.rng = random.Random(seed)
        self.on_progress = on_progress
        self.share = share
        self.peers: dict[str, PeerView] = {}
        self.stats = FetchStats(
            manifest.name, manifest.version, len(manifest.chunks), manifest.total_size
        )
        self._local = threading.local()
        self._clients: list[GrantClient] = []
        self._clients_lock = threading.Lock()
        self.served: Served | None = None
        self._idle = threading.Event()  # never set: a bounded pause while nobody offers chunks
        self._answers: queue.SimpleQueue[tuple[str, Answer | None]] = queue.SimpleQueue()
        self._probing: set[str] = set()  # holders asked what they have, no answer taken yet

    # -- verification of what is already there (resume) --------------------------------------
    def verify_existing(self, files: set[int]) -> bytearray:
        """Hash the chunks of ``files`` (those that were there before): keep each that matches."""
        have = bitmap(len(self.m.chunks))
        for i, ch in enumerate(self.m.chunks):
            if ch.file not in files:
                continue  # created empty just now: nothing to find, nothing to hash
            region = self.regions[ch.file]
            assert region is not None
            if digest(region.slice(region.addr + ch.offset, ch.length)) == ch.sha256:
                have[i // 8] |= 1 << (i % 8)
                self.stats.verified += 1
                self.stats.verified_bytes += ch.length
        return have

    # -- the loop ---------------------------------------------------------------------------
    def run(self, have: bytearray, timeout: float) -> FetchStats:
        t0 = time.monotonic()
        deadline = t0 + timeout
        needed = {i for i in range(len(self.m.chunks)) if not have[i // 8] >> (i % 8) & 1}
        self.served = served = self.holder.add(self.m, self.regions, have, share=self.share)
        inflight: dict[cf.Future[_Outcome], tuple[int, str]] = {}
        probe: cf.Future[None] | None = None
        next_look = 0.0
        self._report()
        with cf.ThreadPoolExecutor(self.parallel, thread_name_prefix="mc-p2p-fetch") as pool:
            try:
                while needed or inflight:
                    now = time.monotonic()
                    if now > deadline:
                        raise FetchFailed(
                            f"{self.m.name} v{self.m.version}: {len(needed)} of "
                            f"{len(self.m.chunks)} chunks missing after {timeout:.0f}s "
                            f"({len(self.peers)} holders known)",
                            name=self.m.name,
                        )
                    if now >= next_look:
                        self._look()
                        next_look = now + self.refresh
                    self._heard(now)
                    if probe is None or probe.done():
                        untried = [
                            p
                            for p in self.peers.values()
                            if not p.answered and p.holder not in self._probing and p.usable(now)
                        ]
                        if untried:
                            self._probing.update(p.holder for p in untried)
                            probe = pool.submit(self._probe, untried)
                    free = [c for c in needed if all(c != v[0] for v in inflight.values())]
                    # Only holders that answered get chunk requests (each may cost a timeout).
                    proven = {h: p for h, p in self.peers.items() if p.answered}
                    busy = len(inflight) + (probe is not None and not probe.done())
                    for c, h in pick(
                        free, proven, self.k, rng=self.rng, limit=self.parallel - busy, now=now
                    ):
                        self.peers[h].inflight += 1
                        inflight[pool.submit(self._get, c, self.peers[h])] = (c, h)
                    if not inflight:
                        # Nobody offers what we lack right now: look again soon.
                        next_look = min(next_look, now + 0.1)
                        self._idle.wait(min(0.1, max(0.0, deadline - now)))
                        continue
                    done, _ = cf.wait(list(inflight), timeout=0.2, return_when=cf.FIRST_COMPLETED)
                    for fut in done:
                        inflight.pop(fut)
                        if self._settle(fut.result(), needed):
                            self._report()
            finally:
                for fut in inflight:
                    fut.cancel()
        self.holder.finish(served)
        self.stats.seconds = time.monotonic() - t0
        self._close_clients()
        return self.stats

    def _probe(self, peers: list[PeerView]) -> None:
        """Worker thread: ask every holder never heard from what it has, all at once, so the
        ones that never answer (dead, or records naming nobody) cost one grant timeout in all."""
        by_endpoint: dict[str, list[str]] = {}
        for p in peers:
            by_endpoint.setdefault(p.endpoint, []).append(p.holder)

        def heard(endpoint: str, ans: Answer | None) -> None:
            for h in by_endpoint[endpoint]:
                self._answers.put((h, ans))

        self._client().ask_all(list(by_endpoint), Have(self.m.name, self.m.version), heard)

    def _heard(self, now: float) -> None:
        """Main thread: take the probe answers that came in."""
        while True:
            try:
                holder, ans = self._answers.get_nowait()
            except queue.Empty:
                return
            self._probing.discard(holder)
            p = self.peers.get(holder)
            if p is None:
                continue
            if ans is None or ans.status == "refused":
                self.stats.refusals += 1
                log.info("holder %s did not answer; skipping it", holder)
                p.dead_until = now + 3600.0
                p.renewed_at_death = p.renewed
            else:
                p.answered = True
                p.have = merge(p.have, ans.have)

    def _settle(self, o: _Outcome, needed: set[int]) -> bool:
        p = self.peers.get(o.holder)
        now = time.monotonic()
        if p is not None:
            p.inflight -= 1
            p.answered = p.answered or o.status != "dead"
            if o.have:
                p.have = merge(p.have, o.have)
        if o.status == "ok":
            needed.discard(o.chunk)
            assert self.served is not None
            self.holder.mark(self.served, o.chunk)
            n = self.m.chunks[o.chunk].length
            self.stats.fetched += 1
            self.stats.fetched_bytes += n
            self.stats.from_holder[o.holder] = self.stats.from_holder.get(o.holder, 0) + n
            return True
        if o.status == "corrupt":
            self.stats.corrupt += 1
            log.warning(
                "chunk %d from %s failed its hash; trying another holder", o.chunk, o.holder
            )
            if p is not None:
                p.bad.add(o.chunk)
            return True
        self.stats.refusals += 1
        if p is None:
            return False
        if o.status == "wait":
            p.busy_until = now + o.wait
        elif o.status in ("dead", "refused", "broken"):
            log.info("holder %s: %s %s; skipping it", o.holder, o.status, o.error)
            p.dead_until = now + (self.grant_timeout * 4 if o.status == "broken" else 3600.0)
            p.renewed_at_death = p.renewed
        elif o.status == "capped":
            p.capped = True
        return False

    def _look(self) -> None:
        try:
            recs = self.catalog.holders(self.m.name, self.m.version)
        except MetadataError as exc:
            log.warning("holder lookup failed (keeping the holders known): %s", exc)
            return
        mine = self.served.holder if self.served else ""
        seen = set()
        for r in recs:
            if r.holder == mine:
                continue
            seen.add(r.holder)
            p = self.peers.get(r.holder)
            if p is None:
                self.peers[r.holder] = PeerView(
                    r.holder, r.endpoint, r.segment, r.have, renewed=r.renewed
                )
                continue
            if r.renewed > p.renewed_at_death and p.dead_until > time.monotonic():
                p.dead_until = 0.0  # it renewed its lease since it failed us: alive after all
            p.renewed = r.renewed
            p.have = merge(p.have, r.have)
        for h in [h for h, p in self.peers.items() if h not in seen and not p.inflight]:
            del self.peers[h]  # its lease ran out: forgotten
        self.stats.peers = len(self.peers)

    def _report(self) -> None:
        if self.on_progress is not None:
            self.on_progress(self.stats)

    # -- one chunk (worker thread) ----------------------------------------------------------
    def _client(self) -> GrantClient:
        c: GrantClient | None = getattr(self._local, "client", None)
        if c is None:
            c = GrantClient(self.engine.config.auth_token, self.grant_timeout)
            self._local.client = c
            with self._clients_lock:
                self._clients.append(c)
        return c

    def _get(self, chunk: int, p: PeerView) -> _Outcome:
        assert self.served is not None
        ans = self._client().ask(
            p.endpoint, Grant(self.m.name, self.m.version, chunk, self.served.holder)
        )
        if ans is None:
            return _Outcome(chunk, p.holder, "dead", error="no answer to a grant")
        ch = self.m.chunks[chunk]
        if ans.status != "ok":
            return _Outcome(chunk, p.holder, ans.status, ans.have, ans.wait)
        if ans.length != ch.length or ans.segment != p.segment:
            # A grant elsewhere would spend a third party's egress outside its own grants.
            return _Outcome(chunk, p.holder, "refused", error="granted a wrong length or segment")
        region = self.regions[ch.file]
        assert region is not None
        local = region.addr + ch.offset
        try:
            self.engine.read(
                ans.segment, local, ans.addr, ch.length, timeout=max(5.0, self.grant_timeout * 4)
            )
        except MooncakeConnectorsError as exc:
            return _Outcome(chunk, p.holder, "broken", ans.have, error=str(exc))
        if digest(region.slice(local, ch.length)) != ch.sha256:
            return _Outcome(chunk, p.holder, "corrupt", ans.have)
        return _Outcome(chunk, p.holder, "ok", ans.have)

    def _close_clients(self) -> None:
        # The worker threads are gone (the pool was joined), so their sockets may be closed here.
        with self._clients_lock:
            for c in self._clients:
                c.close()
            self._clients.clear()


__all__ = ["FetchStats", "Fetcher"]
