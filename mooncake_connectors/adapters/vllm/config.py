"""``kv_connector_extra_config`` of the PD connector: documented keys, validated once.

Pure Python (no vLLM import) so it is tested and documented on its own. Every key is listed in
:data:`PD_KEYS`; an unknown key is an error that names it and the allowed ones, because a typo
silently ignored (``transfer_timout``) would leave the default deadline in force.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ...config import EngineConfig, engine_config_from_env
from ...errors import ConfigError
from .extra_config import known_keys, number, transports

CONNECTOR_NAME = "MooncakeConnectorsPD"

# key -> one-line description (docs/vllm.md repeats this table)
PD_KEYS: dict[str, str] = {
    "host": "address the transfer engine and the side channel bind and advertise "
    "(default 127.0.0.1)",
    "side_channel_port": "first side-channel port; TP rank r uses port+r "
    "(default 0: any free port)",
    "metadata": "transfer-engine metadata backend (default p2p: no central service)",
    "transports": "transfer-engine transports in preference order (default ['shm', 'tcp'])",
    "tcp_lanes": "TCP connections per peer (default 4)",
    "auth_token": "shared secret for the transfer engine's TCP ports (default none)",
    "transfer_timeout": "deadline in seconds for one request's KV read on decode (default 20)",
    "handshake_timeout": "deadline in seconds for one side-channel exchange (default 5)",
    "kv_lease": "seconds prefill keeps a finished request's blocks for decode (default 120)",
    "metrics_port": "serve the transfer engine's Prometheus metrics on this port (default off)",
    "accept_push": "decode: let prefill instances write KV into this instance's blocks layer by "
    "layer (layer-wise push; default false: peers may only read)",
}


@dataclasses.dataclass(frozen=True)
class PDConfig:
    """Validated settings of :class:`MooncakeConnectorsPD` (see :data:`PD_KEYS`)."""

    host: str = "127.0.0.1"
    side_channel_port: int = 0
    metadata: str = "p2p"
    transports: tuple[str, ...] = ("shm", "tcp")
    tcp_lanes: int = 4
    auth_token: str | None = None
    transfer_timeout: float = 20.0
    handshake_timeout: float = 5.0
    kv_lease: float = 120.0
    metrics_port: int | None = None
    accept_push: bool = False

    def __post_init__(self) -> None:
        if not self.host or any(c.isspace() for c in self.host):
            raise ConfigError(f"kv_connector_extra_config['host'] is not an address: {self.host!r}")
        if not 0 <= self.side_channel_port <= 65535:
            raise ConfigError(
                f"kv_connector_extra_config['side_channel_port'] must be in 0..65535, "
                f"got {self.side_channel_port}"
            )
        for key in ("transfer_timeout", "handshake_timeout", "kv_lease"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"kv_connector_extra_config[{key!r}] must be > 0")
        if self.kv_lease <= self.transfer_timeout:
            # The prefill side must hold the blocks at least as long as a read may take.
            raise ConfigError(
                f"kv_connector_extra_config['kv_lease'] ({self.kv_lease}s) must exceed "
                f"'transfer_timeout' ({self.transfer_timeout}s)"
            )
        self.engine_config()  # the transfer-engine fields are validated by EngineConfig

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> PDConfig:
        """Build from vLLM's ``kv_connector_extra_config``; unknown keys raise ConfigError."""
        extra = known_keys(CONNECTOR_NAME, extra, PD_KEYS)
        values: dict[str, Any] = {}
        for key, value in extra.items():
            if key in ("host", "metadata"):
                if not isinstance(value, str):
                    raise ConfigError(f"kv_connector_extra_config[{key!r}] must be a string")
                values[key] = value
            elif key == "accept_push":
                if not isinstance(value, bool):
                    raise ConfigError(
                        "kv_connector_extra_config['accept_push'] must be true or false"
                    )
                values[key] = value
            elif key == "auth_token":
                if value is not None and not isinstance(value, str):
                    raise ConfigError("kv_connector_extra_config['auth_token'] must be a string")
                values[key] = value
            elif key == "transports":
                values[key] = transports(value)
            elif key in ("side_channel_port", "tcp_lanes"):
                values[key] = int(number(key, value, integer=True))
            elif key == "metrics_port":
                values[key] = None if value is None else int(number(key, value, integer=True))
            else:
                values[key] = float(number(key, value))
        return cls(**values)

    def engine_config(self) -> EngineConfig:
        """The transfer engine's settings; MOONCAKE_CONNECTORS_* variables fill the rest."""
        overrides: dict[str, object] = {
            "host": self.host,
            "metadata": self.metadata,
            "transports": self.transports,
            "tcp_lanes": self.tcp_lanes,
            "timeout": self.transfer_timeout,
            "connect_timeout": min(self.handshake_timeout, 5.0),
        }
        if self.auth_token is not None:
            overrides["auth_token"] = self.auth_token
        if self.metrics_port is not None:
            overrides["metrics_port"] = self.metrics_port
        return engine_config_from_env(None, **overrides)
