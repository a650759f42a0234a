"""``kv_connector_extra_config`` of the PD connector: documented keys, validated once.

Pure Python (no vLLM import) so it is tested and documented on its own. Every key is listed in
:data:`PD_KEYS`; the shared :class:`~mooncake_connectors.extra_config.Schema` refuses any other
(a typo such as ``transfer_timout`` silently ignored would leave the default deadline in force)
and checks each value's type.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ...config import DEFAULT_TRANSPORTS, Credentials, EngineConfig
from ...errors import ConfigError
from ...extra_config import TLS_KEYS, Key, Kind, Schema, engine_config

CONNECTOR_NAME = "MooncakeConnectorsPD"

# docs/vllm.md repeats these descriptions
PD_KEYS: dict[str, Key] = {
    "host": Key(
        Kind.TEXT,
        "address the transfer engine and the side channel bind and advertise (default 127.0.0.1)",
        empty=True,  # refused by PDConfig with its own message
    ),
    "side_channel_port": Key(
        Kind.INT, "first side-channel port; TP rank r uses port+r (default 0: any free port)"
    ),
    "metadata": Key(
        Kind.TEXT, "transfer-engine metadata backend (default p2p: no central service)"
    ),
    "transports": Key(
        Kind.NAMES, "transfer-engine transports in preference order (default ['shm', 'tcp'])"
    ),
    "tcp_lanes": Key(Kind.INT, "TCP connections per peer (default 4)"),
    "auth_token": Key(
        Kind.TEXT, "shared secret for the transfer engine's TCP ports (default none)", True
    ),
    "transfer_timeout": Key(
        Kind.FLOAT, "deadline in seconds for one request's KV read on decode (default 20)"
    ),
    "handshake_timeout": Key(
        Kind.FLOAT, "deadline in seconds for one side-channel exchange (default 5)"
    ),
    "kv_lease": Key(
        Kind.FLOAT, "seconds prefill keeps a finished request's blocks for decode (default 120)"
    ),
    "metrics_port": Key(
        Kind.INT, "serve the transfer engine's Prometheus metrics on this port (default off)", True
    ),
    "sync_load_max_bytes": Key(
        Kind.INT,
        "decode: a hand-over of at most this many KV bytes per worker is read inside the step "
        "that schedules the request, larger ones asynchronously (default 16 MiB; 0: always "
        "asynchronously)",
    ),
    "accept_push": Key(
        Kind.BOOL,
        "decode: let prefill instances write KV into this instance's blocks layer by layer "
        "(layer-wise push; default false: peers may only read)",
    ),
    **TLS_KEYS,
}
SCHEMA = Schema(CONNECTOR_NAME, PD_KEYS, label=lambda key: f"kv_connector_extra_config[{key!r}]")


@dataclasses.dataclass(frozen=True)
class PDConfig(Credentials):
    """Validated settings of :class:`MooncakeConnectorsPD` (see :data:`PD_KEYS`)."""

    host: str = "127.0.0.1"
    side_channel_port: int = 0
    metadata: str = "p2p"
    transports: tuple[str, ...] = DEFAULT_TRANSPORTS
    tcp_lanes: int = 4
    transfer_timeout: float = 20.0
    handshake_timeout: float = 5.0
    kv_lease: float = 120.0
    metrics_port: int | None = None
    sync_load_max_bytes: int = 16 << 20
    accept_push: bool = False

    def __post_init__(self) -> None:
        if not self.host or any(c.isspace() for c in self.host):
            raise ConfigError(f"kv_connector_extra_config['host'] is not an address: {self.host!r}")
        if not 0 <= self.side_channel_port <= 65535:
            raise ConfigError(
                f"kv_connector_extra_config['side_channel_port'] must be in 0..65535, "
                f"got {self.side_channel_port}"
            )
        if self.sync_load_max_bytes < 0:
            raise ConfigError("kv_connector_extra_config['sync_load_max_bytes'] must be >= 0")
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
        return cls(**SCHEMA.parse(extra))

    def engine_config(self) -> EngineConfig:
        """The transfer engine's settings; MOONCAKE_CONNECTORS_* variables fill the rest."""
        return engine_config(
            host=self.host,
            metadata=self.metadata,
            transports=self.transports,
            timeout=self.transfer_timeout,
            connect_timeout=min(self.handshake_timeout, 5.0),
            tcp_lanes=self.tcp_lanes,
            metrics_port=self.metrics_port,
            **self.credentials(),
        )
