"""Settings of the store's three roles: frozen dataclasses validated in ``__post_init__``.

Sizes accept ``4096``, ``64K``, ``256M``, ``4G`` (binary units). A master address is either
``HOST:PORT`` or ``etcd://HOST:PORT[,HOST:PORT]/PREFIX``, in which case the current leader is
read from the election key under that prefix (see :mod:`.ha`).
"""

from __future__ import annotations

import dataclasses

from ..config import DEFAULT_TRANSPORTS, GIB, KIB, MIB, check_host
from ..errors import ConfigError
from ..tls import TlsConfig

_UNITS = {"K": KIB, "M": MIB, "G": GIB, "T": 1024 * GIB}
DEFAULT_MASTER_PORT = 50051  # Mooncake's master uses the same default
MAX_OBJECT_SIZE = 1 << 40  # 1 TiB: offsets inside a segment are packed in 40 bits
MAX_SEGMENT_SIZE = 1 << 40
MAX_REPLICAS = 8


def parse_size(text: str | int) -> int:
    """``"64K"`` → 65536. Accepts ints, and K/M/G/T with optional ``iB``/``B``."""
    if isinstance(text, int):
        if text < 0:
            raise ConfigError(f"size must be >= 0, got {text}")
        return text
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = _UNITS.get(t[-1:], 1)
    digits = t[:-1] if t[-1:] in _UNITS else t
    try:
        value = float(digits)
    except ValueError:
        raise ConfigError(f"bad size {text!r}: use e.g. 4096, 64K, 256M, 4G") from None
    if value < 0:
        raise ConfigError(f"size must be >= 0, got {text!r}")
    return int(value * mult)


def split_hostport(addr: str, what: str = "address") -> tuple[str, int]:
    host, sep, port = addr.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{what} must be HOST:PORT, got {addr!r}")
    return host.strip("[]"), int(port)


def check_master_address(addr: str) -> None:
    if addr.startswith("etcd://"):
        return
    split_hostport(addr, "master address")


