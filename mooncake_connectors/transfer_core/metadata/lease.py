"""This process's descriptor in a central metadata service (http, etcd) only while it lives.

A process that exits without ``close()`` (a compat script, ``sys.exit``, an uncaught exception)
still runs ``atexit``: there every engine not closed withdraws its descriptor, on a connection of
its own, within ``EXIT_BUDGET`` seconds for all of them together, waiting on no thread. A process
that cannot run it (SIGKILL, ``os._exit``, a crash) leaves its descriptor under a lease that its
keep-alive thread renews every third of ``metadata_lease``: the service drops it once the
lease runs out. In-process stores (memory, p2p) need neither: their descriptors go with the
process.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref

from ...errors import MetadataError
from ...netguard import RateLimitedLog
from ..descriptor import SegmentDesc
from .base import MetadataBackend

log = logging.getLogger(__name__)

EXIT_BUDGET = 1.0  # seconds all withdrawals at interpreter exit may take together

_live: weakref.WeakSet[Publication] = weakref.WeakSet()


class Publication:
    """One segment's descriptor, published under a lease and renewed until ``stop()``."""

    def __init__(self, backend: MetadataBackend, lease: float, *, withdraw_at_exit: bool) -> None:
        self.backend = backend
        self.lease = lease if backend.central else 0.0
        self.desc: SegmentDesc | None = None
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._keeper: threading.Thread | None = None
        self._failed = RateLimitedLog(log)
        if backend.central and withdraw_at_exit:
            _live.add(self)

    def publish(self, desc: SegmentDesc) -> None:
        with self._lock:
            self.backend.publish_segment(desc, self.lease)
            self.desc = desc
        if self.lease and self._keeper is None and not self._stopped.is_set():
            self._keeper = threading.Thread(
                target=self._keep, name="mc-metadata-lease", daemon=True
            )
            self._keeper.start()

    def _keep(self) -> None:
        # Renewing re-publishes the whole descriptor: a metadata server that restarted empty
        # learns it again within a third of the lease.
        while not self._stopped.wait(self.lease / 3):
            with self._lock:
                desc = self.desc
                if desc is None or self._stopped.is_set():
                    return
                try:
                    self.backend.publish_segment(desc, self.lease)
                except MetadataError as exc:
                    self._failed.warning("renewing segment %s failed: %s", desc.name, exc)
                    continue
            if self._stopped.is_set():  # close() removed it while this renewal was in flight
                self._remove(desc.name)
                return

    def stop(self) -> None:
        """No more renewals; waits for none in flight (one that lands after ``close()`` removed
        the descriptor removes it again)."""
        self._stopped.set()
        _live.discard(self)

    def _remove(self, name: str) -> None:
        try:
            self.backend.remove_segment(name)
        except MetadataError as exc:
            log.debug("removing segment %s after a late renewal: %s", name, exc)

    def withdraw(self, timeout: float) -> None:
        desc = self.desc
        self._stopped.set()
        if desc is not None and timeout > 0:
            self.backend.withdraw_segment(desc.name, timeout)


@atexit.register
def _withdraw_all() -> None:
    """At interpreter exit (before the finalizers; threads still run, but none is waited on)."""
    end = time.monotonic() + EXIT_BUDGET
    for pub in list(_live):
        pub.withdraw(end - time.monotonic())
