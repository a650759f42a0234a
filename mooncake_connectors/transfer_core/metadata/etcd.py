"""``etcd``: segment metadata in an etcd v3 cluster, for many machines.

Uses the ``python3-etcd3`` client (``import etcd3``; works on current protobuf, unlike etcd3 0.12).
URL: ``etcd://HOST:PORT[,HOST:PORT...][/PREFIX]``. Every call has the engine's connect timeout;
when an endpoint fails the next one is tried, and if all fail a MetadataError names them.
A segment published with a lease is attached to an etcd lease of that TTL (whole seconds),
refreshed by each renewal; etcd deletes it when the publisher stops renewing.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from ...config import EngineConfig
from ...errors import ConfigError, MetadataError
from ...plugins import hookimpl
from ..descriptor import SegmentDesc, encode_segment
from .base import SEGMENT_PREFIX, MetadataBackend

log = logging.getLogger(__name__)
T = TypeVar("T")


def parse_etcd_url(url: str) -> tuple[list[tuple[str, int]], str]:
    rest = url.split("://", 1)[1] if "://" in url else url
    hosts, _, prefix = rest.partition("/")
    endpoints: list[tuple[str, int]] = []
    for hp in hosts.split(","):
        host, _, port = hp.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"etcd endpoint {hp!r} in {url!r} must be HOST:PORT")
        endpoints.append((host.strip("[]"), int(port)))
    return endpoints, "/" + (prefix.strip("/") or "mooncake_connectors") + "/"


class EtcdMetadata(MetadataBackend):
    scheme = "etcd"
    central = True

    def __init__(self, url: str, *, timeout: float = 5.0) -> None:
        try:
            import etcd3
        except ImportError as exc:
            raise ConfigError(
                "the etcd metadata backend needs python3-etcd3: "
                "pip install 'mooncake-connectors[etcd]'"
            ) from exc
        self._etcd3: Any = etcd3
        self.url = url
        self.endpoints, self.prefix = parse_etcd_url(url)
        self.timeout = timeout
        self._clients: dict[int, Any] = {}
        self._current = 0
        self._lock = threading.Lock()
        self._leases: dict[str, int] = {}  # segment name -> the etcd lease id it is put under

    @classmethod
    def from_url(cls, url: str, config: EngineConfig | None = None) -> EtcdMetadata:
        return cls(url, timeout=config.connect_timeout if config else 5.0)

    def _client(self, i: int) -> Any:
        c = self._clients.get(i)
        if c is None:
            host, port = self.endpoints[i]
            c = self._etcd3.client(host=host, port=port, timeout=self.timeout)
            self._clients[i] = c
        return c

    def _call(self, fn: Callable[[Any], T]) -> T:
        errors = []
        n = len(self.endpoints)
        with self._lock:
            start = self._current
        for k in range(n):
            i = (start + k) % n
            try:
                result = fn(self._client(i))
            except Exception as exc:  # grpc and etcd3 errors: map once, here
                # etcd3 marks a node failed for good after an error; a new client recovers once
                # the endpoint is back.
                self._drop(i)
                errors.append(
                    f"{self.endpoints[i][0]}:{self.endpoints[i][1]}: {type(exc).__name__}: {exc}"
                )
                continue
            if i != start:
                with self._lock:
                    self._current = i
            return result
        raise MetadataError("etcd unreachable: " + "; ".join(errors), url=self.url)

    def put(self, key: str, value: bytes) -> None:
        self._call(lambda c: c.put(self.prefix + key, bytes(value)))

    def get(self, key: str) -> bytes | None:
        value, _ = self._call(lambda c: c.get(self.prefix + key))
        return None if value is None else bytes(value)

    def delete(self, key: str) -> bool:
        return bool(self._call(lambda c: c.delete(self.prefix + key)))

    def list(self, prefix: str) -> dict[str, bytes]:
        items = self._call(lambda c: list(c.get_prefix(self.prefix + prefix)))
        n = len(self.prefix)
        return {meta.key.decode()[n:]: bytes(value) for value, meta in items}

    def publish_segment(self, desc: SegmentDesc, lease: float = 0.0) -> None:
        key, value = self.prefix + SEGMENT_PREFIX + desc.name, encode_segment(desc)
        if lease <= 0:
            self._call(lambda c: c.put(key, value))
            return
        lease_id = self._leases.get(desc.name)
        if lease_id is not None:  # a renewal: keep the lease alive (gone after an outage: anew)
            answers = self._call(lambda c: list(c.refresh_lease(lease_id)))
            if not answers or answers[0].TTL <= 0:
                lease_id = None
        if lease_id is None:
            ttl = max(1, math.ceil(lease))
            lease_id = int(self._call(lambda c: c.lease(ttl)).id)
            self._leases[desc.name] = lease_id
        held = lease_id
        self._call(lambda c: c.put(key, value, lease=held))

    def remove_segment(self, name: str) -> bool:
        lease_id = self._leases.pop(name, None)
        if lease_id is not None:
            self._call(lambda c: c.revoke_lease(lease_id))  # (deletes the key with it)
        return bool(self._call(lambda c: c.delete(self.prefix + SEGMENT_PREFIX + name))) or (
            lease_id is not None
        )

    def withdraw_segment(self, name: str, timeout: float) -> None:
        host, port = self.endpoints[self._current]
        try:  # a client of its own: another thread may be inside the usual one
            c = self._etcd3.client(host=host, port=port, timeout=timeout)
        except Exception as exc:  # grpc and etcd3 errors: nothing to do at exit
            log.debug("withdrawing segment %s at exit: %s", name, exc)
            return
        try:
            c.delete(self.prefix + SEGMENT_PREFIX + name)
        except Exception as exc:  # as above
            log.debug("withdrawing segment %s at exit: %s", name, exc)
        finally:
            try:
                c.close()
            except Exception as exc:  # as above
                log.debug("closing the exit-time etcd client: %s", exc)

    def _drop(self, i: int) -> None:
        c = self._clients.pop(i, None)
        if c is not None:
            try:
                c.close()
            except Exception as exc:  # a broken channel may fail to close; nothing to do
                log.debug("closing etcd client: %s", exc)

    @property
    def raw(self) -> Any:
        """The underlying etcd3 client of the endpoint in use (leases, elections, watches)."""
        return self._client(self._current)

    def close(self) -> None:
        for i in list(self._clients):
            self._drop(i)


@hookimpl
def mooncake_metadata() -> type[MetadataBackend]:
    return EtcdMetadata
