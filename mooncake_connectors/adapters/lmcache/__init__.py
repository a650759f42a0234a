"""LMCache remote storage plugin: LMCache's remote backend keeps its chunks in our store.

In LMCache's config (see docs/lmcache.md)::

    remote_storage_plugins: ["mooncake_connectors"]
    extra_config:
      remote_storage_plugin.mooncake_connectors.module_path: mooncake_connectors.adapters.lmcache
      remote_storage_plugin.mooncake_connectors.class_name: StoreConnector
      remote_storage_plugin.mooncake_connectors.master: "127.0.0.1:50051"

``StoreConnector`` is imported lazily (it imports lmcache); :mod:`.config` does not need
lmcache.
"""

from __future__ import annotations

from ...lazy import lazy_exports

_EXPORTS = {
    "StoreConnector": ".connector",
    "PluginConfig": ".config",
    "Layout": ".config",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
