"""vLLM adapters: the PD-disaggregation connector ``MooncakeConnectorsPD`` and the prefix-reuse
store connector ``MooncakeConnectorsStore``.

Loaded by name through the ``vllm.general_plugins`` entry point (``plugin.register``), or by
``kv_connector_module_path="mooncake_connectors.adapters.vllm"``. Importing this package does not
import vLLM; the connector classes load on first access.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MooncakeConnectorsPD", "MooncakeConnectorsStore"]


def __getattr__(name: str) -> Any:
    if name == "MooncakeConnectorsPD":
        from .connector import MooncakeConnectorsPD

        return MooncakeConnectorsPD
    if name == "MooncakeConnectorsStore":
        from .store_connector import MooncakeConnectorsStore

        return MooncakeConnectorsStore
    raise AttributeError(name)
