"""A store client that is connected in the background and stays optional.

vLLM must start and serve whether or not the store is up: the connector asks :meth:`get` for a
client and gets None while there is none (then nothing is looked up, loaded or saved). Connecting
runs on a daemon thread, retried every ``reconnect_interval`` seconds, so neither vLLM's scheduler
loop nor a worker step ever waits for an absent master. After a failed call, :meth:`failed` marks
the store as down for ``reconnect_interval`` seconds, so a dead master costs one deadline, not one
per request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ...errors import MooncakeConnectorsError
from ...store.client import StoreClient
from .store_config import StoreConnectorConfig

log = logging.getLogger(__name__)


class LazyStore:
    def __init__(
        self,
        config: StoreConnectorConfig,
        timeout: float,
        on_connect: Callable[[StoreClient], None] | None = None,
        name: str = "store",
    ) -> None:
        self.config = config
        self.timeout = timeout
        self.on_connect = on_connect
        self.name = name
        self._client: StoreClient | None = None
        self._down_until = 0.0
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._connected = threading.Event()
        self._thread = threading.Thread(target=self._connect_loop, name=f"mc-{name}", daemon=True)
        self._thread.start()

    def _connect_loop(self) -> None:
        warned = False
        # Connecting may take longer than one call may (a busy machine, a master starting up):
        # connect with the store-call deadline, then hold calls to this client's own deadline.
        connect_timeout = max(self.timeout, self.config.timeout)
        while not self._closed.is_set():
            client = StoreClient(self.config.client_config(connect_timeout))
            try:
                client.start()
                client.cfg = self.config.client_config(self.timeout)
                if self.on_connect is not None:
                    self.on_connect(client)
            except (MooncakeConnectorsError, OSError) as exc:
                client.close()
                if not warned:
                    log.warning(
                        "%s: store master %s not reachable (%s); retrying every %.0fs, "
                        "no KV is loaded or saved meanwhile",
                        self.name,
                        self.config.master,
                        exc,
                        self.config.reconnect_interval,
                    )
                    warned = True
                self._closed.wait(self.config.reconnect_interval)
                continue
            with self._lock:
                if self._closed.is_set():
                    client.close()
                    return
                self._client = client
            self._connected.set()
            log.info("%s: connected to store master %s", self.name, self.config.master)
            return

    def get(self) -> StoreClient | None:
        """The connected client, or None (not connected yet, or down after a failed call)."""
        if time.monotonic() < self._down_until:
            return None
        return self._client

    def wait_connected(self, timeout: float) -> bool:
        return self._connected.wait(timeout)

    def failed(self, exc: BaseException) -> None:
        """A call failed as a whole (master unreachable): skip the store for a while."""
        log.warning(
            "%s: store call failed (%s); skipping the store for %.0fs",
            self.name,
            exc,
            self.config.reconnect_interval,
        )
        self._down_until = time.monotonic() + self.config.reconnect_interval

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()
        self._thread.join(timeout=self.timeout + 5)
