"""The connect exchange of the rdma transport, over our framed, authenticated control channel.

The initiator makes an RC QP on its NIC and sends (its segment, its NIC, the peer's NIC, QP
number, PSN, GID, LID, MTU); the target makes a QP on the named NIC, takes it to RTR/RTS aimed at
the initiator's, and answers with its own QP number, PSN, GID, LID and MTU. The channel is the tcp
transport's listener format (wire.py: HELLO/AUTH handshake under the engine's token, then one
OP_CONTROL request), served by the rdma transport's own listener, which carries no data.
"""

from __future__ import annotations

import time

import msgspec

from ....errors import MooncakeConnectorsError, ProtocolError, TransportBroken
from ...transport import TransportContext
from .. import wire
from ..tcp import open_connection
from .verbs import QpAddr


class ConnectRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    segment: str
    nic: str  # the initiator's NIC
    peer_nic: str  # the target's NIC to connect to
    qpn: int
    psn: int
    gid: str
    lid: int
    mtu: int = 0  # the initiator's active MTU (IBV_MTU_*); both ends use the smaller
    # a rail's direct QP (direct.py), kept apart from the rail's own; sent only when set, so
    # a rail's request is what older versions expect (they refuse the field: no direct QP)
    direct: bool = False


class ConnectReply(msgspec.Struct, frozen=True):
    qpn: int
    psn: int
    gid: str
    lid: int
    mtu: int = 0


_enc = msgspec.msgpack.Encoder()


def decode_request(payload: bytes) -> ConnectRequest:
    try:
        return msgspec.msgpack.decode(payload, type=ConnectRequest)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"bad rdma connect request: {exc}") from None


def encode_reply(addr: QpAddr) -> bytes:
    return _enc.encode(ConnectReply(addr.qpn, addr.psn, addr.gid, addr.lid, addr.mtu))


def exchange(
    ctx: TransportContext, peer: str, endpoint: str, req: ConnectRequest, deadline: float
) -> QpAddr:
    """Send ``req`` to ``peer``'s rdma listener; its QP's address, within ``deadline``."""
    path = f"rdma control {endpoint}"
    sock = open_connection(ctx, peer, endpoint, path, deadline)
    try:
        payload = _enc.encode(req)
        head = wire.REQ.pack(wire.REQ_MAGIC, wire.OP_CONTROL, 0, 0, 1, 0, len(payload))
        wire.send_until(sock, [head + payload], deadline)
        hdr = bytearray(wire.RESP.size)
        wire.recv_until(sock, memoryview(hdr), deadline)
        magic, status, _, _, rid, length = wire.RESP.unpack(hdr)
        limit = wire.MAX_CONTROL if status == wire.ST_OK else wire.MAX_ERROR_MESSAGE
        if magic != wire.RESP_MAGIC or rid != 1 or length > limit:
            raise ProtocolError("bad answer to an rdma connect request", peer=peer, path=path)
        body = bytearray(length)
        wire.recv_until(sock, memoryview(body), deadline)
        if status != wire.ST_OK:
            raise TransportBroken(
                f"peer refused the rdma connect: {body.decode(errors='replace')}",
                peer=peer,
                path=path,
            )
        rep = msgspec.msgpack.decode(bytes(body), type=ConnectReply)
        return QpAddr(rep.qpn, rep.psn, rep.gid, rep.lid, rep.mtu)
    except (OSError, TimeoutError) as exc:
        late = time.monotonic() >= deadline
        raise TransportBroken(
            f"rdma connect exchange {'outlasted the deadline' if late else 'failed'}: {exc}",
            peer=peer,
            path=path,
        ) from None
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"bad rdma connect reply: {exc}", peer=peer, path=path) from None
    except MooncakeConnectorsError:
        raise
    finally:
        sock.close()


__all__ = ["ConnectReply", "ConnectRequest", "decode_request", "encode_reply", "exchange"]
