"""The transport interface: one small ABC, implementations found through entry points.

A transport moves *slices* (contiguous pieces of a request) between this process's registered
memory and a peer's. It reports each slice's outcome through ``Slice.complete``; the engine owns
retries, failover, deadlines and bookkeeping. A transport never blocks ``submit``.

Errors a transport reports:
  * TransportBroken  — connection/peer failure; the engine may retry on another lane/transport.
  * AccessViolation, ProtocolError, AuthenticationError — final; retrying cannot help.
  * TransportClosed  — the transport was closed by us.
"""

from __future__ import annotations

import abc
import dataclasses
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar, TypeVar

import msgspec

from ..config import EngineConfig
from ..errors import AccessViolation, ConfigError, MooncakeConnectorsError
from ..plugins import TRANSPORT_GROUP, Registry
from ..types import LocationKind, TransferOp
from .descriptor import RegionDesc, SegmentDesc

if TYPE_CHECKING:
    from .cuda_driver import Fence
    from .memory import LocalSegment, Region

S = TypeVar("S", bound=msgspec.Struct)


class TransportSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Base of a transport's own settings. A transport declares a subclass as ``Settings``; the
    values come from ``EngineConfig.transport_settings[name]`` and unknown keys are refused."""


def load_settings(cls: type[S], name: str, config: EngineConfig) -> S:
    """``config.transport_settings[name]`` as ``cls``; ConfigError naming the bad key."""
    raw = config.transport_settings.get(name, {})
    try:
        return msgspec.convert(dict(raw), cls)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"transport_settings[{name!r}]: {exc}", transport=name) from None


class Slice:
    """One contiguous piece of a transfer request, in flight on one path."""

    __slots__ = (
        "_done",
        "_on_done",
        "after",
        "attempts",
        "deadline",
        "lane",
        "length",
        "local_addr",
        "local_device",
        "local_mv",
        "op",
        "path",
        "region",
        "remote_addr",
    )

    def __init__(
        self,
        op: TransferOp,
        local_addr: int,
        remote_addr: int,
        length: int,
        deadline: float,
        on_done: Callable[[Slice, MooncakeConnectorsError | None], None],
    ) -> None:
        self.op = op
        self.local_addr = local_addr
        self.local_mv: memoryview | None = None  # view of the local bytes, set by the engine
        self.local_device = -1  # CUDA ordinal when the local memory is a GPU's, else -1
        self.remote_addr = remote_addr
        self.region: RegionDesc | None = None  # the peer's region the engine resolved
        self.length = length
        self.deadline = deadline
        self.lane = 0
        self.path = ""
        self.attempts = 0
        # A cuda_driver.Fence the copies of this slice's local GPU memory must follow (the
        # application's kernel writing those bytes), or None.
        self.after: Fence | None = None
        self._on_done = on_done
        self._done = False

    def local_view(self) -> memoryview:
        """The local bytes of this slice (checked against the local registration already).

        Host memory only: a GPU address read as host memory would crash the process."""
        if self.local_mv is None:
            if self.local_device >= 0:
                raise AccessViolation(
                    f"{self.local_addr:#x} is GPU memory; this transport moves host memory only",
                    path=self.path or None,
                )
            from .memory import view

            self.local_mv = view(self.local_addr, self.length)
        return self.local_mv

    def complete(self, error: MooncakeConnectorsError | None = None) -> None:
        """Report the outcome of the current attempt (exactly once per attempt)."""
        self._on_done(self, error)


@dataclasses.dataclass
class TransportContext:
    """What the engine lends a transport."""

    config: EngineConfig
    local: LocalSegment
    segment_name: Callable[[], str]
    # Re-fetch a peer's descriptor (after its epoch changed); raises MetadataError.
    refresh_peer: Callable[[str], SegmentDesc]
    stop: threading.Event = dataclasses.field(default_factory=threading.Event)


class Transport(abc.ABC):
    """Base class of transports. Subclasses set ``name`` and implement the abstract methods."""

    name: ClassVar[str]
    # This transport's settings; subclasses with settings of their own override it.
    Settings: ClassVar[type[TransportSettings]] = TransportSettings

    def __init__(self, ctx: TransportContext) -> None:
        self.ctx = ctx
        # Checked for every transport, so a misspelt key fails at start, not on first use.
        load_settings(self.Settings, self.name, ctx.config)

    @abc.abstractmethod
    def start(self) -> dict[str, str]:
        """Start listeners if any; return endpoint entries for the segment descriptor."""

    @abc.abstractmethod
    def reachable(self, peer: SegmentDesc, region: RegionDesc) -> bool:
        """Can this transport move data to/from ``region`` of ``peer``? Must be cheap."""

    def serves(self, local: LocationKind, remote: LocationKind) -> bool:
        """Can this transport move bytes between local memory of kind ``local`` and remote
        memory of kind ``remote``? Host memory on both ends unless a transport says more."""
        return local is LocationKind.CPU and remote is LocationKind.CPU

    def describe_segment(self) -> Mapping[str, object]:
        """Fields this transport adds to the published SegmentDesc (e.g. RDMA GIDs).

        Called on every publish, after ``start``. Keys are SegmentDesc field names other than
        the engine's own (name, host_id, pid, version, epoch, endpoints, regions, auth); a dict
        field may be filled by several transports as long as their keys do not collide.
        """
        return {}

    def describe_region(self, region: Region) -> Mapping[str, object]:
        """Fields this transport adds to ``region``'s RegionDesc (memfd, IPC handle, rkeys).

        Called on every publish for every registered region; cache per region what is costly
        to compute. Keys are RegionDesc field names other than addr, length, location, access.
        """
        return {}

    def lanes(self, peer: SegmentDesc) -> int:
        """Independent paths to ``peer`` (failover moves a slice to another lane)."""
        return 1

    @abc.abstractmethod
    def submit(
        self, peer: SegmentDesc, slices: Sequence[Slice], *, inline_ok: bool = False
    ) -> None:
        """Start moving ``slices`` (each with ``lane`` set).

        Without ``inline_ok`` this must not block on bulk I/O. With it the caller is about to
        wait for these slices anyway, so the transport may do the work in the calling thread.
        """

    # True when the transport makes its copies of a slice's local GPU memory wait for
    # ``Slice.after`` on the GPU (``Fence.order`` on its copy stream); for the others the engine
    # waits for the fence on the host before handing them the slice.
    orders_after: ClassVar[bool] = False

    # True when ``run_inline`` is implemented (a class attribute, or set on the instance at start)
    runs_inline: bool = False

    def run_inline(self, peer: SegmentDesc, s: Slice) -> MooncakeConnectorsError | None:
        """Move one host-memory slice from the calling thread, which waits for it, and return
        its outcome (None: done) instead of reporting it through ``s.complete``; bounded by
        ``s.deadline``. Optional: the engine calls it only when ``runs_inline`` is set."""
        raise NotImplementedError

    # True when ``run_one`` is implemented (a class attribute, or set on the instance at start)
    runs_one: bool = False

    def run_one(
        self,
        peer: SegmentDesc,
        op: TransferOp,
        remote: int,
        local: int,
        length: int,
        deadline: float,
    ) -> MooncakeConnectorsError | bool:
        """``run_inline`` of one request whose ranges the engine checked, with no Slice made
        (``transfer_core/fastpath.py``): True when done, its error, or False, having done
        nothing, when only ``run_inline`` can run it. Optional: the engine calls it only when
        ``runs_one`` is set."""
        return False

    def local_changed(self, epoch: int) -> None:  # noqa: B027 - optional hook
        """Local registrations changed (register/unregister); ``epoch`` is the new generation."""

    def peer_seen(self, peer: SegmentDesc) -> None:  # noqa: B027 - optional hook
        """``peer``'s descriptor was fetched (a first lookup, ``engine.peer()`` ahead of its
        transfers, a refresh after it changed): prepare what its transfers need, off their
        path (cuda_ipc pins the peer's host buffers here). Must not raise."""

    def prepare(self, peer: SegmentDesc, timeout: float) -> None:  # noqa: B027 - optional hook
        """The application will move large amounts with ``peer`` soon (``engine.prepare``):
        open now, within ``timeout``, what a transfer would otherwise set up on first need
        (tcp: the connections and threads of a striped transfer). Must not raise."""

    def abort(self, peer_name: str, lane: int) -> None:  # noqa: B027 - optional hook
        """Tear down a lane whose slice missed its deadline, so no late bytes land."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop listeners and fail every slice in flight with TransportClosed."""


TRANSPORTS: Registry[Transport] = Registry(TRANSPORT_GROUP, "mooncake_transport")
