"""A local NIC as the rails see it: its poller thread, the CQ slots its rails may still promise,
and its port state."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from ....errors import MooncakeConnectorsError, TransportBroken
from .verbs import Completion, Nic

if TYPE_CHECKING:
    from .rails import Rail

log = logging.getLogger(__name__)
PORT_CHECK = 0.5  # seconds between looks at each NIC's port state


class NicState:
    """A local NIC, its poller thread and the rails that use it."""

    def __init__(self, nic: Nic, stop: threading.Event) -> None:
        self.nic = nic
        self.stop = stop
        self.rails: dict[int, Rail] = {}  # qp number -> rail
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.dead: MooncakeConnectorsError | None = None
        self.down = False  # the port is not ACTIVE (polled; it may come back)
        # CQ slots not yet promised: every WR posted may end in a CQE (an error flushes all of
        # them, signalled or not), so at most cq_size WRs are outstanding on this NIC's QPs
        # together. A slot comes back when its WR's fate is known: vouched for by a completion,
        # or its QP destroyed (which removes its CQEs from the CQ).
        self.credits = nic.cq_size
        self.thread = threading.Thread(
            target=self._poll_loop, name=f"mc-rdma-poll-{nic.name}", daemon=True
        )

    def take(self, n: int = 1) -> bool:
        """Promise ``n`` CQ slots to the WRs about to be posted; False when the CQ could fill."""
        with self.lock:
            if self.credits < n:
                return False
            self.credits -= n
            return True

    def give(self, n: int, kick: bool = True) -> None:
        """``n`` CQ slots are free again; rails waiting for one post their queues."""
        if n <= 0:
            return
        with self.lock:
            self.credits += n
        for rail in list(self.rails.values()) if kick else ():
            if rail.queue:
                rail.kick()

    def busy(self) -> bool:
        return any(r.outstanding for r in list(self.rails.values()))

    def poll_once(self, spin: bool = False) -> bool:
        """Poll the CQ once and hand completions to their rails; True if there were any.
        The poller thread calls this (``spin``: on the compiled path it spins in C, without
        the GIL, a bounded time while the CQ is empty), and so does a caller that waits for
        its slices anyway (no spin: it checks its own slices between polls)."""
        if self.dead is not None:
            return False
        try:
            comps = self.nic.poll(64, spin)
        except TransportBroken as exc:
            self.vanished(exc)
            return False
        by_qp: dict[int, list[Completion]] = {}
        for c in comps:
            by_qp.setdefault(c.qp_num, []).append(c)
        for qpn, cs in by_qp.items():
            rail = self.rails.get(qpn)
            if rail is not None:  # else: flushes of a QP we already took down
                rail.completed(cs)
        return bool(comps)

    def check_port(self) -> None:
        """Follow the port's state. Async events (port down, device fatal) are not read:
        pyverbs' Context.get_async_event blocks in ibv_get_async_event holding the GIL, and
        pyverbs exposes no async fd to wait on first, so a thread reading them would stall
        every Python thread until an event came. The port state is polled instead: while it
        is not ACTIVE the NIC's rails are taken down and none is picked."""
        down = not self.nic.port_active()
        if down == self.down:
            return
        self.down = down
        if not down:
            log.info("rdma NIC %s port %d is ACTIVE again", self.nic.name, self.nic.port)
            return
        log.warning(
            "rdma NIC %s port %d is down: its rails are left out", self.nic.name, self.nic.port
        )
        for rail in list(self.rails.values()):
            rail.broke(TransportBroken(f"NIC {self.nic.name} port down"), cool=True)

    def _poll_loop(self) -> None:
        idle = 0
        checked = ported = time.monotonic()
        while not self.stop.is_set() and self.dead is None:
            if time.monotonic() - ported > PORT_CHECK:
                ported = time.monotonic()
                self.check_port()
            if not self.busy():
                self.wake.wait(0.2)
                self.wake.clear()
                continue
            if self.poll_once(spin=True):
                idle = 0
            else:
                idle += 1
                # Spin briefly (a completion is often microseconds away), then back off.
                time.sleep(0 if idle < 8 else 0.0001)
            now = time.monotonic()
            if now - checked > 0.05:
                checked = now
                for rail in list(self.rails.values()):
                    rail.check_timeout(now)

    def vanished(self, exc: MooncakeConnectorsError) -> None:
        """The device is gone: every rail on it breaks and never comes back."""
        self.dead = exc
        log.warning("rdma NIC %s failed: %s", self.nic.name, exc)
        for rail in list(self.rails.values()):
            rail.broke(TransportBroken(f"NIC {self.nic.name} failed: {exc.message}"), cool=True)
