"""``kv_connector_extra_config`` of the store connector: documented keys, validated once.

Pure Python (no vLLM import), tested and documented on its own. Every key is in
:data:`STORE_KEYS`; the shared :class:`~mooncake_connectors.extra_config.Schema` refuses any other
and checks each value's type.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ...config import DEFAULT_TRANSPORTS, Credentials
from ...errors import ConfigError
from ...extra_config import TLS_KEYS, Key, Kind, Schema, client_config
from ...store.config import ClientConfig

STORE_CONNECTOR_NAME = "MooncakeConnectorsStore"

# docs/vllm.md repeats these descriptions
STORE_KEYS: dict[str, Key] = {
    "master": Key(
        Kind.TEXT,
        "the store master, host:port or etcd://HOST:PORT/PREFIX (default 127.0.0.1:50051)",
    ),
    "host": Key(
        Kind.TEXT, "address this instance's store client binds and advertises (default 127.0.0.1)"
    ),
    "metadata": Key(
        Kind.TEXT, "transfer-engine metadata backend (default: what the master announces)", True
    ),
    "transports": Key(
        Kind.NAMES, "transfer-engine transports in preference order (default ['shm', 'tcp'])"
    ),
    "namespace": Key(
        Kind.TEXT, "first part of every key; instances share KV only within one (default vllm)"
    ),
    "model_name": Key(
        Kind.TEXT,
        "model part of the keys (default: vLLM's model); set the same on instances that load "
        "one model from different paths",
        True,
    ),
    "timeout": Key(Kind.FLOAT, "deadline in seconds of one request's KV load or save (default 10)"),
    "lookup_timeout": Key(
        Kind.FLOAT, "deadline in seconds of the scheduler's existence query (default 1)"
    ),
    "cooldown": Key(
        Kind.FLOAT,
        "seconds the store is skipped after it failed or could not be reached, before it is "
        "tried again (default 5)",
    ),
    "replicas": Key(Kind.INT, "copies of each saved block (default 1)"),
    "auth_token": Key(
        Kind.TEXT,
        "the store's shared secret (default: MOONCAKE_CONNECTORS_STORE_TOKEN, else none)",
        nullable=True,
    ),
    "load_async": Key(
        Kind.BOOL,
        "true: load on a worker thread while vLLM keeps stepping; false: load inside the step "
        "that schedules the request (lower TTFT; that step waits for the load) (default false)",
    ),
    "lookup_async": Key(
        Kind.BOOL,
        "true: the scheduler's existence query runs on a thread and vLLM skips the request "
        "until it answers (a slow or hung store never holds a scheduler step); false: it runs "
        "inside the scheduler step (default true)",
    ),
    "save_during_prefill": Key(
        Kind.BOOL,
        "true: the full prompt blocks a step computed are saved right after that step, while "
        "the request still runs (chunked prefill saves as it goes); false: saved when the "
        "request finishes (default true)",
    ),
    **TLS_KEYS,
}
SCHEMA = Schema(
    STORE_CONNECTOR_NAME,
    STORE_KEYS,
    label=lambda key: f"kv_connector_extra_config[{key!r}]",
    deprecated={"reconnect_interval": "cooldown"},
)


@dataclasses.dataclass(frozen=True)
class StoreConnectorConfig(Credentials):
    """Validated settings of ``MooncakeConnectorsStore`` (see :data:`STORE_KEYS`)."""

    master: str = "127.0.0.1:50051"
    host: str = "127.0.0.1"
    metadata: str | None = None
    transports: tuple[str, ...] = DEFAULT_TRANSPORTS
    namespace: str = "vllm"
    model_name: str | None = None
    timeout: float = 10.0
    lookup_timeout: float = 1.0
    cooldown: float = 5.0
    replicas: int = 1
    load_async: bool = False
    lookup_async: bool = True
    save_during_prefill: bool = True

    def __post_init__(self) -> None:
        for key in ("timeout", "lookup_timeout", "cooldown"):
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
        return cls(**SCHEMA.parse(extra))

    def client_config(self, timeout: float) -> ClientConfig:
        """A store client whose every call (connecting too) ends within ``timeout`` seconds."""
        return client_config(
            master=self.master,
            host=self.host,
            metadata=self.metadata,
            transports=self.transports,
            timeout=timeout,
            local_buffer_size=1 << 20,  # KV moves zero-copy from vLLM's registered blocks
            **self.credentials(),
        )
