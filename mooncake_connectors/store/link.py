"""A client's (or server's) way to the current master: one channel per thread, leader following.

``call`` sends a request to the master and waits for the reply until the call's deadline. A lost
connection, a silent master or a ``NOT_LEADER`` answer makes it look the leader up again (from
etcd when the master address is ``etcd://…``) and retry, so a caller sees a master fail-over as
latency, not as an error, as long as a leader appears before the deadline. Every request the
store sends is safe to repeat (puts carry an id the master recognises).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

from ..errors import MasterUnavailable
from ..tls import TlsConfig
from .config import ClientConfig, ServerConfig
from .ha import LeaderResolver
from .protocol import Code, Err, Msg
from .rpc import Channel

log = logging.getLogger(__name__)
_RETRY_PAUSE = 0.05


@dataclasses.dataclass(frozen=True)
class Dialer:
    """How this process opens control channels to store peers (the master, servers' load
    ports): the store's shared secret, TLS files, and whether a loopback peer is reached over
    its abstract unix socket (``local_ipc``, see :class:`Channel`)."""

    token: str | None = dataclasses.field(default=None, repr=False)
    tls: TlsConfig | None = None
    local_ipc: bool = True

    @classmethod
    def of(cls, cfg: ClientConfig | ServerConfig) -> Dialer:
        return cls(cfg.auth_token, cfg.tls, cfg.local_ipc)

    def channel(self, address: str, timeout: float) -> Channel:
        return Channel(address, timeout, self.token, self.tls, local_ipc=self.local_ipc)


class MasterLink:
    def __init__(self, master: str, rpc_timeout: float, dial: Dialer | None = None) -> None:
        self.master = master
        self.dial = dial or Dialer()
        self.rpc_timeout = rpc_timeout
        self._resolver = (
            LeaderResolver(master, rpc_timeout) if master.startswith("etcd://") else None
        )
        self._address: str | None = None if self._resolver else master
        self._local = threading.local()
        self._lock = threading.Lock()
        self._channels: list[Channel] = []
        self._closed = False

    def address(self) -> str | None:
        """The master to talk to now (None while no leader is known)."""
        if self._address is None and self._resolver is not None:
            self._address = self._resolver.leader()
        return self._address

    def invalidate(self, hint: str = "") -> None:
        if self._resolver is not None:
            self._address = hint or None

    def _channel(self, address: str, timeout: float) -> Channel:
        ch: Channel | None = getattr(self._local, "ch", None)
        if ch is not None and (ch.closed or ch.address != address):
            ch.close()
            ch = None
        if ch is None:
            ch = self.dial.channel(address, timeout)
            self._local.ch = ch
            with self._lock:
                self._channels = [c for c in self._channels if not c.closed]
                self._channels.append(ch)
        return ch

    def call(self, msg: Msg, deadline: float) -> Msg:
        """The master's reply to ``msg`` (an ``Err`` reply is returned, not raised)."""
        last = "no attempt"
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or self._closed:
                raise MasterUnavailable(
                    f"no master answered {type(msg).__name__} in time (last: {last})",
                    master=self.master,
                )
            address = self.address()
            if address is None:
                last = "no leader elected"
                time.sleep(min(_RETRY_PAUSE, left))
                continue
            try:
                ch = self._channel(address, min(left, self.rpc_timeout))
                reply = ch.call(msg, min(left, self.rpc_timeout))
            except (TimeoutError, ConnectionError, OSError) as exc:
                last = f"{address}: {exc}"
                log.debug("master call failed: %s", last)
                stale: Channel | None = getattr(self._local, "ch", None)
                if stale is not None:
                    stale.close()
                self.invalidate()
                time.sleep(min(_RETRY_PAUSE, max(0.0, deadline - time.monotonic())))
                continue
            if isinstance(reply, Err) and reply.code == Code.NOT_LEADER:
                last = f"{address} is not the leader"
                self.invalidate(reply.leader if reply.leader != address else "")
                time.sleep(min(_RETRY_PAUSE, max(0.0, deadline - time.monotonic())))
                continue
            return reply

    def close(self) -> None:
        self._closed = True
        with self._lock:
            for ch in self._channels:
                ch.close()
            self._channels.clear()
        if self._resolver is not None:
            self._resolver.close()
