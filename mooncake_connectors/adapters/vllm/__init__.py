"""vLLM adapters: the PD-disaggregation connector ``MooncakeConnectorsPD``.

Loaded by name through the ``vllm.general_plugins`` entry point (``plugin.register``), or by
``kv_connector_module_path="mooncake_connectors.adapters.vllm"``. Importing this package does not
import vLLM; the connector class loads on first access.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MooncakeConnectorsPD"]


def __getattr__(name: str) -> Any:
    if name == "MooncakeConnectorsPD":
        from .connector import MooncakeConnectorsPD

        return MooncakeConnectorsPD
    raise AttributeError(name)
