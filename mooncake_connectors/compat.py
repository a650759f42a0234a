"""Drop-in facades with Mooncake 0.3.13's Python API.

    # from mooncake.engine import TransferEngine
    from mooncake_connectors.compat import TransferEngine
    # from mooncake.store import MooncakeDistributedStore, ReplicateConfig
    from mooncake_connectors.compat import MooncakeDistributedStore, ReplicateConfig

Same method names, argument order and return conventions: 0 on success and a negative value on
failure (the reason is logged), addresses as ints. ``metadata_server`` accepts Mooncake's forms:
``"P2PHANDSHAKE"``, ``"http://HOST:PORT/metadata"``, ``"etcd://HOST:PORT"`` or a bare
``"HOST:PORT"`` (etcd, as Mooncake reads it).

Transports: ``protocol="tcp"`` enables our ``shm`` *and* ``tcp`` transports: a peer on the same
host is reached through shared memory (a memcpy, no socket), any other over TCP. Mooncake's
``tcp`` has no such shortcut, so for TCP only, as Mooncake's ``tcp`` behaves, set
``MOONCAKE_CONNECTORS_TRANSPORTS=tcp`` (or pass ``TransferEngine(transports="tcp")``); the list
given there replaces what ``protocol`` would enable, in preference order. ``"rdma"`` enables
``shm``, ``rdma`` and ``tcp`` and needs the rdma transport installed.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from typing import Any

from .compat_store import finalize, metadata_url, unsupported
from .config import DEFAULT_TRANSPORTS, EngineConfig, parse_transports, transports_from_env
from .errors import MooncakeConnectorsError
from .transfer_core.engine import TransferEngine as _Engine
from .transfer_core.engine import TransferRequest
from .transfer_core.memory import SharedBuffer
from .types import TransferOp

log = logging.getLogger(__name__)

_PROTOCOLS: dict[str, tuple[str, ...]] = {
    "tcp": DEFAULT_TRANSPORTS,
    "rdma": (*DEFAULT_TRANSPORTS[:-1], "rdma", DEFAULT_TRANSPORTS[-1]),
}


def _location(location: str) -> str | None:
    return None if location in ("", "*") else location


def _transports(explicit: Sequence[str] | str | None) -> tuple[str, ...] | None:
    """The explicit list, else ``MOONCAKE_CONNECTORS_TRANSPORTS``, else None (protocol's)."""
    if explicit is None:
        return transports_from_env()
    text = explicit if isinstance(explicit, str) else ",".join(explicit)
    return parse_transports(text)


class TransferEngine:
    """Mooncake's ``mooncake.engine.TransferEngine`` API over our engine.

    ``transports`` (not in Mooncake's API; default: ``MOONCAKE_CONNECTORS_TRANSPORTS``, else what
    ``protocol`` enables): our transports in preference order, e.g. ``"tcp"`` for TCP only. With
    ``protocol="tcp"`` and neither set, same-host peers are reached through shared memory.
    """

    def __init__(self, transports: Sequence[str] | str | None = None) -> None:
        self._engine: _Engine | None = None
        self._managed: dict[int, SharedBuffer] = {}
        # Checked here so a bad list fails loudly at construction, not as -1 from initialize.
        self._transports = _transports(transports)

    def _fail(self, what: str, exc: Exception) -> int:
        log.error("%s failed: %s", what, exc)
        return -1

    def initialize(
        self, local_hostname: str, metadata_server: str, protocol: str, device_name: str
    ) -> int:
        if self._engine is not None:
            return self._fail("initialize", RuntimeError("already initialized"))
        transports = _PROTOCOLS.get(protocol.lower())
        if transports is None:
            return self._fail("initialize", ValueError(f"unsupported protocol {protocol!r}"))
        transports = self._transports or transports
        host, _, port = local_hostname.partition(":")
        try:
            url = metadata_url(metadata_server)
            cfg = EngineConfig(
                host=("127.0.0.1" if host in ("", "localhost") else host),
                port=int(port) if port and url != "p2p" else 0,
                segment_name=(local_hostname if port and url != "p2p" else None),
                metadata=url,
                transports=transports,
            )
            self._engine = _Engine(cfg).start()
        except (MooncakeConnectorsError, ValueError, OSError) as exc:
            self._engine = None
            return self._fail("initialize", exc)
        return 0

    def initialize_ext(
        self,
        local_hostname: str,
        metadata_server: str,
        protocol: str,
        device_name: str,
        metadata_type: str,
    ) -> int:
        if metadata_type.lower() == "p2p":
            metadata_server = "P2PHANDSHAKE"
        elif metadata_type.lower() == "etcd" and "://" not in metadata_server:
            metadata_server = f"etcd://{metadata_server}"
        return self.initialize(local_hostname, metadata_server, protocol, device_name)

    @property
    def engine(self) -> _Engine:
        if self._engine is None:
            raise MooncakeConnectorsError("TransferEngine is not initialized")
        return self._engine

    def get_rpc_port(self) -> int:
        return int(self.engine.segment_name.rpartition(":")[2])

    def get_engine(self) -> _Engine:
        return self.engine

    def send_probe(self, peer_server_name: str) -> int:
        """Is ``HOST:PORT`` reachable (SGLang's PD backend asks before reusing a failed
        session)? 0 yes; as Mooncake: -101 for a name that is not ``HOST:PORT``, -102 when the
        peer does not answer. With ``P2PHANDSHAKE`` this fetches the descriptor from the peer
        itself; with a metadata server, from there (the peer's published descriptor)."""
        host, _, port = peer_server_name.rpartition(":")
        if not host or not port.isdigit():
            self._fail("send_probe", ValueError(f"{peer_server_name!r} is not HOST:PORT"))
            return -101
        try:
            self.engine.refresh_peer(peer_server_name)
        except (MooncakeConnectorsError, OSError) as exc:
            log.info("send_probe %s: %s", peer_server_name, exc)
            return -102
        return 0

    # -- memory -----------------------------------------------------------------------------
    def register_memory(self, buffer_addr: int, capacity: int, location: str = "*") -> int:
        try:
            self.engine.register_raw(buffer_addr, capacity, location=_location(location) or "cpu:0")
        except (MooncakeConnectorsError, ValueError) as exc:
            return self._fail("register_memory", exc)
        return 0

    def unregister_memory(self, buffer_addr: int) -> int:
        try:
            self.engine.unregister(buffer_addr)
        except (MooncakeConnectorsError, ValueError) as exc:
            return self._fail("unregister_memory", exc)
        return 0

    def batch_register_memory(
        self, buffer_addresses: list[int], capacities: list[int], location: str = "*"
    ) -> int:
        if len(buffer_addresses) != len(capacities):
            return self._fail("batch_register_memory", ValueError("lists differ in length"))
        try:
            self.engine.register_many(
                zip(buffer_addresses, capacities, strict=True),
                location=_location(location) or "cpu:0",
            )
        except (MooncakeConnectorsError, ValueError) as exc:
            return self._fail("batch_register_memory", exc)
        return 0

    def batch_unregister_memory(self, buffer_addresses: list[int]) -> int:
        rc = 0
        for a in buffer_addresses:
            rc = min(rc, self.unregister_memory(a))
        return rc

    def allocate_managed_buffer(self, length: int) -> int:
        """A registered memfd buffer (same-host peers copy it at memcpy speed); 0 on failure."""
        try:
            buf = self.engine.allocate_buffer(length)
        except (MooncakeConnectorsError, ValueError, OSError) as exc:
            self._fail("allocate_managed_buffer", exc)
            return 0
        self._managed[buf.addr] = buf
        return buf.addr

    def free_managed_buffer(self, buffer: int, length: int) -> int:
        if self._managed.pop(buffer, None) is None:
            return self._fail("free_managed_buffer", ValueError(f"unknown buffer {buffer:#x}"))
        try:
            self.engine.free_buffer(buffer)
        except (MooncakeConnectorsError, ValueError) as exc:
            return self._fail("free_managed_buffer", exc)
        return 0

    def read_bytes_from_buffer(self, buffer: int, length: int) -> bytes:
        region = self.engine.local.find(buffer, length)
        if region is None:
            raise MooncakeConnectorsError(f"{buffer:#x}+{length} is not registered memory")
        return bytes(region.slice(buffer, length))  # GPU memory: AccessViolation, not a crash

    def write_bytes_to_buffer(self, buffer: int, src: bytes, length: int) -> int:
        region = self.engine.local.find(buffer, length)
        if length > len(src) or region is None or region.device >= 0:
            why = "GPU memory" if region is not None and region.device >= 0 else "bad range"
            return self._fail("write_bytes_to_buffer", ValueError(f"{why} or source"))
        ctypes.memmove(buffer, src, length)
        return 0

    # -- transfers --------------------------------------------------------------------------
    def _batch(
        self, op: TransferOp, target: str, buffers: list[int], peers: list[int], lengths: list[int]
    ) -> int:
        if not len(buffers) == len(peers) == len(lengths):
            return self._fail(
                f"batch_transfer_sync_{op.name.lower()}", ValueError("lists differ in length")
            )
        reqs = [
            TransferRequest(op, target, b, p, n)
            for b, p, n in zip(buffers, peers, lengths, strict=True)
        ]
        try:
            self.engine.transfer(reqs)
        except MooncakeConnectorsError as exc:
            return self._fail(f"transfer {op.name} to {target}", exc)
        return 0

    def transfer_sync_write(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        transport_hint: str = "",
    ) -> int:
        return self._batch(
            TransferOp.WRITE, target_hostname, [buffer], [peer_buffer_address], [length]
        )

    def transfer_sync_read(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        transport_hint: str = "",
    ) -> int:
        return self._batch(
            TransferOp.READ, target_hostname, [buffer], [peer_buffer_address], [length]
        )

    def batch_transfer_sync_write(
        self,
        target_hostname: str,
        buffers: list[int],
        peer_buffer_addresses: list[int],
        lengths: list[int],
        transport_hint: str = "",
    ) -> int:
        return self._batch(
            TransferOp.WRITE, target_hostname, buffers, peer_buffer_addresses, lengths
        )

    def batch_transfer_sync_read(
        self,
        target_hostname: str,
        buffers: list[int],
        peer_buffer_addresses: list[int],
        lengths: list[int],
        transport_hint: str = "",
    ) -> int:
        return self._batch(
            TransferOp.READ, target_hostname, buffers, peer_buffer_addresses, lengths
        )

    def close(self) -> None:
        """Not in Mooncake's API (it frees on destruction); provided for tidy shutdown."""
        if self._engine is not None:
            self._engine.close()
            self._engine = None
            self._managed.clear()

    def __del__(self) -> None:
        finalize("TransferEngine", self._engine, self.close)

    def __getattr__(self, name: str) -> Any:
        raise unsupported(
            "TransferEngine",
            name,
            "initialize, get_rpc_port, register_memory, unregister_memory, batch_register_memory, "
            "allocate_managed_buffer, free_managed_buffer, transfer_sync_write/read, "
            "batch_transfer_sync_write/read",
        )


# The opt-in ``mooncake`` alias (engines' own ``import mooncake.store`` get these facades).
from .compat_alias import install_as_mooncake  # noqa: E402

# The store facade lives in its own module; both are importable from here.
from .compat_store import MooncakeDistributedStore, ReplicateConfig, SoftPinAction  # noqa: E402

__all__ = [
    "MooncakeDistributedStore",
    "ReplicateConfig",
    "SoftPinAction",
    "TransferEngine",
    "install_as_mooncake",
]