def _positive(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not value > 0:
            raise ConfigError(f"{name} must be > 0, got {value!r}")


def _check_token(token: str | None) -> None:
    if token is not None and len(token) < 8:
        raise ConfigError("auth_token must be at least 8 characters")


@dataclasses.dataclass(frozen=True)
class MasterConfig:
    """The metadata service.

    host/port: control-plane listener (loopback by default). metrics_port: ``/metrics`` and
    ``/health`` over HTTP (None: off; 0: any free port). metadata: what transfer engines of servers
    and clients use to find each other — ``p2p`` (default: no service at all, survives master
    failover), ``http://…`` or ``etcd://…``. stripe_size: values larger than this are cut into
    stripes placed on different servers. high_watermark/low_watermark: eviction starts when the
    used fraction of mounted memory passes the first and stops at the second. put_lease_ttl:
    an allocation not committed within this many seconds is reclaimed (a client died mid-put).
    read_lease_ttl: a get protects the object from eviction and reuse for this long.
    heartbeat_interval/server_ttl: a server silent for server_ttl is dead; its segments are
    unmounted. soft_pin_ttl: how long a soft pin lasts. ha: ``etcd://HOST:PORT/PREFIX`` to elect
    a leader among several masters; ha_lease_ttl is the leader key's lease; advertise is the
    address written there (default host:port). max_frame: larger control frames are refused.
    max_inflight: bytes of unfinished control frames held over all connections; a connection
    that would pass it is refused. max_buffered: bytes of answers not yet read, over all
    connections; past it the connections holding the most are closed. frame_timeout: a
    control frame must arrive whole within this many seconds plus its length at 1 MiB/s (and a
    token's challenge be answered within it).
    key_budget: bytes of keys and per-key records the master keeps (objects and puts in
    progress, each charged its key's length plus ``KEY_OVERHEAD``); a put past it evicts, else
    is refused with CapacityExceeded.
    promote_hits: an object spilled to SSD is brought back into memory on its n-th read from SSD
    when that fits below the high watermark (0: never; 1: on the first read). auth_token: a
    shared secret every connection must prove (challenge/response) before any request.
    tls: TLS on the control port; with a CA, a client's CA-signed certificate replaces the token.
    """

    host: str = "127.0.0.1"
    port: int = DEFAULT_MASTER_PORT
    metrics_port: int | None = None
    metadata: str = "p2p"
    stripe_size: int = 64 * MIB
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    put_lease_ttl: float = 60.0
    read_lease_ttl: float = 5.0
    heartbeat_interval: float = 1.0
    server_ttl: float = 5.0
    soft_pin_ttl: float = 1800.0
    ha: str | None = None
    ha_lease_ttl: float = 5.0
    advertise: str | None = None
    max_frame: int = 64 * MIB
    max_inflight: int = 256 * MIB
    max_buffered: int = 256 * MIB
    frame_timeout: float = 10.0
    key_budget: int = 2048 * MIB
    promote_hits: int = 1
    auth_token: str | None = dataclasses.field(default=None, repr=False)  # never logged
    tls: TlsConfig | None = None

    def __post_init__(self) -> None:
        _check_token(self.auth_token)
        check_host(self.host)
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port must be in 0..65535, got {self.port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ConfigError(f"metrics_port must be in 0..65535, got {self.metrics_port}")
        if not 4 * KIB <= self.stripe_size <= MAX_OBJECT_SIZE:
            raise ConfigError(f"stripe_size must be in 4 KiB..1 TiB, got {self.stripe_size}")
        if not 0 < self.low_watermark < self.high_watermark <= 1.0:
            raise ConfigError(
                "watermarks must satisfy 0 < low_watermark < high_watermark <= 1, got "
                f"{self.low_watermark}, {self.high_watermark}"
            )
        _positive(
            self,
            "put_lease_ttl",
            "read_lease_ttl",
            "heartbeat_interval",
            "server_ttl",
            "soft_pin_ttl",
            "ha_lease_ttl",
        )
        if self.server_ttl < 2 * self.heartbeat_interval:
            raise ConfigError("server_ttl must be at least twice heartbeat_interval")
        if self.ha is not None and not self.ha.startswith("etcd://"):
            raise ConfigError(f"ha must be an etcd://HOST:PORT/PREFIX URL, got {self.ha!r}")
        if self.max_frame < 64 * KIB:
            raise ConfigError("max_frame must be at least 64 KiB")
        if self.max_inflight < self.max_frame:
            raise ConfigError("max_inflight must be at least max_frame")
        if self.max_buffered < self.max_frame:
            raise ConfigError("max_buffered must be at least max_frame")
        if not self.frame_timeout > 0:
            raise ConfigError(f"frame_timeout must be > 0, got {self.frame_timeout}")
        if self.key_budget < 1 * MIB:
            raise ConfigError(f"key_budget must be at least 1 MiB, got {self.key_budget}")
        if self.promote_hits < 0:
            raise ConfigError(f"promote_hits must be >= 0, got {self.promote_hits}")

    @property
    def address(self) -> str:
        return self.advertise or f"{self.host}:{self.port}"

    def replace(self, **changes: object) -> MasterConfig:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """A store server: contributes ``memory`` bytes (and optionally an SSD directory).

    host: address its transfer engine and its load endpoint bind and advertise.
    ssd_dir/ssd_size: where and how much evicted data is spilled instead of dropped.
    bounce_size: registered memory through which SSD reads are served to clients.
    metadata: override the engines' metadata backend the master announces.
    auth_token: the master's shared secret; the server's transfer engine (its data port and its
    p2p metadata endpoint) and its load endpoint require it too. tls: the same for TLS: the
    master connection, the load endpoint and the transfer engine all use these files.
    transports: its transfer engine's, in preference order; without ``shm`` it also talks to a
    loopback master over TCP instead of the abstract unix socket (see ``local_ipc``).
    """

    master: str = f"127.0.0.1:{DEFAULT_MASTER_PORT}"
    memory: int = 1 * GIB
    host: str = "127.0.0.1"
    ssd_dir: str | None = None
    ssd_size: int = 0
    bounce_size: int = 64 * MIB
    metadata: str | None = None
    transports: tuple[str, ...] = DEFAULT_TRANSPORTS
    rpc_timeout: float = 5.0
    auth_token: str | None = dataclasses.field(default=None, repr=False)  # never logged
    tls: TlsConfig | None = None

    def __post_init__(self) -> None:
        check_master_address(self.master)
        _check_token(self.auth_token)
        if not 0 < self.memory <= MAX_SEGMENT_SIZE:
            raise ConfigError(f"memory must be in 1..1 TiB bytes, got {self.memory}")
        if (self.ssd_dir is None) != (self.ssd_size == 0):
            raise ConfigError("give both ssd_dir and ssd_size (> 0), or neither")
        if self.ssd_size < 0:
            raise ConfigError(f"ssd_size must be >= 0, got {self.ssd_size}")
        if self.bounce_size < 64 * KIB:
            raise ConfigError("bounce_size must be at least 64 KiB")
        _positive(self, "rpc_timeout")

    @property
    def local_ipc(self) -> bool:
        """Control messages to loopback peers take the abstract unix socket (with ``shm``)."""
        return "shm" in self.transports

    def replace(self, **changes: object) -> ServerConfig:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True)
class ClientConfig:
    """The client library (what adapters use).

    global_segment_size: embedded mode — the client also contributes this much memory as a
    segment (Mooncake's ``global_segment_size``); 0 is a pure client. local_buffer_size:
    registered staging memory for put/get of Python bytes (larger values use a temporary
    buffer). timeout: deadline of one store call. rpc_timeout: deadline of one control message.
    replica_timeout: deadline of one read attempt when another replica is left to try.
    auth_token: the store's shared secret (master and store servers), if it has one; the
    client's own transfer engine requires it too, and refuses servers that cannot prove it.
    transports: the client's transfer engine's, in preference order. ``("shm", "tcp")`` (the
    default) takes the same-host shortcuts: shared memory for data and an abstract unix socket
    for control messages to a loopback master or server. ``("tcp",)`` is TCP only, data and
    control alike (loopback TCP on one host).
    tls: TLS files for the master, load and data connections (and this client's engine).
    """

    master: str = f"127.0.0.1:{DEFAULT_MASTER_PORT}"
    host: str = "127.0.0.1"
    global_segment_size: int = 0
    local_buffer_size: int = 64 * MIB
    metadata: str | None = None
    transports: tuple[str, ...] = DEFAULT_TRANSPORTS
    timeout: float = 20.0
    rpc_timeout: float = 5.0
    replica_timeout: float = 1.0
    auth_token: str | None = dataclasses.field(default=None, repr=False)  # never logged
    tls: TlsConfig | None = None

    def __post_init__(self) -> None:
        check_master_address(self.master)
        _check_token(self.auth_token)
        if not 0 <= self.global_segment_size <= MAX_SEGMENT_SIZE:
            raise ConfigError(f"global_segment_size out of range: {self.global_segment_size}")
        if self.local_buffer_size < 4 * KIB:
            raise ConfigError("local_buffer_size must be at least 4 KiB")
        _positive(self, "timeout", "rpc_timeout", "replica_timeout")

    @property
    def local_ipc(self) -> bool:
        """Control messages to loopback peers take the abstract unix socket (with ``shm``)."""
        return "shm" in self.transports

    def replace(self, **changes: object) -> ClientConfig:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]
