"""Settings of the LMCache remote storage plugin, read from LMCache's ``extra_config``.

LMCache builds a plugin connector as ``cls(loop=, local_cpu_backend=, config=)`` and does not tell
it its plugin name, so the connector finds its own entries: the one name in
``remote_storage_plugins`` whose ``remote_storage_plugin.<name>.module_path`` and ``.class_name``
point at it (:func:`find_plugin_name`). Its settings are the other keys under the same prefix
(:data:`KEYS`), read by the shared :class:`~mooncake_connectors.extra_config.Schema`: an unknown
key there is an error, so a typo does not pass silently.

Environment variables are read here and nowhere else in this adapter, and only for keys the
config leaves out: the master address from ``MOONCAKE_CONNECTORS_MASTER`` or Mooncake's
``MOONCAKE_MASTER``; the local bind address from ``MOONCAKE_CONNECTORS_HOST`` or Mooncake's
``MC_TCP_BIND_ADDRESS``. Nothing here imports lmcache.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from collections.abc import Callable, Mapping
from typing import Any

from ...config import DEFAULT_TRANSPORTS, KIB, MIB, Credentials, check_host
from ...errors import ConfigError
from ...extra_config import TLS_KEYS, Key, Kind, Schema, client_config
from ...store.config import DEFAULT_MASTER_PORT, MAX_REPLICAS, ClientConfig, check_master_address

PREFIX = "remote_storage_plugin."
# LMCache's own keys under our prefix (it reads them to load the class).
LOADER_KEYS = frozenset({"module_path", "class_name"})
_ENV = {
    "master": ("MOONCAKE_CONNECTORS_MASTER", "MOONCAKE_MASTER"),
    "host": ("MOONCAKE_CONNECTORS_HOST", "MC_TCP_BIND_ADDRESS"),
}


class Layout(enum.Enum):
    """How a chunk is laid out in the store.

    RAW: the MemoryObj's bytes only; written from and read into LMCache's memory without a copy.
    Its shape is the configured chunk shape with the token count taken from the size read.
    FRAMED: LMCache's ``RemoteMetadata`` header, then the bytes; any shape, dtype and format
    (compressing serdes, layerwise), copied once each way. AUTO: RAW when the configuration
    allows it (``remote_serde: naive``, not layerwise), else FRAMED.
    """

    AUTO = "auto"
    RAW = "raw"
    FRAMED = "framed"


@dataclasses.dataclass(frozen=True)
class PluginConfig(Credentials):
    """One plugin instance's settings.

    master: the store's master, ``HOST:PORT`` or ``etcd://HOST:PORT[,…]/PREFIX``.
    host: the address this process's transfer engine binds and advertises.
    transports: transports the client may use, in preference order (``shm`` reaches store
        servers on this host through shared memory, ``tcp`` any server).
    timeout: deadline of one store call (seconds); past it the call answers as a miss.
    cooldown: after a store-level failure (master unreachable, call past its deadline) calls
        answer as misses at once for this many seconds, then the next call probes the store.
    workers: threads that run store calls (LMCache's event loop never blocks on the store).
    replicas: copies of each chunk.
    layout: see :class:`Layout`.
    register_buffer: register LMCache's CPU buffer with the store client for zero-copy.
    local_buffer_size: the client's registered staging memory (copies go through it).
    global_segment_size: also contribute this much memory to the store (embedded mode).
    key_prefix: namespace of this plugin's keys in the store.
    list_limit: how many recently written keys ``list()`` remembers.
    """

    master: str = f"127.0.0.1:{DEFAULT_MASTER_PORT}"
    host: str = "127.0.0.1"
    transports: tuple[str, ...] = DEFAULT_TRANSPORTS
    timeout: float = 2.0
    cooldown: float = 1.0
    workers: int = 4
    replicas: int = 1
    layout: Layout = Layout.AUTO
    register_buffer: bool = True
    local_buffer_size: int = 32 * MIB
    global_segment_size: int = 0
    key_prefix: str = "lmcache/"
    list_limit: int = 100_000

    def __post_init__(self) -> None:
        check_master_address(self.master)
        check_host(self.host)
        if not self.transports or len(set(self.transports)) != len(self.transports):
            raise ConfigError(f"transports must name each transport once, got {self.transports}")
        if not 0 < self.timeout <= 600:
            raise ConfigError(f"timeout must be in (0, 600] seconds, got {self.timeout}")
        if not 0 <= self.cooldown <= 3600:
            raise ConfigError(f"cooldown must be in [0, 3600] seconds, got {self.cooldown}")
        if not 1 <= self.workers <= 64:
            raise ConfigError(f"workers must be in 1..64, got {self.workers}")
        if not 1 <= self.replicas <= MAX_REPLICAS:
            raise ConfigError(f"replicas must be in 1..{MAX_REPLICAS}, got {self.replicas}")
        if self.local_buffer_size < 4 * KIB:
            raise ConfigError("local_buffer_size must be at least 4 KiB")
        if self.global_segment_size < 0:
            raise ConfigError("global_segment_size must be >= 0")
        if len(self.key_prefix) > 256 or any(c.isspace() for c in self.key_prefix):
            raise ConfigError(
                f"key_prefix must be at most 256 characters without spaces: {self.key_prefix!r}"
            )
        if self.list_limit < 0:
            raise ConfigError(f"list_limit must be >= 0, got {self.list_limit}")

    def client_config(self) -> ClientConfig:
        """The store client's settings: every wait inside one call fits in ``timeout``."""
        return client_config(
            master=self.master,
            host=self.host,
            transports=self.transports,
            global_segment_size=self.global_segment_size,
            local_buffer_size=self.local_buffer_size,
            timeout=self.timeout,
            **self.credentials(),
        )


def _as_layout(key: str, raw: Any) -> Layout:
    try:
        return Layout(str(raw).strip().lower())
    except ValueError:
        choices = ", ".join(m.value for m in Layout)
        raise ConfigError(f"{key} must be one of {choices}, got {raw!r}") from None


# Our keys, as written after ``remote_storage_plugin.<name>.`` (docs/lmcache.md repeats them).
KEYS: dict[str, Key] = {
    "master": Key(Kind.TEXT, "the store's master, HOST:PORT or etcd://HOST:PORT[,...]/PREFIX"),
    "host": Key(Kind.TEXT, "the address this process's transfer engine binds and advertises"),
    "transports": Key(Kind.NAMES, "transports in preference order (default shm,tcp)"),
    "timeout": Key(Kind.FLOAT, "deadline of one store call in seconds (default 2)"),
    "cooldown": Key(
        Kind.FLOAT, "seconds calls answer misses after a store-level failure (default 1)"
    ),
    "workers": Key(Kind.INT, "threads that run store calls (default 4)"),
    "replicas": Key(Kind.INT, "copies of each chunk (default 1)"),
    "layout": Key(None, "auto, raw or framed (default auto)", convert=_as_layout),
    "register_buffer": Key(Kind.BOOL, "register LMCache's CPU buffer for zero-copy"),
    "local_buffer_size": Key(Kind.SIZE, "the client's registered staging memory (default 32M)"),
    "global_segment_size": Key(Kind.SIZE, "memory contributed to the store (default 0)"),
    "key_prefix": Key(Kind.TEXT, "namespace of this plugin's keys (default lmcache/)", empty=True),
    "list_limit": Key(Kind.INT, "how many written keys list() remembers (default 100000)"),
    "auth_token": Key(Kind.TEXT, "the store's shared secret (default: none)"),
    **TLS_KEYS,
}


def find_plugin_name(
    plugins: list[str] | None,
    extra: Mapping[str, Any] | None,
    loads: Callable[[str, str], bool],
) -> str:
    """The one name in ``plugins`` whose module_path/class_name satisfy ``loads(module, cls)``."""
    extra = extra or {}
    names = sorted(
        {
            name
            for name in plugins or []
            if loads(
                str(extra.get(f"{PREFIX}{name}.module_path", "")),
                str(extra.get(f"{PREFIX}{name}.class_name", "")),
            )
        }
    )
    if not names:
        raise ConfigError(
            f"no entry of remote_storage_plugins has {PREFIX}<name>.module_path and "
            ".class_name pointing at this connector"
        )
    if len(names) > 1:
        raise ConfigError(
            f"remote_storage_plugins lists {names} for one connector class; LMCache does not "
            "tell a plugin its name, so one LMCache config can hold only one instance of it"
        )
    return names[0]


def from_extra_config(
    name: str, extra: Mapping[str, Any] | None, env: Mapping[str, str] | None = None
) -> PluginConfig:
    """Settings of plugin ``name`` from LMCache's extra_config, then the environment."""
    head = f"{PREFIX}{name}."
    ours = {
        full[len(head) :]: raw
        for full, raw in (extra or {}).items()
        if full.startswith(head)  # other plugins' keys and LMCache's own are not ours
    }
    schema = Schema(
        f"LMCache plugin {name!r}",
        KEYS,
        label=lambda key: head + key,
        foreign=LOADER_KEYS,
        lenient=True,  # LMCache passes YAML values and environment text alike
    )
    values = schema.parse(ours)
    env = os.environ if env is None else env
    for key, names in _ENV.items():
        schema.from_env(values, env, key, *names)
    return PluginConfig(**values)
