"""Metadata backends, found through the ``mooncake_connectors.metadata`` entry points."""

from __future__ import annotations

from ...config import EngineConfig
from ...plugins import METADATA_GROUP, Registry
from .base import MetadataBackend

METADATA_BACKENDS: Registry[MetadataBackend] = Registry(METADATA_GROUP, "mooncake_metadata")

# Mooncake spells p2p mode this way in its metadata_server argument.
_ALIASES = {"p2phandshake": "p2p", "https": "http"}  # https: the http backend over TLS


def scheme_of(url: str) -> str:
    scheme = url.split("://", 1)[0] if "://" in url else url
    scheme = scheme.lower()
    return _ALIASES.get(scheme, scheme)


def open_metadata(url: str, config: EngineConfig | None = None) -> MetadataBackend:
    """Open the backend for ``url``: ``memory[://NS]``, ``http://…``, ``etcd://…``, ``p2p``."""
    return METADATA_BACKENDS.get(scheme_of(url)).from_url(url, config)


__all__ = ["METADATA_BACKENDS", "MetadataBackend", "open_metadata", "scheme_of"]
