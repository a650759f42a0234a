"""Leader election among masters through etcd, and finding the leader from a client.

Every master campaigns for one key, ``<prefix>store/leader``: it takes an etcd lease of
``ttl`` seconds and writes its address there in a transaction that succeeds only if the key does
not exist. The leader refreshes its lease every ttl/3 and checks the key still names it; standbys
retry the transaction every ttl/4, so one takes over at most ~1.25 x ttl after a leader dies
(its lease expires). A master that shuts down cleanly revokes its lease: the hand-over is then
immediate.

While etcd itself is unreachable the leader keeps serving (nobody else can be elected meanwhile)
— the store stays available through an etcd outage; it steps down as soon as etcd answers that
the key or the lease is no longer its own.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from ..errors import ConfigError
from ..transfer_core.metadata.etcd import parse_etcd_url

log = logging.getLogger(__name__)
LEADER_KEY = "store/leader"


def _etcd_client(url: str, timeout: float, index: int = 0) -> Any:
    try:
        import etcd3
    except ImportError as exc:
        raise ConfigError(
            "store HA needs python3-etcd3: pip install 'mooncake-connectors[etcd]'"
        ) from exc
    endpoints, _ = parse_etcd_url(url)
    host, port = endpoints[index % len(endpoints)]
    return etcd3.client(host=host, port=port, timeout=timeout)


def _close_quietly(client: Any) -> None:
    """Close an etcd client (or None) that is being dropped; a broken channel may fail to
    close, and that loses nothing."""
    if client is not None:
        try:
            client.close()
        except Exception as exc:
            log.debug("closing etcd client: %s", exc)


def leader_key(url: str) -> str:
    return parse_etcd_url(url)[1] + LEADER_KEY


class LeaderElection:
    """Campaign for leadership; ``on_change(True|False)`` runs in the election thread."""

    def __init__(self, url: str, me: str, ttl: float, on_change: Callable[[bool], None]) -> None:
        self.url = url
        self.me = me.encode()
        self.key = leader_key(url)
        self.ttl = max(1, round(ttl))
        self.on_change = on_change
        self.leading = False
        self._lease: Any = None
        self._client: Any = None
        self._endpoint = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> LeaderElection:
        self._thread = threading.Thread(target=self._run, name="mc-store-election", daemon=True)
        self._thread.start()
        return self

    def _etcd(self) -> Any:
        if self._client is None:
            self._client = _etcd_client(self.url, max(1.0, self.ttl / 3), self._endpoint)
        return self._client

    def _reset(self, exc: Exception) -> None:
        log.warning("etcd unreachable for the election (%s: %s)", type(exc).__name__, exc)
        _close_quietly(self._client)
        self._client = None
        self._endpoint += 1

    def _set(self, leading: bool) -> None:
        if leading != self.leading:
            self.leading = leading
            log.warning("%s %s leadership", self.me.decode(), "took" if leading else "lost")
            self.on_change(leading)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self.leading:
                    self._keep()
                    wait = self.ttl / 3
                else:
                    self._campaign()
                    wait = self.ttl / 3 if self.leading else self.ttl / 4
            except Exception as exc:  # grpc/etcd errors: keep the current role, retry
                self._reset(exc)
                wait = min(0.5, self.ttl / 4)
            self._stop.wait(wait)

    def _campaign(self) -> None:
        c = self._etcd()
        lease = c.lease(self.ttl)
        ok, _ = c.transaction(
            compare=[c.transactions.create(self.key) == 0],
            success=[c.transactions.put(self.key, self.me, lease=lease)],
            failure=[],
        )
        if ok:
            self._lease = lease
            self._set(True)
        else:
            lease.revoke()

    def _keep(self) -> None:
        c = self._etcd()
        responses = self._lease.refresh()
        ttl_left = responses[0].TTL if responses else 0
        value, _ = c.get(self.key)
        if ttl_left <= 0 or value != self.me:
            self._lease = None
            self._set(False)

    def stop(self, resign: bool = True) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if resign and self.leading and self._lease is not None:
            try:
                self._lease.revoke()  # deletes the key: a standby takes over at once
            except Exception as exc:
                log.info("could not revoke the leader lease: %s", exc)
        self.leading = False
        _close_quietly(self._client)
        self._client = None


class LeaderResolver:
    """Reads the leader key (clients and servers follow it)."""

    def __init__(self, url: str, timeout: float) -> None:
        self.url = url
        self.key = leader_key(url)
        self.timeout = timeout
        self._client: Any = None
        self._endpoint = 0
        self._lock = threading.Lock()

    def leader(self) -> str | None:
        """The leader's address, or None when there is none (or etcd does not answer)."""
        with self._lock:
            try:
                if self._client is None:
                    self._client = _etcd_client(self.url, self.timeout, self._endpoint)
                value, _ = self._client.get(self.key)
            except ConfigError:
                raise
            except Exception as exc:
                log.info("etcd did not tell the leader: %s: %s", type(exc).__name__, exc)
                _close_quietly(self._client)
                self._client = None
                self._endpoint += 1
                return None
        return None if value is None else bytes(value).decode()

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None
