"""Configuration: frozen dataclasses validated in ``__post_init__``.

Environment variables are read here and nowhere else (:func:`engine_config_from_env`). Where
Mooncake has a variable with the same meaning, its name is accepted too.
"""

from __future__ import annotations

import dataclasses
import hmac
import ipaddress
import json
import os
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, TypedDict, cast

from .errors import ConfigError
from .tls import TlsConfig

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB

DEFAULT_METADATA_URL = "http://127.0.0.1:8080/metadata"
STORE_TOKEN_ENV = "MOONCAKE_CONNECTORS_STORE_TOKEN"  # the store CLI's and Mooncake facade's
TLS_ENV = {
    "cert": "MOONCAKE_CONNECTORS_TLS_CERT",
    "key": "MOONCAKE_CONNECTORS_TLS_KEY",
    "ca": "MOONCAKE_CONNECTORS_TLS_CA",
}
DEFAULT_BINDS = frozenset({"127.0.0.1", "::1", "localhost"})
# The transports an engine enables when nothing says otherwise, in preference order. Every
# config that lets the user pick transports defaults to this one tuple.
DEFAULT_TRANSPORTS: tuple[str, ...] = ("shm", "tcp")
# Moves GPU memory between processes of one host. Connectors whose KV cache is on a GPU put it
# first when the user kept the default transports (for_gpu); tcp stages GPU memory elsewhere.
GPU_TRANSPORT = "cuda_ipc"


def for_gpu(transports: tuple[str, ...]) -> tuple[str, ...]:
    """The transports for GPU memory: the default list gains the same-host GPU transport in
    front; a list the user chose stays as chosen."""
    if transports == DEFAULT_TRANSPORTS:
        return (GPU_TRANSPORT, *transports)
    return transports


TRANSPORTS_ENV = "MOONCAKE_CONNECTORS_TRANSPORTS"


def parse_transports(text: str, what: str = "transports") -> tuple[str, ...]:
    """``"tcp"`` or ``"shm,tcp"``: names in preference order; ConfigError if empty or repeated."""
    names = tuple(t.strip().lower() for t in text.split(",") if t.strip())
    if not names:
        raise ConfigError(f"{what} must name at least one transport, got {text!r}")
    if len(set(names)) != len(names):
        raise ConfigError(f"{what} lists a transport twice: {text!r}")
    return names


def transports_from_env(env: Mapping[str, str] | None = None) -> tuple[str, ...] | None:
    """The transport list ``MOONCAKE_CONNECTORS_TRANSPORTS`` sets (None when unset): how the
    Mooncake facades, whose API has no place for it, are told to use e.g. TCP only."""
    raw = (os.environ if env is None else env).get(TRANSPORTS_ENV, "")
    return parse_transports(raw, f"environment variable {TRANSPORTS_ENV}") if raw.strip() else None


def tls_from_env(
    cert: str | None = None,
    key: str | None = None,
    ca: str | None = None,
    env: Mapping[str, str] | None = None,
) -> TlsConfig | None:
    """TLS files given explicitly, else from MOONCAKE_CONNECTORS_TLS_{CERT,KEY,CA}; None when
    neither names any (TLS off)."""
    env = os.environ if env is None else env
    return TlsConfig.of(
        cert or env.get(TLS_ENV["cert"]),
        key or env.get(TLS_ENV["key"]),
        ca or env.get(TLS_ENV["ca"]),
    )


ALIAS_ENV = "MOONCAKE_CONNECTORS_AS_MOONCAKE"


