"""A store server: contributes memory (and SSD) to the store and holds the data.

    server = StoreServer(ServerConfig(master="127.0.0.1:50051", memory=1 << 30)).start()

Its transfer engine allocates the memory (memfd-backed, so clients on the same host copy it at
memcpy speed) and the server mounts it at the master as a segment. Clients then write and read
that memory one-sided through their own engines; the server's CPU is not involved. The server
heartbeats, keeps a record of what it holds (the master pushes deltas) so that it can re-report
it to a new leader, and, with an SSD directory, writes objects the master evicts to files and
serves them back through a small registered bounce buffer (the ``Load`` endpoint).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import uuid
from typing import Any

import msgspec

from ..config import EngineConfig
from ..errors import MasterUnavailable, MooncakeConnectorsError, ProtocolError, StoreError
from ..transfer_core.descriptor import host_id
from ..transfer_core.engine import TransferEngine
from ..transfer_core.memory import SharedBuffer, view
from .allocator import RangeAllocator
from .config import ServerConfig
from .link import Dialer, MasterLink
from .protocol import (
    Code,
    DropFiles,
    Err,
    FilesLost,
    Heartbeat,
    Hello,
    HelloOk,
    Hold,
    Load,
    Loaded,
    Mount,
    Msg,
    Ok,
    Part,
    Promote,
    Promoted,
    Release,
    Report,
    Spill,
    SpillDone,
    Unmount,
    encoder,
    report_chunks,
)
from .rpc import Channel, Conn, FrameServer
from .ssd import CORRUPT, SsdStore

log = logging.getLogger(__name__)
_LOAN_TTL = 30.0  # seconds a client may take to read a loaded SSD object
# The largest holdings report (a quarter of the master's default 64 MiB frame limit): reports
# are sized by bytes, since keys of up to 4 KiB make a report counted in parts alone too large.
REPORT_BYTES = 16 << 20


class StoreServer:
    def __init__(
        self,
        config: ServerConfig | None = None,
        *,
        engine: TransferEngine | None = None,
        client_id: str | None = None,
    ) -> None:
        self.cfg = config or ServerConfig()
        self.client_id = client_id or f"server-{uuid.uuid4().hex[:12]}"
        self.engine = engine
        self._own_engine = engine is None
        self.buffer: SharedBuffer | None = None
        self.holdings: dict[str, list[Part]] = {}
        self.ssd: SsdStore | None = None
        self._bounce: SharedBuffer | None = None
        self._bounce_alloc: RangeAllocator | None = None
        self._loans: dict[int, tuple[int, int, float]] = {}
        self._tokens = itertools.count(1)
        self._loads: FrameServer | None = None
        self._jobs: queue.SimpleQueue[Msg | None] = queue.SimpleQueue()
        self._results: queue.SimpleQueue[tuple[int, bool]] = queue.SimpleQueue()
        self._promoted: queue.SimpleQueue[tuple[int, bool]] = queue.SimpleQueue()
        self._damaged: queue.SimpleQueue[int] = queue.SimpleQueue()  # file ids failing checks
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._ch: Channel | None = None
        self.heartbeat = 1.0
        self.registrations = 0  # how many times it mounted (1 + re-registrations)
        self._report_bytes = REPORT_BYTES
        self.link = MasterLink(self.cfg.master, self.cfg.rpc_timeout, Dialer.of(self.cfg))

    @property
    def segment(self) -> str:
        assert self.engine is not None
        return self.engine.segment_name

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> StoreServer:
        cfg = self.cfg
        deadline = time.monotonic() + 3 * cfg.rpc_timeout
        hello = self.link.call(Hello(self.client_id, host_id()), deadline)
        if not isinstance(hello, HelloOk):
            raise StoreError(f"master refused hello: {getattr(hello, 'message', hello)}")
        self.heartbeat = hello.heartbeat_ms / 1000
        if hello.max_frame:  # a quarter of the master's frame limit leaves room for its checks
            self._report_bytes = min(REPORT_BYTES, hello.max_frame // 4)
        if self.engine is None:
            # The store's token guards the data plane too: without it any local process could
            # read or overwrite stored values through this engine.
            ecfg = EngineConfig(
                host=cfg.host,
                metadata=cfg.metadata or hello.metadata,
                transports=cfg.transports,
                auth_token=cfg.auth_token,
            ).replace(**(cfg.tls.fields() if cfg.tls else {}))
            self.engine = TransferEngine(ecfg).start()
        try:
            self.buffer = self.engine.allocate_buffer(cfg.memory)
            if cfg.ssd_dir is not None:
                self.ssd = SsdStore(cfg.ssd_dir, cfg.ssd_size)
                self._readopt(self.ssd)
                self._bounce = self.engine.allocate_buffer(cfg.bounce_size)
                self._bounce_alloc = RangeAllocator(cfg.bounce_size)
                self._loads = FrameServer(
                    cfg.host,
                    0,
                    self._handle_load,
                    tick=self._expire_loans,
                    name="mc-store-load",
                    token=cfg.auth_token,
                    tls=cfg.tls,
                ).start()
            self._register(deadline + cfg.rpc_timeout)
        except BaseException:
            self.close()
            raise
        for target, name in ((self._run, "mc-store-server"), (self._work, "mc-store-ssd")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        log.info("store server %s: %d bytes in %s", self.client_id, cfg.memory, self.segment)
        return self

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._jobs.put(None)
        for t in self._threads:
            t.join(timeout=10)
        if self._ch is not None and self.engine is not None and self.buffer is not None:
            try:  # a clean exit unmounts at once instead of waiting for the liveness timeout
                self._ch.call(Unmount(self.client_id, self.segment), self.cfg.rpc_timeout)
            except (OSError, ProtocolError) as exc:
                log.info("unmount on close failed: %s", exc)
        if self._ch is not None:
            self._ch.close()
        self.link.close()
        if self._loads is not None:
            self._loads.stop()
        if self.engine is not None:
            for buf in (self.buffer, self._bounce):
                if buf is not None and not buf.closed:
                    try:
                        self.engine.free_buffer(buf.addr)
                    except MooncakeConnectorsError as exc:
                        log.debug("free buffer: %s", exc)
            if self._own_engine:
                self.engine.close()

    def __enter__(self) -> StoreServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- master connection ------------------------------------------------------------------
    def _connect(self, deadline: float) -> Channel:
        while True:
            address = self.link.address()
            if address is not None:
                try:
                    return self.link.dial.channel(address, self.cfg.rpc_timeout)
                except OSError as exc:
                    log.debug("connect to master %s failed: %s", address, exc)
                    self.link.invalidate()
            if time.monotonic() >= deadline or self._stop.wait(0.1):
                raise MasterUnavailable("no master to register with", master=self.cfg.master)

    def _call(self, msg: Msg) -> Msg:
        assert self._ch is not None
        reply = self._ch.call(msg, self.cfg.rpc_timeout)
        if isinstance(reply, Err) and reply.code == Code.NOT_LEADER:
            raise ConnectionError(reply.message)
        return reply

    def _register(self, deadline: float) -> None:
        """Mount our memory at the master and re-report what we hold."""
        assert self.engine is not None and self.buffer is not None
        if self._ch is None:
            self._ch = self._connect(deadline)
        recover = bool(self.holdings)
        endpoint = self._loads.address if self._loads is not None else ""
        reply = self._call(
            Mount(
                self.client_id,
                self.segment,
                self.buffer.addr,
                self.cfg.memory,
                host_id(),
                endpoint,
                self.cfg.ssd_size,
                recover,
            )
        )
        if isinstance(reply, Err):
            raise StoreError(f"mount refused: {reply.message}", code=reply.code)
        if recover:
            parts = [p for ps in self.holdings.values() for p in ps]
            for chunk, done in report_chunks(parts, self._report_bytes):
                reply = self._call(Report(self.client_id, chunk, done))
                if isinstance(reply, Err):
                    raise StoreError(f"report refused: {reply.message}", code=reply.code)
        self.registrations += 1
        log.info("%s registered (recovered %d keys)", self.client_id, len(self.holdings))

    def _run(self) -> None:
        next_hb = time.monotonic() + self.heartbeat
        while not self._stop.is_set():
            try:
                if self._ch is None or self._ch.closed:
                    self._ch = self._connect(time.monotonic() + 3600)
                    next_hb = 0.0  # find out at once whether this master knows us
                ch = self._ch
                while ch.pushes:
                    self._on_push(ch.pushes.popleft())
                msg = ch.poll_push(max(0.0, min(next_hb - time.monotonic(), 0.05)))
                if msg is not None:
                    self._on_push(msg)
                results = []
                while not self._results.empty():
                    results.append(self._results.get())
                if results:
                    ch.notify(SpillDone(self.client_id, results))
                results = []
                while not self._promoted.empty():
                    results.append(self._promoted.get())
                if results:
                    ch.notify(Promoted(self.client_id, results))
                damaged = []
                while not self._damaged.empty():
                    damaged.append(self._damaged.get())
                if damaged:
                    ch.notify(FilesLost(self.client_id, damaged))
                if time.monotonic() >= next_hb:
                    reply = self._call(Heartbeat(self.client_id))
                    if isinstance(reply, Err) and reply.code == Code.UNKNOWN_CLIENT:
                        self._register(time.monotonic() + 3 * self.cfg.rpc_timeout)
                    elif not isinstance(reply, Ok):
                        log.warning("heartbeat answered %s", reply)
                    next_hb = time.monotonic() + self.heartbeat
            except (OSError, ProtocolError, StoreError) as exc:
                if self._stop.is_set():
                    return
                log.info("master connection lost (%s); reconnecting", exc)
                if self._ch is not None:
                    self._ch.close()
                self._ch = None
                self.link.invalidate()
                self._stop.wait(0.1)

    def _on_push(self, msg: Msg) -> None:
        if isinstance(msg, Hold):
            h = self.holdings
            for op in msg.ops:
                if isinstance(op, str):
                    if op:
                        h.pop(op, None)
                    else:
                        h.clear()
                    continue
                if not op.segment and self.ssd is not None:
                    self.ssd.describe(op.offset, encoder.encode(op))
                lst = h.get(op.key)
                if lst is None:
                    h[op.key] = [op]
                    continue
                lst[:] = [
                    p for p in lst if (p.ridx, p.sidx, p.segment) != (op.ridx, op.sidx, op.segment)
                ]
                lst.append(op)
        elif isinstance(msg, Spill | DropFiles | Promote):
            self._jobs.put(msg)
        else:
            log.debug("ignoring push %s", type(msg).__name__)

    # -- SSD tier ---------------------------------------------------------------------------
    def _readopt(self, ssd: SsdStore) -> None:
        """Hold again the files an earlier run of this server left whole (re-reported when we
        mount); a file id is unique in the store, so the master can tell them from others."""
        for fid, meta in ssd.reindex():
            try:
                part = msgspec.msgpack.decode(meta, type=Part)
            except msgspec.ValidationError:  # DecodeError is a subclass
                ssd.delete(fid)
                continue
            if part.segment or part.offset != fid:
                ssd.delete(fid)
                continue
            self.holdings.setdefault(part.key, []).append(part)

    def _work(self) -> None:
        """Spill and delete files in order, off the heartbeat thread."""
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if isinstance(job, Spill):
                for fid, addr, size in job.items:
                    # a file larger than the bounce buffer could never be served: refuse it
                    ok = (
                        self.ssd is not None
                        and size <= self.cfg.bounce_size
                        and self._inside(addr, size)
                        and self.ssd.write(fid, view(addr, size) if size else memoryview(b""))
                    )
                    self._results.put((fid, bool(ok)))
            elif isinstance(job, Promote):
                for fid, addr, size in job.items:
                    n = -1
                    if self.ssd is not None and self._inside(addr, size):
                        n = self.ssd.read_into(fid, view(addr, size) if size else memoryview(b""))
                    if n == CORRUPT:
                        self._damaged.put(fid)
                    self._promoted.put((fid, n == size))
            elif isinstance(job, DropFiles) and self.ssd is not None:
                for fid in job.file_ids:
                    self.ssd.delete(fid)

    def _inside(self, addr: int, size: int) -> bool:
        """[addr, addr+size) lies in our segment (the master's word is checked, not trusted)."""
        buf = self.buffer
        return buf is not None and buf.addr <= addr and addr + size <= buf.addr + buf.size

    def _handle_load(self, conn: Conn, msg: Msg, flags: int) -> Msg | None:
        alloc, bounce, ssd = self._bounce_alloc, self._bounce, self.ssd
        assert alloc is not None and bounce is not None and ssd is not None
        if isinstance(msg, Load):
            if msg.size > alloc.size:
                return Err(int(Code.INVALID), f"object of {msg.size} bytes exceeds bounce buffer")
            off = alloc.alloc(msg.size)
            if off is None:
                return Err(int(Code.BUSY), "bounce buffer full; retry")
            n = ssd.read_into(msg.file_id, view(bounce.addr + off, msg.size)) if msg.size else 0
            if n != msg.size:
                alloc.release(off, msg.size)
                if n == CORRUPT:  # the master drops the object: later reads are plain misses
                    self._damaged.put(msg.file_id)
                why = "is damaged (checksum or length)" if n == CORRUPT else "does not exist"
                return Err(int(Code.NOT_FOUND), f"SSD file {msg.file_id:x} {why}")
            token = next(self._tokens)
            self._loans[token] = (off, msg.size, time.monotonic() + _LOAN_TTL)
            return Loaded(bounce.addr + off, token)
        if isinstance(msg, Release):
            loan = self._loans.pop(msg.token, None)
            if loan is not None:
                alloc.release(loan[0], loan[1])
            return Ok()
        return Err(int(Code.INVALID), f"{type(msg).__name__} is not a store-server request")

    def _expire_loans(self) -> float:
        now = time.monotonic()
        alloc = self._bounce_alloc
        for token, (off, size, until) in list(self._loans.items()):
            if until <= now and alloc is not None:
                del self._loans[token]
                alloc.release(off, size)
        return 1.0

    def stats(self) -> dict[str, Any]:
        return {
            "keys_held": len(self.holdings),
            "ssd_used": self.ssd.used if self.ssd else 0,
            "ssd_corrupt": self.ssd.corrupt if self.ssd else 0,
            "registrations": self.registrations,
        }
