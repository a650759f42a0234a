"""Checks shared by our connectors' ``kv_connector_extra_config`` parsers (no vLLM import)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...errors import ConfigError


def known_keys(
    connector: str, extra: Mapping[str, Any] | None, allowed: Mapping[str, str]
) -> dict[str, Any]:
    """``extra`` as a dict; a key not in ``allowed`` is an error naming it and the allowed ones."""
    values = dict(extra or {})
    unknown = sorted(set(values) - set(allowed))
    if unknown:
        raise ConfigError(
            f"{connector}: unknown kv_connector_extra_config key(s) {unknown}; "
            f"allowed: {sorted(allowed)}"
        )
    return values


def number(key: str, value: Any, *, integer: bool = False) -> float:
    """``value`` as a number (an int when ``integer``); booleans and strings are errors."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"kv_connector_extra_config[{key!r}] must be a number, got {value!r}")
    if integer and not isinstance(value, int):
        raise ConfigError(f"kv_connector_extra_config[{key!r}] must be an integer, got {value!r}")
    return value


def transports(value: Any) -> tuple[str, ...]:
    """A list of transport names, or one comma-separated string."""
    if isinstance(value, str):
        value = [t.strip() for t in value.split(",") if t.strip()]
    if not isinstance(value, (list, tuple)) or not all(isinstance(t, str) for t in value):
        raise ConfigError("kv_connector_extra_config['transports'] must be a list of names")
    return tuple(value)
