"""The target side of the connect exchange: the QPs peers have us make (passive QPs), capped,
and reaped when their initiator is gone."""

from __future__ import annotations

import logging
import os
import threading
import time

from ....errors import MooncakeConnectorsError, ProtocolError, SegmentNotFound
from ...transport import TransportContext
from . import control
from .nicstate import NicState
from .settings import RdmaSettings
from .verbs import GidChanged, Nic, QpAddr

log = logging.getLogger(__name__)
_REAP_EVERY = 5.0  # seconds between sweeps for passive QPs of initiators gone


class PassiveSide:
    """What RdmaTransport answers a peer's connect with; the attributes are the transport's."""

    ctx: TransportContext
    settings: RdmaSettings
    nics: dict[str, NicState]
    max_wr: int
    _lock: threading.Lock
    _closed: bool
    _passive: dict[tuple[str, str, str, bool], tuple[Nic, object]]
    _reaped: float

    def _on_connect(self, payload: bytes, who: str) -> bytes:
        req = control.decode_request(payload)
        state = self.nics.get(req.peer_nic)
        if state is None or state.dead is not None:
            raise ProtocolError(f"no usable RDMA device {req.peer_nic!r} here")
        nic = state.nic
        psn = int.from_bytes(os.urandom(3), "little")
        for again in (True, False):
            qp = nic.create_qp(self.max_wr)
            try:
                nic.connect(qp, QpAddr(req.qpn, req.psn, req.gid, req.lid, req.mtu), psn)
                break
            except GidChanged as exc:
                nic.destroy(qp)
                if not again:
                    raise
                log.info("rdma: connecting %s's QP again: %s", req.segment, exc)
            except MooncakeConnectorsError:
                nic.destroy(qp)
                raise
        key = (req.segment, req.nic, req.peer_nic, req.direct)
        cap = self.settings.max_passive
        with self._lock:
            old = self._passive.pop(key, None)
            full = len(self._passive) >= cap
        if full:
            self._reap_passive()
        with self._lock:
            if self._closed or len(self._passive) >= cap:
                nic.destroy(qp)
                raise ProtocolError("too many rdma connections")
            self._passive[key] = (nic, qp)
        if old is not None:
            old[0].destroy(old[1])
        return control.encode_reply(QpAddr(int(qp.qp_num), psn, nic.gid, nic.lid, nic.mtu))

    def _reap_passive(self) -> None:
        """Destroy the passive QPs of initiators whose segment is gone (a closed engine
        unpublishes it): nothing on a target's QP shows that its initiator went away, so
        without this a long-running target refuses every new peer once max_passive initiators
        came and went. A sweep looks each initiator up, so it runs at most every _REAP_EVERY s;
        an initiator whose lookup fails otherwise (metadata unreachable) keeps its QPs."""
        now = time.monotonic()
        if now - self._reaped < _REAP_EVERY:
            return
        self._reaped = now
        with self._lock:
            segments = {k[0] for k in self._passive}
        gone = set()
        for seg in segments:
            try:
                self.ctx.refresh_peer(seg)
            except SegmentNotFound:
                gone.add(seg)
            except MooncakeConnectorsError:
                continue
        with self._lock:
            dead = [self._passive.pop(k) for k in list(self._passive) if k[0] in gone]
        for nic, qp in dead:
            nic.destroy(qp)
        if dead:
            log.info("rdma: destroyed %d QPs of %d initiators gone", len(dead), len(gone))
