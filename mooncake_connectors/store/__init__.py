"""The distributed KV store: a master (metadata only), store servers (memory and SSD), clients.

    from mooncake_connectors.store import Master, StoreServer, StoreClient
    from mooncake_connectors.store.config import MasterConfig, ServerConfig, ClientConfig

See docs/store.md. Names are imported lazily so ``import mooncake_connectors.store`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Master": ".master",
    "StoreServer": ".server",
    "StoreClient": ".client",
    "MasterConfig": ".config",
    "ServerConfig": ".config",
    "ClientConfig": ".config",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module, __name__), name)
