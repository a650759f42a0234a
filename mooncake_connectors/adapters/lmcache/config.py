"""Settings of the LMCache remote storage plugin, read from LMCache's ``extra_config``.

LMCache builds a plugin connector as ``cls(loop=, local_cpu_backend=, config=)`` and does not tell
it its plugin name, so the connector finds its own entries: the one name in
``remote_storage_plugins`` whose ``remote_storage_plugin.<name>.module_path`` and ``.class_name``
point at it (:func:`find_plugin_name`). Its settings are the other keys under the same prefix
(:data:`KEYS`); an unknown key there is an error, so a typo does not pass silently.

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

from ...config import KIB, MIB
from ...errors import ConfigError
from ...store.config import (
    DEFAULT_MASTER_PORT,
    MAX_REPLICAS,
    ClientConfig,
    check_master_address,
    parse_size,
)

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
class PluginConfig:
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
    transports: tuple[str, ...] = ("shm", "tcp")
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
        if not self.host or any(c.isspace() for c in self.host):
            raise ConfigError(f"host must be a host name or address, got {self.host!r}")
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
        return ClientConfig(
            master=self.master,
            host=self.host,
            transports=self.transports,
            global_segment_size=self.global_segment_size,
            local_buffer_size=self.local_buffer_size,
            timeout=self.timeout,
            rpc_timeout=min(self.timeout, 5.0),
            replica_timeout=min(1.0, self.timeout / 2),
        )


def _as_bool(key: str, raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{key} must be true or false, got {raw!r}")


def _as_number(key: str, raw: Any, kind: type) -> Any:
    if isinstance(raw, bool):
        raise ConfigError(f"{key} must be a number, got {raw!r}")
    try:
        return kind(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{key} must be a number, got {raw!r}") from None


def _as_size(key: str, raw: Any) -> int:
    if isinstance(raw, bool) or not isinstance(raw, (int, str)):
        raise ConfigError(f"{key} must be a size such as 4096 or 64M, got {raw!r}")
    return parse_size(raw)


def _as_names(key: str, raw: Any) -> tuple[str, ...]:
    items = raw.split(",") if isinstance(raw, str) else raw
    if not isinstance(items, (list, tuple)) or not all(isinstance(i, str) for i in items):
        raise ConfigError(f'{key} must be names such as "shm,tcp", got {raw!r}')
    return tuple(i.strip() for i in items if i.strip())


def _as_layout(key: str, raw: Any) -> Layout:
    try:
        return Layout(str(raw).strip().lower())
    except ValueError:
        choices = ", ".join(m.value for m in Layout)
        raise ConfigError(f"{key} must be one of {choices}, got {raw!r}") from None


_PARSERS: dict[str, Any] = {
    "master": lambda k, v: str(v).strip(),
    "host": lambda k, v: str(v).strip(),
    "transports": _as_names,
    "timeout": lambda k, v: _as_number(k, v, float),
    "cooldown": lambda k, v: _as_number(k, v, float),
    "workers": lambda k, v: _as_number(k, v, int),
    "replicas": lambda k, v: _as_number(k, v, int),
    "layout": _as_layout,
    "register_buffer": _as_bool,
    "local_buffer_size": _as_size,
    "global_segment_size": _as_size,
    "key_prefix": lambda k, v: str(v),
    "list_limit": lambda k, v: _as_number(k, v, int),
}
# Our keys, as written after ``remote_storage_plugin.<name>.``.
KEYS = frozenset(_PARSERS)


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
    extra = extra or {}
    env = os.environ if env is None else env
    head = f"{PREFIX}{name}."
    values: dict[str, Any] = {}
    for full, raw in extra.items():
        if not full.startswith(head):
            continue
        key = full[len(head) :]
        if key in LOADER_KEYS:
            continue
        parse = _PARSERS.get(key)
        if parse is None:
            known = ", ".join(sorted(KEYS | LOADER_KEYS))
            raise ConfigError(f"unknown setting {full!r}; known: {known}")
        if raw is None:
            continue
        values[key] = parse(full, raw)
    for key, names in _ENV.items():
        if key in values:
            continue
        for var in names:
            raw = env.get(var, "").strip()
            if raw:
                values[key] = raw
                break
    return PluginConfig(**values)
