"""``p2p``: no central service; each process answers for its own segment.

The backend embeds a tiny HTTP endpoint (the same one as the ``http`` backend's server) on the
engine's host; the segment is named ``HOST:PORT`` of that endpoint, and a lookup asks that
address directly — Mooncake's ``P2PHANDSHAKE`` mode. Generic keys stay local to the process.
"""

from __future__ import annotations

import threading

from ...config import EngineConfig
from ...errors import AuthenticationError, MetadataError, SegmentNotFound
from ...plugins import hookimpl
from ...tls import TlsConfig
from ..descriptor import SegmentDesc, decode_segment
from .base import SEGMENT_PREFIX, MetadataBackend
from .http import HttpClient, MetadataHTTPServer


class P2PMetadata(MetadataBackend):
    scheme = "p2p"

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        timeout: float = 5.0,
        token: str | None = None,
        tls: TlsConfig | None = None,
    ) -> None:
        # Peers only read a p2p endpoint; accepting their writes would let anyone who reaches it
        # replace this process's descriptor.
        self.server = MetadataHTTPServer(
            host, port, path="/metadata", token=token, writable=False, tls=tls
        ).start()
        self.tls = tls  # all peers of a p2p cluster speak TLS, or none
        self.host = host
        self.timeout = timeout
        self.token = token
        self._clients: dict[str, HttpClient] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str, config: EngineConfig | None = None) -> P2PMetadata:
        if config is None:
            return cls()
        return cls(
            config.host,
            0,
            timeout=config.connect_timeout,
            token=config.auth_token,
            tls=config.tls,
        )

    @property
    def address(self) -> str:
        h = f"[{self.host}]" if ":" in self.host else self.host
        return f"{h}:{self.server.port}"

    def segment_name(self, preferred: str) -> str:
        return self.address

    def put(self, key: str, value: bytes) -> None:
        self.server.local_put(key, bytes(value))

    def get(self, key: str) -> bytes | None:
        return self.server.local_get(key)

    def delete(self, key: str) -> bool:
        return self.server.local_delete(key)

    def list(self, prefix: str) -> dict[str, bytes]:
        return {}  # nothing central to enumerate in p2p mode

    def lookup_segment(self, name: str) -> SegmentDesc:
        if name == self.address:
            return super().lookup_segment(name)
        with self._lock:
            client = self._clients.get(name)
            if client is None:
                client = HttpClient(
                    f"{self.server.scheme}://{name}/metadata",
                    timeout=self.timeout,
                    token=self.token,
                    tls=self.tls,
                )
                self._clients[name] = client
        try:
            status, data = client.request("GET", {"key": SEGMENT_PREFIX + name})
        except MetadataError as exc:
            raise SegmentNotFound(
                f"peer {name} does not answer: {exc.message}", segment=name
            ) from exc
        if status == 401:  # final: asking again with the same token cannot help
            raise AuthenticationError(f"peer {name} refused our token", peer=name)
        if status == 404:
            raise SegmentNotFound(f"peer {name} publishes no segment of that name", segment=name)
        if status != 200:
            raise MetadataError(f"peer {name} answered {status}", segment=name)
        return decode_segment(data, source=name)

    def close(self) -> None:
        with self._lock:
            for c in self._clients.values():
                c.close()
            self._clients.clear()
        self.server.stop()


@hookimpl
def mooncake_metadata() -> type[MetadataBackend]:
    return P2PMetadata
