"""Map wire status codes to our exceptions (one place, used by every framed transport)."""

from __future__ import annotations

from ..errors import AccessViolation, MooncakeConnectorsError, ProtocolError, TransportBroken
from .transports import wire


def from_status(status: int, message: str, *, peer: str, path: str) -> MooncakeConnectorsError:
    if status == wire.ST_ACCESS:
        return AccessViolation(f"peer refused access: {message}", peer=peer, path=path)
    if status == wire.ST_PROTOCOL:
        return ProtocolError(f"peer reported a protocol error: {message}", peer=peer, path=path)
    return TransportBroken(
        f"peer failed the request (status {status}): {message}", peer=peer, path=path
    )
