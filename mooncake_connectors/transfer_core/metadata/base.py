"""The metadata interface: a small key-value contract plus segment publication on top.

Backends implement ``put/get/delete/list`` (bytes values) and may override the segment methods
(the p2p backend asks the peer itself instead of a central store). Keys are plain strings;
backends namespace them under their own prefix.
"""

from __future__ import annotations

import abc
from typing import ClassVar

from ...config import EngineConfig
from ...errors import SegmentNotFound
from ..descriptor import SegmentDesc, decode_segment, encode_segment

SEGMENT_PREFIX = "segments/"


class MetadataBackend(abc.ABC):
    """Where segment descriptors (and small shared state such as heartbeats) live."""

    scheme: ClassVar[str]
    # True where descriptors live in a service that outlives this process (http, etcd): there a
    # descriptor is published with a lease its publisher renews, and withdrawn at exit.
    central: ClassVar[bool] = False

    @classmethod
    @abc.abstractmethod
    def from_url(cls, url: str, config: EngineConfig | None = None) -> MetadataBackend:
        """Open the backend named by ``url`` (e.g. ``http://127.0.0.1:8080/metadata``)."""

    @abc.abstractmethod
    def put(self, key: str, value: bytes) -> None: ...

    @abc.abstractmethod
    def get(self, key: str) -> bytes | None: ...

    @abc.abstractmethod
    def delete(self, key: str) -> bool: ...

    @abc.abstractmethod
    def list(self, prefix: str) -> dict[str, bytes]: ...

    def close(self) -> None:  # noqa: B027 - optional
        """Release connections and servers."""

    # -- segments ---------------------------------------------------------------------------
    def segment_name(self, preferred: str) -> str:
        """The name this process's segment must use (p2p needs its own address)."""
        return preferred

    def publish_segment(self, desc: SegmentDesc, lease: float = 0.0) -> None:
        """Publish (or renew) ``desc``. With ``lease`` > 0 a central service drops it unless it
        is published again within that many seconds; an in-process store ignores the lease
        (its descriptors go with the process)."""
        self.put(SEGMENT_PREFIX + desc.name, encode_segment(desc))

    def withdraw_segment(self, name: str, timeout: float) -> None:  # noqa: B027 - optional
        """Remove ``name``'s descriptor at interpreter exit: best effort, within ``timeout``,
        on a connection of its own (another thread may hold the usual one), and never raising.
        Nothing to do for an in-process store."""

    def lookup_segment(self, name: str) -> SegmentDesc:
        data = self.get(SEGMENT_PREFIX + name)
        if data is None:
            raise SegmentNotFound(f"no segment named {name!r} is published", segment=name)
        return decode_segment(data, source=name)

    def remove_segment(self, name: str) -> bool:
        return self.delete(SEGMENT_PREFIX + name)

    def __enter__(self) -> MetadataBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