def alias_from_env(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``MOONCAKE_CONNECTORS_AS_MOONCAKE`` switches the ``mooncake`` alias on (off when
    unset or empty); a value other than 1/0, true/false, yes/no, on/off is a ConfigError."""
    raw = (os.environ if env is None else env).get(ALIAS_ENV, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ConfigError(f"environment variable {ALIAS_ENV}={raw!r} must be 1 or 0")


def store_token_from_env() -> str | None:
    """The store's shared secret for callers whose API has no place for it (Mooncake's)."""
    return os.environ.get(STORE_TOKEN_ENV) or None


# RoCE traffic class (the GRH's DSCP << 2 | ECN) and InfiniBand service level of rdma QPs;
# Mooncake's names. Our settings (traffic_class, service_level) win over them.
IB_QOS_ENV = {"traffic_class": ("MC_IB_TC", 255), "service_level": ("MC_IB_SL", 15)}


def ib_qos_from_env(env: Mapping[str, str] | None = None) -> dict[str, int]:
    """The rdma QoS values ``MC_IB_TC`` / ``MC_IB_SL`` set, by setting name (absent: unset)."""
    env = os.environ if env is None else env
    out: dict[str, int] = {}
    for field, (name, top) in IB_QOS_ENV.items():
        raw = env.get(name, "").strip()
        if not raw:
            continue
        try:
            value = int(raw, 0)
        except ValueError:
            value = -1
        if not 0 <= value <= top:
            raise ConfigError(f"environment variable {name}={raw!r} must be an integer 0..{top}")
        out[field] = value
    return out


def info_needs_token(bind_host: str, token: str | None) -> bool:
    """Whether information endpoints (``/metrics``, ``/health``, metadata listings) of a listener
    bound to ``bind_host`` require the token. On the default binds (127.0.0.1, ::1) any local
    process may read them; bound to any other address (a routable one, a wildcard, or another
    loopback alias such as 127.0.0.2) they require the token whenever one is set."""
    return bool(token) and bind_host not in DEFAULT_BINDS


def bearer_ok(header: str | None, token: str) -> bool:
    """``Authorization: Bearer TOKEN``, compared in constant time."""
    return hmac.compare_digest((header or "").encode(), f"Bearer {token}".encode())


def check_host(host: str, what: str = "host") -> None:
    """A host name or address: not empty, no white space (what binds and what is advertised)."""
    if not host or any(c.isspace() for c in host):
        raise ConfigError(f"{what} must be a host name or address, got {host!r}")


def _check_port(port: int, what: str) -> None:
    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError(f"{what} must be an integer port in 0..65535, got {port!r}")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class CredentialArgs(TypedDict):
    auth_token: str | None
    tls_cert: str | None
    tls_key: str | None
    tls_ca: str | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Credentials:
    """A shared secret and TLS files, as the engine and each adapter's settings take them.

    The token is left out of ``repr``: settings get logged and printed in tracebacks, secrets
    must not be.
    """

    auth_token: str | None = dataclasses.field(default=None, repr=False)
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None

    def credentials(self) -> CredentialArgs:
        """The four as keyword arguments (``engine_config(**c.credentials())``)."""
        return cast(CredentialArgs, {f: getattr(self, f) for f in CredentialArgs.__annotations__})


@dataclasses.dataclass(frozen=True)
class EngineConfig(Credentials):
    """Settings of one :class:`~mooncake_connectors.transfer_core.TransferEngine`.

    host: address the engine's listeners bind and advertise; loopback by default.
    port: TCP transport port (0 = any free port).
    segment_name: name peers use to reach this engine; default ``host:port`` once bound.
    metadata: ``memory`` | ``http://HOST:PORT/PATH`` | ``etcd://HOST:PORT[,HOST:PORT]`` | ``p2p``.
    metadata_autostart: for an http URL on a loopback address that nobody answers, start the
        embedded metadata server in this process (the single-machine default).
    transports: names from the ``mooncake_connectors.transports`` group, in preference order
        for paths both can serve.
    transport_settings: transport name -> that transport's own settings (each transport
        declares and checks its keys, e.g. ``{"tcp": {"lanes": 8}}``).
    tcp_lanes: TCP connections per peer; slices of a request are spread over them (kept for
        existing callers; ``transport_settings={"tcp": {"lanes": N}}`` wins when given).
    slice_size: requests larger than this are cut into slices of at most this many bytes.
    auth_token: shared secret; when set every listening port requires challenge/response.
    timeout: default deadline (seconds) of a transfer request.
    connect_timeout: deadline for establishing one connection (the target's handshake too).
    frame_timeout: a listener closes a connection whose request (header and payload) does not
        arrive whole within this many seconds plus its length at 1 MiB/s.
    backoff_initial / backoff_max: cool-down of a failing path, doubled per failure and decayed
        by successes.
    metrics_port: serve Prometheus metrics on host:metrics_port when set.
    metadata_lease: seconds a published segment descriptor lives in a central metadata service
        (http, etcd) unless renewed; the engine renews it every third of that, so the
        descriptor of a process that was killed disappears after at most this long (0: never).
    tls_cert / tls_key / tls_ca: PEM files; with a certificate the tcp data plane, the p2p
        endpoint and /metrics speak TLS (and https:// metadata URLs are used with them), with a
        CA they require a peer certificate signed by it (see :mod:`mooncake_connectors.tls`).
    """

    host: str = "127.0.0.1"
    port: int = 0
    segment_name: str | None = None
    metadata: str = DEFAULT_METADATA_URL
    metadata_autostart: bool = True
    transports: tuple[str, ...] = DEFAULT_TRANSPORTS
    transport_settings: Mapping[str, Mapping[str, Any]] = dataclasses.field(
        default_factory=lambda: MappingProxyType({}), hash=False
    )
    tcp_lanes: int = 4
    slice_size: int = 8 * MIB
    timeout: float = 30.0
    connect_timeout: float = 5.0
    frame_timeout: float = 10.0
    backoff_initial: float = 0.05
    backoff_max: float = 5.0
    metrics_port: int | None = None
    metadata_lease: float = 60.0

    def __post_init__(self) -> None:
        check_host(self.host)
        self.tls  # noqa: B018 - checks the files now, not at the first connection
        _check_port(self.port, "port")
        if self.segment_name is not None and not self.segment_name.strip():
            raise ConfigError("segment_name must not be empty")
        if not self.metadata:
            raise ConfigError("metadata must name a backend (memory, http://…, etcd://…, p2p)")
        if not self.transports:
            raise ConfigError("at least one transport must be enabled")
        if len(set(self.transports)) != len(self.transports):
            raise ConfigError(f"transports listed twice: {self.transports}")
        if not isinstance(self.transport_settings, Mapping) or not all(
            isinstance(k, str) and isinstance(v, Mapping)
            for k, v in self.transport_settings.items()
        ):
            raise ConfigError("transport_settings must map transport names to mappings of settings")
        stray = set(self.transport_settings) - set(self.transports)
        if stray:
            raise ConfigError(
                f"transport_settings names transports that are not enabled: {sorted(stray)}"
            )
        if not 1 <= self.tcp_lanes <= 64:
            raise ConfigError(f"tcp_lanes must be in 1..64, got {self.tcp_lanes}")
        if not 4 * KIB <= self.slice_size <= 1 * GIB:
            raise ConfigError(f"slice_size must be in 4 KiB..1 GiB, got {self.slice_size}")
        if self.auth_token is not None and len(self.auth_token) < 8:
            raise ConfigError("auth_token must be at least 8 characters")
        for name in (
            "timeout",
            "connect_timeout",
            "frame_timeout",
            "backoff_initial",
            "backoff_max",
        ):
            value = getattr(self, name)
            if not value > 0:
                raise ConfigError(f"{name} must be > 0, got {value}")
        if self.backoff_initial > self.backoff_max:
            raise ConfigError("backoff_initial must not exceed backoff_max")
        if not (self.metadata_lease == 0 or 0.2 <= self.metadata_lease <= 86400):
            raise ConfigError(
                f"metadata_lease must be 0 or 0.2..86400 s, got {self.metadata_lease}"
            )
        if self.metrics_port is not None:
            _check_port(self.metrics_port, "metrics_port")

    @property
    def tls(self) -> TlsConfig | None:
        return TlsConfig.of(self.tls_cert, self.tls_key, self.tls_ca)

    def replace(self, **changes: object) -> EngineConfig:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


# Our names first, then Mooncake's names with the same meaning.
_ENV_ALIASES: dict[str, tuple[str, ...]] = {
    "host": ("MOONCAKE_CONNECTORS_HOST", "MC_TCP_BIND_ADDRESS"),
    "metadata": ("MOONCAKE_CONNECTORS_METADATA", "MOONCAKE_TE_META_DATA_SERVER"),
    "auth_token": ("MOONCAKE_CONNECTORS_TOKEN",),
    "tcp_lanes": ("MOONCAKE_CONNECTORS_TCP_LANES",),
    "slice_size": ("MOONCAKE_CONNECTORS_SLICE_SIZE", "MC_SLICE_SIZE"),
    "timeout": ("MOONCAKE_CONNECTORS_TIMEOUT", "MC_TRANSFER_TIMEOUT"),
    "transports": ("MOONCAKE_CONNECTORS_TRANSPORTS",),
    "metrics_port": ("MOONCAKE_CONNECTORS_METRICS_PORT",),
    "transport_settings": ("MOONCAKE_CONNECTORS_TRANSPORT_SETTINGS",),
    "tls_cert": (TLS_ENV["cert"],),
    "tls_key": (TLS_ENV["key"],),
    "tls_ca": (TLS_ENV["ca"],),
}


def _json_object(raw: str) -> dict[str, Any]:
    value = json.loads(raw)  # JSONDecodeError is a ValueError, reported by the caller
    if not isinstance(value, dict):
        raise ValueError("not a JSON object")
    return value


def engine_config_from_env(
    env: Mapping[str, str] | None = None, **overrides: object
) -> EngineConfig:
    """Build an EngineConfig from environment variables, then explicit overrides."""
    env = os.environ if env is None else env
    values: dict[str, object] = {}
    for field, names in _ENV_ALIASES.items():
        for name in names:
            raw = env.get(name)
            if raw is None or raw == "":
                continue
            try:
                if field in ("tcp_lanes", "slice_size", "metrics_port"):
                    values[field] = int(raw)
                elif field == "timeout":
                    values[field] = float(raw)
                elif field == "transport_settings":
                    values[field] = _json_object(raw)
                elif field == "transports":
                    values[field] = tuple(t.strip() for t in raw.split(",") if t.strip())
                else:
                    values[field] = raw
            except ValueError:
                raise ConfigError(f"environment variable {name}={raw!r} is not valid") from None
            break
    values.update(overrides)
    return EngineConfig(**values)  # type: ignore[arg-type]
