"""The ``rdma`` transport (pyverbs): see transport.py. Registered through the entry point
``mooncake_connectors.transports: rdma``; pyverbs itself is imported only when it starts."""

from __future__ import annotations

from ....plugins import hookimpl
from ...transport import Transport
from .settings import RdmaSettings
from .transport import RdmaTransport


@hookimpl
def mooncake_transport() -> type[Transport]:
    return RdmaTransport


__all__ = ["RdmaSettings", "RdmaTransport"]
