"""One typed parser for the engine adapters' extra configuration (no engine import).

vLLM's ``kv_connector_extra_config``, LMCache's ``remote_storage_plugin.<name>.*`` keys and
SGLang's ``--hicache-storage-backend-extra-config`` all reach us as a mapping of names to
loosely typed values. Each adapter declares its keys once (:class:`Key`: a kind and a one-line
description, which its documentation repeats) and :class:`Schema` does the rest the same way for
all of them: an unknown key is an error naming it and the allowed ones (a typo such as
``timout`` silently ignored would leave the default deadline in force), a value of the wrong type
is an error naming the key, an alias is read under its new name, and a deprecated alias also
warns. :func:`client_config` and :func:`engine_config` then build the store client's and the
transfer engine's settings from the parsed values, by one rule for every adapter.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from .config import EngineConfig, engine_config_from_env, store_token_from_env, tls_from_env
from .errors import ConfigError
from .store.config import ClientConfig, parse_size

log = logging.getLogger(__name__)


class Kind(enum.Enum):
    TEXT = "text"  # a string (stripped; non-empty unless ``empty``)
    BOOL = "bool"
    INT = "int"
    FLOAT = "float"  # an int or a float
    SIZE = "size"  # bytes: an int, or a string such as "64M" or "4gb"
    NAMES = "names"  # a list of names, or one comma-separated string


@dataclasses.dataclass(frozen=True)
class Key:
    """One documented key. nullable: ``None`` is a value (else it is an error, or "use the
    default" in a lenient schema). convert: for a value no kind describes (gets the label)."""

    kind: Kind | None
    help: str
    nullable: bool = False
    empty: bool = False
    convert: Callable[[str, Any], Any] | None = None


def _bad(label: str, want: str, value: Any) -> ConfigError:
    return ConfigError(f"{label} must be {want}, got {value!r}")


def _number(label: str, value: Any, integer: bool, lenient: bool) -> int | float:
    if lenient and isinstance(value, str):
        try:
            return int(value) if integer else float(value)
        except ValueError:
            raise _bad(label, "an integer" if integer else "a number", value) from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(label, "a number", value)
    if integer and not isinstance(value, int):
        raise _bad(label, "an integer", value)
    return value if integer else float(value)


def _convert(key: Key, label: str, value: Any, lenient: bool) -> Any:
    """``value`` as ``key`` describes it, or a ConfigError naming ``label``."""
    if value is None and key.nullable:
        return None
    if key.convert is not None:
        return key.convert(label, value)
    if key.kind is Kind.TEXT:
        if not isinstance(value, str):
            raise _bad(label, "a string", value)
        text = value.strip() if lenient else value
        if not text and not key.empty:
            raise _bad(label, "a non-empty string", value)
        return text
    if key.kind is Kind.BOOL:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower() if lenient else ""
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise _bad(label, "true or false", value)
    if key.kind in (Kind.INT, Kind.FLOAT):
        return _number(label, value, key.kind is Kind.INT, lenient)
    if key.kind is Kind.SIZE:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise _bad(label, "a size such as 4096 or 64M", value)
        return parse_size(value)
    if key.kind is Kind.NAMES:
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not all(isinstance(i, str) for i in items):
            raise _bad(label, 'a list of names such as ["shm", "tcp"] or "shm,tcp"', value)
        return tuple(i.strip() for i in items if i.strip())
    raise ConfigError(f"{label}: no kind to check it by")  # a Key without kind or convert


@dataclasses.dataclass(frozen=True)
class Schema:
    """How one adapter's extra configuration is read.

    where: names the configuration in messages. keys: our keys. label: how a key is named in
    messages (default ``where[key]``). aliases: other names of our keys (alias -> key).
    deprecated: old names of our keys, read with a DeprecationWarning (old -> key). ignored:
    keys accepted and dropped with a warning (another implementation's, with no meaning here).
    foreign: keys the engine itself owns; skipped silently. lenient: values may come as text
    ("2.5", "true"), and ``None`` means "use the default".
    """

    where: str
    keys: Mapping[str, Key]
    label: Callable[[str], str] | None = None
    aliases: Mapping[str, str] = dataclasses.field(default_factory=dict)
    deprecated: Mapping[str, str] = dataclasses.field(default_factory=dict)
    ignored: frozenset[str] = frozenset()
    foreign: frozenset[str] = frozenset()
    lenient: bool = False

    def name(self, key: str) -> str:
        return self.label(key) if self.label is not None else f"{self.where}[{key!r}]"

    def allowed(self) -> list[str]:
        return sorted({*self.keys, *self.aliases, *self.deprecated})

    def convert(self, key: str, value: Any, label: str | None = None) -> Any:
        """One value of ``key`` (also from elsewhere, e.g. the environment: then ``label``)."""
        return _convert(self.keys[key], label or self.name(key), value, self.lenient)

    def parse(self, extra: Mapping[str, Any] | None) -> dict[str, Any]:
        """Our keys' values, converted, under their current names; unknown keys are an error."""
        given = dict(extra or {})
        known = {*self.keys, *self.foreign, *self.ignored, *self.aliases, *self.deprecated}
        unknown = sorted(k for k in given if k not in known)
        if unknown:
            raise ConfigError(
                f"{self.where}: unknown extra-config key(s) {unknown}; allowed: {self.allowed()}"
            )
        ignored = sorted(k for k in given if k in self.ignored)
        if ignored:
            log.warning("%s: keys of another implementation, ignored here: %s", self.where, ignored)
        values: dict[str, Any] = {}
        named: dict[str, str] = {}
        for raw_key, value in given.items():
            if raw_key in self.foreign or raw_key in self.ignored:
                continue
            key = self.aliases.get(raw_key) or self.deprecated.get(raw_key) or raw_key
            if raw_key in self.deprecated:
                self._warn_deprecated(raw_key, key)
            if key in named:
                raise ConfigError(
                    f"{self.where} gives {key!r} twice (as {named[key]!r} and {raw_key!r})"
                )
            named[key] = raw_key
            if value is None and self.lenient and not self.keys[key].nullable:
                continue
            values[key] = self.convert(key, value, self.name(raw_key))
        return values

    def _warn_deprecated(self, old: str, new: str) -> None:
        msg = f"{self.name(old)} is deprecated; use {self.name(new)}"
        # Hosts hide DeprecationWarning by default; the log line is what an operator sees.
        warnings.warn(msg, DeprecationWarning, stacklevel=4)
        log.warning("%s", msg)

    def from_env(
        self,
        values: dict[str, Any],
        env: Mapping[str, str],
        key: str,
        *names: str,
        override: bool = False,
    ) -> None:
        """Fill ``values[key]`` from the first of the variables ``names`` that is set, unless
        the configuration gave it (or ``override``: the variable wins)."""
        if key in values and not override:
            return
        for var in names:
            raw = env.get(var, "").strip()
            if raw:
                values[key] = _convert(
                    self.keys[key], f"environment variable {var}", raw, lenient=True
                )
                return


# Every adapter takes these (its documentation repeats them); each unset one comes from
# MOONCAKE_CONNECTORS_TLS_CERT / _KEY / _CA.
TLS_KEYS: dict[str, Key] = {
    "tls_cert": Key(
        Kind.TEXT, "PEM certificate of this node: its listeners and connections use TLS", True
    ),
    "tls_key": Key(Kind.TEXT, "PEM private key of tls_cert", True),
    "tls_ca": Key(
        Kind.TEXT,
        "PEM CA: peers must present a certificate it signed, which stands in for the token",
        True,
    ),
}


def client_config(
    *,
    master: str,
    host: str,
    transports: tuple[str, ...],
    timeout: float,
    metadata: str | None = None,
    local_buffer_size: int,
    global_segment_size: int = 0,
    rpc_timeout: float = 5.0,
    auth_token: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    tls_ca: str | None = None,
) -> ClientConfig:
    """The store client's settings: every wait inside one call fits in ``timeout``, and a read
    from one replica leaves time to try another. ``auth_token``: the store's shared secret
    (master and data plane); without one, ``MOONCAKE_CONNECTORS_STORE_TOKEN``."""
    return ClientConfig(
        master=master,
        host=host,
        metadata=metadata,
        transports=transports,
        global_segment_size=global_segment_size,
        local_buffer_size=local_buffer_size,
        timeout=timeout,
        rpc_timeout=min(rpc_timeout, timeout),
        replica_timeout=min(1.0, timeout / 2),
        auth_token=auth_token or store_token_from_env(),
        tls=tls_from_env(tls_cert, tls_key, tls_ca),
    )


def engine_config(
    *,
    host: str,
    metadata: str,
    transports: tuple[str, ...],
    timeout: float,
    connect_timeout: float,
    **optional: object,
) -> EngineConfig:
    """The transfer engine's settings; ``optional`` keys given as None are left out, and
    MOONCAKE_CONNECTORS_* variables fill the rest."""
    overrides: dict[str, object] = {
        "host": host,
        "metadata": metadata,
        "transports": transports,
        "timeout": timeout,
        "connect_timeout": connect_timeout,
    }
    overrides.update({k: v for k, v in optional.items() if v is not None})
    return engine_config_from_env(None, **overrides)
