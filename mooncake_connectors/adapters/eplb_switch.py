"""The environment switches that put our EPLB pieces into the engines (engine-free, so that the
engines' plugin entry points can read them without importing any EPLB code)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from ..errors import ConfigError

EPLB_POLICY_ENV = "MOONCAKE_CONNECTORS_EPLB_POLICY"
EPLB_COMMUNICATOR_ENV = "MOONCAKE_CONNECTORS_EPLB_COMMUNICATOR"
OURS = "mooncake"


def wants_ours(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """True when ``name`` says ``mooncake``, False when unset or ``default``; else ConfigError."""
    value = (os.environ if environ is None else environ).get(name, "").strip()
    if value in ("", "default"):
        return False
    if value != OURS:
        raise ConfigError(f"{name} must be 'default' or {OURS!r}, got {value!r}")
    return True
