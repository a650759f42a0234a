"""Settings of the SGLang HiCache backend, read from SGLang's extra-config (no sglang import here).

    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "mooncake_connectors",
        "module_path": "mooncake_connectors.adapters.sglang", "class_name": "HiCacheStore",
        "interface_v1": 1, "master": "10.0.0.1:50051"}'

Every key below is validated; an unknown key is an error (a typo must not silently fall back to a
default). Mooncake's own keys with the same meaning are accepted under their Mooncake names, and
the ``MOONCAKE_*`` variables SGLang's Mooncake backend reads are honoured where they mean the same
(see :func:`from_extra_config`, the one place this adapter reads the environment). docs/sglang.md
lists them all.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from ...config import DEFAULT_TRANSPORTS, MIB, Credentials, check_host
from ...errors import ConfigError
from ...extra_config import TLS_KEYS, Key, Kind, Schema, client_config
from ...store.config import MAX_REPLICAS, ClientConfig, check_master_address

# Keys SGLang itself puts into extra-config (or pops before we see it); not ours to check.
SGLANG_KEYS = frozenset(
    {
        "backend_name",
        "module_path",
        "class_name",
        "interface_v1",
        "tp_lcm_size",
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys",
    }
)
# SGLang's Mooncake backend keys that mean the same as one of ours.
MOONCAKE_ALIASES = {
    "master_server_address": "master",
    "local_hostname": "host",
    "metadata_server": "metadata",
    "tenant_id": "tenant",
    "extra_backend_tag": "tag",
}
# SGLang's Mooncake backend keys with no meaning here: accepted (so a Mooncake config ports over)
# and ignored with a warning.
MOONCAKE_IGNORED = frozenset(
    {
        "protocol",
        "device_name",
        "master_metrics_port",
        "check_server",
        "standalone_storage",
        "client_server_address",
        "enable_ssd_offload",
        "ssd_offload_path",
        "enable_group_semantics",
    }
)


@dataclasses.dataclass(frozen=True)
class HiCacheStoreConfig(Credentials):
    """The backend's settings (one instance per SGLang rank).

    master: the store master, ``HOST:PORT`` or ``etcd://HOST:PORT/PREFIX`` (required).
    host: address this rank's transfer engine binds and advertises.
    metadata: override the transfer metadata backend the master announces (rarely needed).
    transports: transports of this rank's engine, in preference order.
    global_segment_size: memory all ranks of one SGLang server contribute to the store together
        (embedded mode, like Mooncake's key of that name: each rank gives its share,
        size // (tp_size * pp_size)); 0 (default): the ranks are pure clients and the memory
        comes from ``store-server`` processes.
    local_buffer_size: the client's registered staging memory (used only for memory SGLang did
        not register, e.g. the non-zero-copy get/set calls).
    staging_size: registered memory through which pages of a ``layer_first`` pool are gathered
        and scattered (their layers are not adjacent); batches larger than this go in parts.
    timeout: deadline in seconds of every store call this backend makes (also of connecting).
    rpc_timeout: deadline of one control message within a call (capped at ``timeout``).
    cooldown: after the store was found unreachable, calls answer misses at once for this many
        seconds before the store is tried again (``retry_interval``: its deprecated old name).
    replicas: copies of every object.
    namespace / tenant / tag: leading parts of every key; two deployments sharing one store keep
        apart by any of them. model: the model part of keys (default: SGLang's model name).
    allow_clear: ``clear()`` (SGLang's /clear_hicache_storage_backend) removes every object in
        the store — the store has no per-prefix removal — as SGLang's Mooncake backend does;
        false makes it a logged no-op.
    log_interval: the same failure is logged at most once per this many seconds.
    """

    master: str
    host: str = "127.0.0.1"
    metadata: str | None = None
    transports: tuple[str, ...] = DEFAULT_TRANSPORTS
    global_segment_size: int = 0
    local_buffer_size: int = 16 * MIB
    staging_size: int = 64 * MIB
    timeout: float = 5.0
    rpc_timeout: float = 1.0
    cooldown: float = 5.0
    replicas: int = 1
    namespace: str = "sglang"
    tenant: str = "default"
    tag: str = ""
    model: str | None = None
    allow_clear: bool = True
    log_interval: float = 30.0

    def __post_init__(self) -> None:
        check_master_address(self.master)
        check_host(self.host)
        if self.metadata is not None and not self.metadata.strip():
            raise ConfigError("metadata must not be empty (leave it out to use the master's)")
        if not self.transports or len(set(self.transports)) != len(self.transports):
            raise ConfigError(f"transports must be distinct names, got {self.transports!r}")
        if self.global_segment_size < 0:
            raise ConfigError(f"global_segment_size must be >= 0, got {self.global_segment_size}")
        if self.local_buffer_size < 64 * 1024:
            raise ConfigError("local_buffer_size must be at least 64K")
        if self.staging_size < 64 * 1024:
            raise ConfigError("staging_size must be at least 64K")
        for name in ("timeout", "rpc_timeout", "cooldown", "log_interval"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not 1 <= self.replicas <= MAX_REPLICAS:
            raise ConfigError(f"replicas must be in 1..{MAX_REPLICAS}, got {self.replicas}")
        if not self.namespace:
            raise ConfigError("namespace must not be empty")
        for name in ("namespace", "tenant", "tag"):
            value = getattr(self, name)
            if "/" in value or any(c.isspace() for c in value):
                raise ConfigError(f"{name} must not contain '/' or spaces, got {value!r}")
        if self.model is not None and not self.model.strip():
            raise ConfigError("model must not be empty (leave it out to use SGLang's)")

    def client_config(self, ranks_per_server: int = 1) -> ClientConfig:
        """One rank's store client: its share of ``global_segment_size``, our deadlines."""
        return client_config(
            master=self.master,
            host=self.host,
            metadata=self.metadata,
            transports=self.transports,
            global_segment_size=self.global_segment_size // max(1, ranks_per_server),
            local_buffer_size=self.local_buffer_size,
            timeout=self.timeout,
            rpc_timeout=self.rpc_timeout,
            **self.credentials(),
        )


_TEXT = Key(Kind.TEXT, "")
_FLOAT = Key(Kind.FLOAT, "")
_SIZE = Key(Kind.SIZE, "")
# Our keys; HiCacheStoreConfig's docstring (and docs/sglang.md) describes each.
KEYS: dict[str, Key] = {
    "master": _TEXT,
    "host": _TEXT,
    "metadata": Key(Kind.TEXT, "", empty=True),
    "transports": Key(Kind.NAMES, ""),
    "global_segment_size": _SIZE,
    "local_buffer_size": _SIZE,
    "staging_size": _SIZE,
    "timeout": _FLOAT,
    "rpc_timeout": _FLOAT,
    "cooldown": _FLOAT,
    "replicas": Key(Kind.INT, ""),
    "namespace": Key(Kind.TEXT, "", empty=True),
    "tenant": Key(Kind.TEXT, "", empty=True),
    "tag": Key(Kind.TEXT, "", empty=True),
    "model": Key(Kind.TEXT, "", empty=True),
    "allow_clear": Key(Kind.BOOL, ""),
    "log_interval": _FLOAT,
    "auth_token": _TEXT,
    **TLS_KEYS,
}
SCHEMA = Schema(
    "HiCacheStore",
    KEYS,
    label=lambda key: f"extra-config {key!r}",
    aliases=MOONCAKE_ALIASES,
    deprecated={"retry_interval": "cooldown"},
    ignored=MOONCAKE_IGNORED,
    foreign=SGLANG_KEYS,
)


def from_extra_config(
    extra: Mapping[str, Any] | None, env: Mapping[str, str] | None = None
) -> HiCacheStoreConfig:
    """Our config from SGLang's extra-config and the environment.

    Precedence: extra-config, then the ``MOONCAKE_*`` variable of the same meaning, then the
    default — except the local host name, where (as in SGLang's Mooncake backend)
    ``MOONCAKE_LOCAL_HOSTNAME`` / ``LOCAL_HOSTNAME`` win so one shared extra-config can serve
    many nodes. Honoured: ``MOONCAKE_MASTER``, ``MOONCAKE_LOCAL_HOSTNAME``, ``LOCAL_HOSTNAME``,
    ``MOONCAKE_GLOBAL_SEGMENT_SIZE``, ``MOONCAKE_TENANT_ID``.
    """
    env = os.environ if env is None else env
    values = SCHEMA.parse(extra)
    SCHEMA.from_env(values, env, "master", "MOONCAKE_MASTER")
    SCHEMA.from_env(values, env, "host", "MOONCAKE_LOCAL_HOSTNAME", "LOCAL_HOSTNAME", override=True)
    SCHEMA.from_env(values, env, "global_segment_size", "MOONCAKE_GLOBAL_SEGMENT_SIZE")
    SCHEMA.from_env(values, env, "tenant", "MOONCAKE_TENANT_ID")
    if "master" not in values:
        raise ConfigError(
            "no store master: set extra-config 'master' (HOST:PORT) or MOONCAKE_MASTER"
        )
    return HiCacheStoreConfig(**values)
