"""The distributed KV store: a master (metadata only), store servers (memory and SSD), clients.

    from mooncake_connectors.store import Master, StoreServer, StoreClient
    from mooncake_connectors.store.config import MasterConfig, ServerConfig, ClientConfig

See docs/store.md. Names are imported lazily so ``import mooncake_connectors.store`` stays cheap.
"""

from __future__ import annotations

from ..lazy import lazy_exports

_EXPORTS = {
    "Master": ".master",
    "StoreServer": ".server",
    "StoreClient": ".client",
    "MasterConfig": ".config",
    "ServerConfig": ".config",
    "ClientConfig": ".config",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
