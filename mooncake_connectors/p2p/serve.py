"""The holder side: grant chunk reads, ration egress, keep the holder records alive.

Chunk bytes move by one-sided READ through the transfer engine, which does not ask the holder's
code. So that a holder can still cap its egress (``rate``) and what one peer takes from it
(``serve_cap``), a fetcher first asks the holder's small grant server for a chunk: the answer is
either where the chunk lies in the holder's registered memory, "wait N seconds" (egress budget
spent), "not held", or "capped". Grants are the rationing of well-behaved fetchers; the engine's
``auth_token`` is what keeps others out (see docs/p2p.md, Trust).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import zmq

from ..errors import MetadataError
from ..transfer_core.engine import TransferEngine
from ..transfer_core.memory import Region
from .manifest import Manifest
from .records import Catalog, HolderRecord, set_bit
from .schedule import ServeLedger, TokenBucket

log = logging.getLogger(__name__)
# libzmq allocates a message's declared size when its header arrives, before any MAC check: a
# peer announcing more than this is disconnected instead. A grant request is a name and a few
# integers; an answer carries the holder's chunk bitmap (1 bit a chunk).
MAX_REQUEST = 64 << 10
MAX_ANSWER = 16 << 20


class Grant(msgspec.Struct, frozen=True, tag="grant"):
    name: str
    version: int
    chunk: int
    peer: str


class Have(msgspec.Struct, frozen=True, tag="have"):
    name: str
    version: int


class Answer(msgspec.Struct, frozen=True):
    status: str  # ok | wait | missing | capped | refused
    segment: str = ""
    addr: int = 0
    length: int = 0
    have: bytes = b""
    wait: float = 0.0


_req_enc = msgspec.msgpack.Encoder()
_req_dec = msgspec.msgpack.Decoder(Grant | Have)
_ans_enc = msgspec.msgpack.Encoder()
_ans_dec = msgspec.msgpack.Decoder(Answer)


def sign(token: str | None, body: bytes) -> bytes:
    if not token:
        return b""
    return hmac.new(token.encode(), b"mc-p2p-grant\0" + body, hashlib.sha256).digest()


@dataclass
class Served:
    """One object a holder serves."""

    manifest: Manifest
    regions: list[Region | None]  # per file; None for an empty file
    have: bytearray
    holder: str
    complete: bool = False


class Holder:
    """Serves the chunks this process holds, for any number of objects."""

    def __init__(
        self,
        engine: TransferEngine,
        catalog: Catalog,
        *,
        rate: float | None = None,
        serve_cap: int | None = None,
        lease: float = 10.0,
    ) -> None:
        self.engine = engine
        self.catalog = catalog
        self.lease = lease
        self.token = engine.config.auth_token
        # A tenth of a second of credit: enough that the first grant never waits.
        self.bucket = TokenBucket(rate, burst=rate / 10) if rate else None
        self.ledger = ServeLedger(serve_cap)
        self.objects: dict[tuple[str, int], Served] = {}
        self.granted_bytes = 0
        self._lock = threading.Lock()
        # one announce at a time: a record is written in the order its snapshot was taken, so a
        # beat's older snapshot never lands after finish()'s complete one
        self._announcing = threading.Lock()
        self._stop = threading.Event()
        self._dirty = threading.Event()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST)
        host = engine.config.host
        bind = f"[{host}]" if ":" in host else host
        if ":" in host:
            self._sock.setsockopt(zmq.IPV6, 1)
        port = self._sock.bind_to_random_port(f"tcp://{bind}")
        self.endpoint = f"{bind}:{port}"
        self._tag = f"{host.replace(':', '_')}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._threads = [
            threading.Thread(target=self._serve, name="mc-p2p-grant", daemon=True),
            threading.Thread(target=self._beat, name="mc-p2p-lease", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # -- objects ----------------------------------------------------------------------------
    def add(
        self,
        manifest: Manifest,
        regions: list[Region | None],
        have: bytearray,
        *,
        share: bool = True,
        complete: bool = False,
    ) -> Served:
        """Hold ``manifest``'s chunks marked in ``have``; ``share=False`` holds without serving."""
        s = Served(manifest, regions, have, f"{manifest.name}-{self._tag}", complete)
        if share:
            with self._lock:
                self.objects[(manifest.name, manifest.version)] = s
            self._announce(s)
        return s

    def mark(self, s: Served, chunk: int) -> None:
        """``chunk`` landed and passed its hash: serve it from now on, and say so."""
        with self._lock:
            set_bit(s.have, chunk)
        self._dirty.set()

    def finish(self, s: Served) -> None:
        """Every chunk is in: say so now, so a fetch that returned is listed as a complete
        holder (the lease thread's next beat would say it too, but later)."""
        with self._lock:
            s.complete = True
            shared = self.objects.get((s.manifest.name, s.manifest.version)) is s
        if not shared:
            return
        try:
            self._announce(s)
        except MetadataError as exc:
            log.warning("could not publish the holder record of %s: %s", s.manifest.name, exc)
            self._dirty.set()  # the lease thread tries again

    def drop(self, s: Served) -> None:
        with self._lock:
            self.objects.pop((s.manifest.name, s.manifest.version), None)
        self.catalog.drop_holder(s.manifest.name, s.manifest.version, s.holder)

    def _record(self, s: Served) -> HolderRecord:
        with self._lock:
            have = bytes(s.have)
        return HolderRecord(
            s.holder,
            self.endpoint,
            self.engine.segment_name,
            have,
            time.time(),
            self.lease,
            s.complete,
        )

    def _announce(self, s: Served) -> None:
        with self._announcing:
            self.catalog.put_holder(s.manifest.name, s.manifest.version, self._record(s))

    def _beat(self) -> None:
        period = self.lease / 3
        last = 0.0
        while not self._stop.is_set():
            self._dirty.wait(period)
            self._dirty.clear()
            if self._stop.is_set():
                return
            full = time.monotonic() - last >= period  # a renewal, not only news of a chunk
            with self._lock:
                objs = list(self.objects.values())
            for s in objs:
                m = s.manifest
                try:
                    if full and not self.catalog.exists(m.name, m.version):
                        log.info("%s v%d was unpublished; no longer serving it", m.name, m.version)
                        with self._lock:
                            self.objects.pop((m.name, m.version), None)
                        continue
                    self._announce(s)
                except MetadataError as exc:
                    log.warning("could not renew the holder record of %s: %s", m.name, exc)
            if full:
                last = time.monotonic()

    # -- grants -----------------------------------------------------------------------------
    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not poller.poll(200):
                    continue
                parts = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                continue
            if len(parts) != 4 or parts[1] != b"":
                continue  # not a REQ envelope: nothing sane to answer
            ident, _, mac, body = parts
            answer = self._answer(mac, body)
            try:
                self._sock.send_multipart([ident, b"", _ans_enc.encode(answer)], zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                log.debug("grant answer not sent: %s", exc)

    def _answer(self, mac: bytes, body: bytes) -> Answer:
        if self.token and not hmac.compare_digest(mac, sign(self.token, body)):
            return Answer("refused")
        try:
            req = _req_dec.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return Answer("refused")
        with self._lock:
            s = self.objects.get((req.name, req.version))
            if s is None:
                return Answer("missing")
            have = bytes(s.have)
            if isinstance(req, Have):
                return Answer("ok", have=have)
            m = s.manifest
            if (
                not 0 <= req.chunk < len(m.chunks)
                or not have[req.chunk // 8] >> (req.chunk % 8) & 1
            ):
                return Answer("missing", have=have)
            ch = m.chunks[req.chunk]
            region = s.regions[ch.file]
            assert region is not None  # a held chunk has bytes, so its file has a region
            if not self.ledger.room(req.peer, ch.length):
                return Answer("capped", have=have)
            if self.bucket is not None:
                wait = self.bucket.take(ch.length)
                if wait:
                    return Answer("wait", have=have, wait=wait)
            self.ledger.charge(req.peer, ch.length)
            self.granted_bytes += ch.length
            return Answer("ok", self.engine.segment_name, region.addr + ch.offset, ch.length, have)

    def close(self) -> None:
        self._stop.set()
        self._dirty.set()
        for t in self._threads:
            t.join(timeout=2.0)
        with self._lock:
            objs = list(self.objects.values())
            self.objects.clear()
        for s in objs:
            self.catalog.drop_holder(s.manifest.name, s.manifest.version, s.holder)
        self._sock.close(linger=0)


class GrantClient:
    """Asks holders for grants; one REQ socket per holder endpoint, for one thread."""

    def __init__(self, token: str | None, timeout: float) -> None:
        self.token = token
        self.timeout_ms = int(timeout * 1000)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._socks: dict[str, zmq.Socket[bytes]] = {}

    def _sock(self, endpoint: str) -> zmq.Socket[bytes]:
        sock = self._socks.get(endpoint)
        if sock is None:
            sock = self._ctx.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_ANSWER)
            if endpoint.startswith("["):
                sock.setsockopt(zmq.IPV6, 1)
            sock.connect(f"tcp://{endpoint}")
            self._socks[endpoint] = sock
        return sock

    def _forget(self, endpoint: str) -> None:
        # A REQ socket without its answer cannot ask again: start over on the next call.
        sock = self._socks.pop(endpoint, None)
        if sock is not None:
            sock.close(linger=0)

    def ask(self, endpoint: str, req: Grant | Have) -> Answer | None:
        """The holder's answer, or None when it did not answer in time (dead, or gone)."""
        sock = self._sock(endpoint)
        body = _req_enc.encode(req)
        try:
            sock.send_multipart([sign(self.token, body), body])
            if sock.poll(self.timeout_ms, zmq.POLLIN):
                return _ans_dec.decode(sock.recv())
        except (zmq.ZMQError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.debug("grant from %s failed: %s", endpoint, exc)
        self._forget(endpoint)
        return None

    def ask_all(
        self,
        endpoints: list[str],
        req: Grant | Have,
        on_answer: Callable[[str, Answer | None], None],
    ) -> None:
        """Ask every endpoint at once; ``on_answer`` gets each answer as it comes, and None for
        each endpoint silent at the deadline: one timeout in all, however many never answer."""
        body = _req_enc.encode(req)
        waiting: dict[zmq.Socket[bytes], str] = {}
        poller = zmq.Poller()
        for ep in endpoints:
            try:
                sock = self._sock(ep)
                sock.send_multipart([sign(self.token, body), body])
            except zmq.ZMQError as exc:
                log.debug("grant request to %s failed: %s", ep, exc)
                self._forget(ep)
                on_answer(ep, None)
                continue
            waiting[sock] = ep
            poller.register(sock, zmq.POLLIN)
        deadline = time.monotonic() + self.timeout_ms / 1000
        while waiting and (left := deadline - time.monotonic()) > 0:
            for sock, _ in poller.poll(int(left * 1000) + 1):
                ep = waiting.pop(sock)  # type: ignore[call-overload]
                poller.unregister(sock)
                try:
                    ans: Answer | None = _ans_dec.decode(sock.recv(zmq.NOBLOCK))
                except (zmq.ZMQError, msgspec.DecodeError, msgspec.ValidationError):
                    self._forget(ep)
                    ans = None
                on_answer(ep, ans)
        for ep in waiting.values():
            self._forget(ep)
            on_answer(ep, None)

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close(linger=0)
        self._socks.clear()


__all__ = ["Answer", "Grant", "GrantClient", "Have", "Holder", "Served", "sign"]
