"""``memory``: an in-process dictionary, shared by every backend opened on the same URL."""

from __future__ import annotations

import threading

from ...config import EngineConfig
from ...plugins import hookimpl
from .base import MetadataBackend

_spaces: dict[str, dict[str, bytes]] = {}
_spaces_lock = threading.Lock()


class MemoryMetadata(MetadataBackend):
    scheme = "memory"

    def __init__(self, namespace: str = "default") -> None:
        with _spaces_lock:
            self._data = _spaces.setdefault(namespace, {})
        self._lock = _spaces_lock

    @classmethod
    def from_url(cls, url: str, config: EngineConfig | None = None) -> MemoryMetadata:
        _, _, ns = url.partition("://")
        return cls(ns or "default")

    def put(self, key: str, value: bytes) -> None:
        with self._lock:
            self._data[key] = bytes(value)

    def get(self, key: str) -> bytes | None:
        with self._lock:
            return self._data.get(key)

    def delete(self, key: str) -> bool:
        with self._lock:
            return self._data.pop(key, None) is not None

    def list(self, prefix: str) -> dict[str, bytes]:
        with self._lock:
            return {k: v for k, v in self._data.items() if k.startswith(prefix)}


@hookimpl
def mooncake_metadata() -> type[MetadataBackend]:
    return MemoryMetadata
