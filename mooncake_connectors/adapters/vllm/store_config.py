"""``kv_connector_extra_config`` of the store connector: documented keys, validated once.

Pure Python (no vLLM import), tested and documented on its own. Every key is in
:data:`STORE_KEYS`; an unknown key is an error naming it and the allowed ones (a typo such as
``timout`` silently ignored would leave the default deadline in force).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ...errors import ConfigError
from ...store.config import ClientConfig
from .extra_config import known_keys, number, transports

STORE_CONNECTOR_NAME = "MooncakeConnectorsStore"

# key -> one-line description (docs/vllm.md repeats this table)
STORE_KEYS: dict[str, str] = {
    "master": "the store master, host:port or etcd://HOST:PORT/PREFIX (default 127.0.0.1:50051)",
    "host": "address this instance's store client binds and advertises (default 127.0.0.1)",
    "metadata": "transfer-engine metadata backend (default: what the master announces)",
    "transports": "transfer-engine transports in preference order (default ['shm', 'tcp'])",
    "namespace": "first part of every key; instances share KV only within one (default vllm)",
    "model_name": "model part of the keys (default: vLLM's model); set the same on instances "
    "that load one model from different paths",
    "timeout": "deadline in seconds of one request's KV load or save (default 10)",
    "lookup_timeout": "deadline in seconds of the scheduler's existence query (default 1)",
    "reconnect_interval": "seconds between attempts to reach an absent store (default 5)",
    "replicas": "copies of each saved block (default 1)",
    "load_async": "true: load on a worker thread while vLLM keeps stepping; false: load inside "
    "the step that schedules the request (lower TTFT; that step waits for the load) "
    "(default false)",
}


@dataclasses.dataclass(frozen=True)
class StoreConnectorConfig:
    """Validated settings of ``MooncakeConnectorsStore`` (see :data:`STORE_KEYS`)."""

    master: str = "127.0.0.1:50051"
    host: str = "127.0.0.1"
    metadata: str | None = None
    transports: tuple[str, ...] = ("shm", "tcp")
    namespace: str = "vllm"
    model_name: str | None = None
    timeout: float = 10.0
    lookup_timeout: float = 1.0
    reconnect_interval: float = 5.0
    replicas: int = 1
    load_async: bool = False

    def __post_init__(self) -> None:
        for key in ("timeout", "lookup_timeout", "reconnect_interval"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"kv_connector_extra_config[{key!r}] must be > 0")
        if self.replicas < 1:
            raise ConfigError("kv_connector_extra_config['replicas'] must be >= 1")
        if not self.namespace or "/" in self.namespace:
            raise ConfigError(
                f"kv_connector_extra_config['namespace'] must be non-empty without '/': "
                f"{self.namespace!r}"
            )
        if not self.transports:
            raise ConfigError("kv_connector_extra_config['transports'] is empty")
        self.client_config(self.timeout)  # master address and host are checked there

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> StoreConnectorConfig:
        """Build from vLLM's ``kv_connector_extra_config``; unknown keys raise ConfigError."""
        extra = known_keys(STORE_CONNECTOR_NAME, extra, STORE_KEYS)
        values: dict[str, Any] = {}
        for key, value in extra.items():
            if key in ("master", "host", "namespace", "metadata", "model_name"):
                if key in ("metadata", "model_name") and value is None:
                    values[key] = None
                    continue
                if not isinstance(value, str) or not value:
                    raise ConfigError(
                        f"kv_connector_extra_config[{key!r}] must be a non-empty string"
                    )
                values[key] = value
            elif key == "transports":
                values[key] = transports(value)
            elif key == "load_async":
                if not isinstance(value, bool):
                    raise ConfigError(
                        "kv_connector_extra_config['load_async'] must be true or false"
                    )
                values[key] = value
            elif key == "replicas":
                values[key] = int(number(key, value, integer=True))
            else:
                values[key] = float(number(key, value))
        return cls(**values)

    def client_config(self, timeout: float) -> ClientConfig:
        """A store client whose every call ends within ``timeout`` seconds."""
        return ClientConfig(
            master=self.master,
            host=self.host,
            metadata=self.metadata,
            transports=self.transports,
            timeout=timeout,
            rpc_timeout=min(timeout, 5.0),
            replica_timeout=min(timeout, 1.0),
            local_buffer_size=1 << 20,  # KV moves zero-copy from vLLM's registered blocks
        )
