"""SGLang HiCache storage backend over our store (see docs/sglang.md).

    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "mooncake_connectors",
        "module_path": "mooncake_connectors.adapters.sglang", "class_name": "HiCacheStore",
        "interface_v1": 1, "master": "127.0.0.1:50051"}'

``HiCacheStore`` is imported lazily: ``config``, ``keys`` and ``pages`` import neither sglang
nor torch, so this package can be imported (and its config checked) without SGLang.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "HiCacheStore": ".storage",
    "HiCacheStoreConfig": ".config",
    "from_extra_config": ".config",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module, __name__), name)
