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
    ├── GpuError                         a CUDA driver call failed (``call``, ``code``)
    │   └── GpuUnavailable               no usable GPU here: no cuda-python, no driver, no device
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
branch on data rather than on message text; each class declares the fields it carries, as typed
attributes, so a misspelt field is an AttributeError (and a mypy error), never a silent None.
A cache miss is a return value, not an exception.
"""

from __future__ import annotations


class MooncakeConnectorsError(Exception):
    """Base class of every error raised by this package.

    ``fields`` holds every structured field given, for the message and for logs; subclasses
    expose the ones they declare as attributes.
    """

    def __init__(self, message: str, **fields: object) -> None:
        super().__init__(message)
        self.message = message
        self.fields: dict[str, object] = fields

    def __str__(self) -> str:
        extra = ", ".join(f"{k}={v!r}" for k, v in self.fields.items() if v is not None)
        return f"{self.message} ({extra})" if extra else self.message


class ConfigError(MooncakeConnectorsError, ValueError):
    """Invalid configuration value or argument.

    ``key`` and ``code`` are set when a store call's argument was refused (the store's result
    code); ``path`` names a file; any other keyword names the offending option and its value
    (``ConfigError("... must be > 0", block_tokens=0)``) and lands in ``context``.
    """

    def __init__(
        self,
        message: str,
        *,
        key: str | None = None,
        code: int | None = None,
        path: str | None = None,
        **context: object,
    ) -> None:
        super().__init__(message, key=key, code=code, path=path, **context)
        self.key = key
        self.code = code
        self.path = path
        self.context = context


class PluginError(MooncakeConnectorsError):
    """A plugin could not be loaded, or two plugins claim one name."""

    def __init__(
        self,
        message: str,
        *,
        group: str | None = None,
        first: str | None = None,
        second: str | None = None,
    ) -> None:
        super().__init__(message, group=group, first=first, second=second)
        self.group = group  # the entry-point group
        self.first = first  # the two entry points that claim one name
        self.second = second


class _PeerError(MooncakeConnectorsError):
    """An error about one peer, met on one transport path."""

    def __init__(self, message: str, *, peer: str | None = None, path: str | None = None) -> None:
        super().__init__(message, peer=peer, path=path)
        self.peer = peer
        self.path = path


class ProtocolError(_PeerError):
    """A frame was malformed, truncated, or of an unsupported protocol version."""


class AuthenticationError(_PeerError):
    """The shared-token challenge/response failed."""


class MetadataError(MooncakeConnectorsError):
    """The metadata backend failed (unreachable, bad data)."""

    def __init__(
        self,
        message: str,
        *,
        url: str | None = None,
        segment: str | None = None,
        source: str | None = None,
    ) -> None:
        super().__init__(message, url=url, segment=segment, source=source)
        self.url = url  # the backend's endpoint
        self.segment = segment  # the segment name asked for
        self.source = source  # where an undecodable descriptor came from


class SegmentNotFound(MetadataError):
    """No segment descriptor is published under that name."""


class TransferError(_PeerError):
    """A transfer request could not be completed."""

    def __init__(
        self,
        message: str,
        *,
        peer: str | None = None,
        path: str | None = None,
        index: int | None = None,
    ) -> None:
        super().__init__(message, peer=peer, path=path)
        if index is not None:
            self.fields["index"] = index
        self.index = index  # the failing request's position in its batch


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


class GpuError(MooncakeConnectorsError):
    """A CUDA driver call failed: ``call`` names it, ``code`` is the driver's CUresult."""

    def __init__(self, message: str, *, call: str | None = None, code: int | None = None) -> None:
        super().__init__(message, call=call, code=code)
        self.call = call
        self.code = code


class GpuUnavailable(GpuError):
    """This process cannot use a GPU; the message says why (no cuda-python, no driver library,
    no device) and what would fix it."""


class LoadRefused(MooncakeConnectorsError):
    """A connector will not attempt a KV load (the reason says why); the engine recomputes it."""


class StoreError(MooncakeConnectorsError):
    """Base class of distributed store errors."""

    def __init__(self, message: str, *, key: str | None = None, code: int | None = None) -> None:
        super().__init__(message, key=key, code=code)
        self.key = key
        self.code = code  # the master's result code (negative), when one was given


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

    def __init__(
        self,
        message: str,
        *,
        key: str | None = None,
        code: int | None = None,
        master: str | None = None,
    ) -> None:
        super().__init__(message, key=key, code=code)
        if master is not None:
            self.fields["master"] = master
        self.master = master  # the master address(es) tried


class PutExpired(StoreError):
    """A put's allocation expired (or a new leader took over) before it was committed."""
