"""SGLang HiCache storage backend over our store (see docs/sglang.md).

    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "mooncake_connectors",
        "module_path": "mooncake_connectors.adapters.sglang", "class_name": "HiCacheStore",
        "interface_v1": 1, "master": "127.0.0.1:50051"}'

``HiCacheStore`` is imported lazily: ``config``, ``keys`` and ``pages`` import neither sglang
nor torch, so this package can be imported (and its config checked) without SGLang.
"""

from __future__ import annotations

from ...lazy import lazy_exports

_EXPORTS = {
    "HiCacheStore": ".storage",
    "HiCacheStoreConfig": ".config",
    "from_extra_config": ".config",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
