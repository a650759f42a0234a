"""The one exception tree of mooncake-connectors.

    MooncakeConnectorsError
    ├── ConfigError                      bad configuration or argument (also a ValueError)
    ├── PluginError                      a transport/metadata plugin failed to load or register
    ├── ProtocolError                    a malformed or unexpected frame, version mismatch
    ├── AuthenticationError              shared-token challenge failed
    ├── MetadataError                    metadata backend unreachable or inconsistent
    │   └── SegmentNotFound              no descriptor for that segment name
    ├── TransferError                    a transfer could not be completed
    │   ├── TransportClosed              closed by us (engine shut down)
    │   ├── TransportBroken              broken by the peer / network (retryable elsewhere)
    │   ├── TransferTimeout              the request's deadline passed
    │   ├── AccessViolation              remote address outside a registered region or rights
    │   └── NoPathAvailable              no transport can reach that peer for that memory
    ├── LoadRefused                      a KV load not attempted (its blocks are recomputed)
    └── StoreError                       distributed store failures (see store/)
        ├── NotLeader                    the contacted master is a standby
        ├── MasterUnavailable            no master answered within the deadline
        ├── ReplicaUnavailable           no live replica could serve the request
        ├── CapacityExceeded             no room even after eviction
        ├── ObjectExists                 the key already holds (or is writing) an object
        └── PutExpired                   a put was committed after its lease ran out

Every foreign exception is mapped once, at the boundary where it happens, with
``raise Ours(...) from exc``. Errors carry structured fields (peer, path, key) so callers
branch on data rather than on message text. A cache miss is a return value, not an exception.
"""

from __future__ import annotations


class MooncakeConnectorsError(Exception):
    """Base class of every error raised by this package."""

    def __init__(self, message: str, **fields: object) -> None:
        super().__init__(message)
        self.message = message
        self.fields = fields

    def __getattr__(self, name: str) -> object:
        # Structured fields (peer, path, key, ...) read as attributes; absent ones are None.
        if name.startswith("__"):
            raise AttributeError(name)
        fields = self.__dict__.get("fields", {})
        return fields.get(name)

    def __str__(self) -> str:
        if not self.fields:
            return self.message
        extra = ", ".join(f"{k}={v!r}" for k, v in self.fields.items() if v is not None)
        return f"{self.message} ({extra})" if extra else self.message


class ConfigError(MooncakeConnectorsError, ValueError):
    """Invalid configuration value or argument."""


class PluginError(MooncakeConnectorsError):
    """A plugin could not be loaded, or two plugins claim one name."""


class ProtocolError(MooncakeConnectorsError):
    """A frame was malformed, truncated, or of an unsupported protocol version."""


class AuthenticationError(MooncakeConnectorsError):
    """The shared-token challenge/response failed."""


class MetadataError(MooncakeConnectorsError):
    """The metadata backend failed (unreachable, bad data)."""


class SegmentNotFound(MetadataError):
    """No segment descriptor is published under that name."""


class TransferError(MooncakeConnectorsError):
    """A transfer request could not be completed."""


class TransportClosed(TransferError):
    """The transport or engine was closed by us."""


class TransportBroken(TransferError):
    """The connection broke or the peer is unreachable; another path may work."""


class TransferTimeout(TransferError):
    """The request's deadline passed before it completed."""


class AccessViolation(TransferError):
    """The remote (or local) address range is not registered, or lacks the needed rights."""


class NoPathAvailable(TransferError):
    """No enabled transport can move data between these two memory locations."""


class LoadRefused(MooncakeConnectorsError):
    """A connector will not attempt a KV load (the reason says why); the engine recomputes it."""


class StoreError(MooncakeConnectorsError):
    """Base class of distributed store errors."""


class NotLeader(StoreError):
    """The contacted master is not the leader."""


class ReplicaUnavailable(StoreError):
    """No live replica could serve the request."""


class CapacityExceeded(StoreError):
    """The store has no room for the object, even after eviction."""


class ObjectExists(StoreError):
    """A put for a key that already holds a committed object."""


class MasterUnavailable(StoreError):
    """No master (leader) answered within the call's deadline."""


class PutExpired(StoreError):
    """A put's allocation expired (or a new leader took over) before it was committed."""
