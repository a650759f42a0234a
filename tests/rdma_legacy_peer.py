"""An rdma target that does not negotiate the path MTU, run as a child over the FAKE libibverbs
(tests/fake_ibverbs) under the real pyverbs: a peer of another build (Mooncake's RDMA transport
takes its own port's active MTU, as ours did before it sent its MTU in the connect exchange).

It opens every emulated NIC through our verbs.py, registers one buffer on each, and answers the
rdma transport's connect exchange (no token) with a QP taken to RTR/RTS at its own port's MTU
(the initiator's is ignored) and a reply that carries no MTU. Prints one JSON line (its port,
pid, buffer, and per NIC GID/LID/rkey); then reads commands on stdin: ``sha N`` prints the
SHA-256 of the first N bytes of the buffer. Exits when stdin closes.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import socket
import sys
import threading
from typing import Any

import msgspec

from mooncake_connectors.transfer_core.transports import wire
from mooncake_connectors.transfer_core.transports.rdma import control
from mooncake_connectors.transfer_core.transports.rdma.verbs import Nic, QpAddr, Verbs

SIZE = 4 << 20


def serve(sock: socket.socket, nics: dict[str, Nic], keep: list[Any]) -> None:
    while True:
        try:
            conn, _ = sock.accept()
        except OSError:
            return
        with conn:
            conn.settimeout(10)
            try:
                conn.sendall(wire.HELLO.pack(wire.MAGIC, wire.VERSION, 0, 0, bytes(16)))
                wire.recv_exact(conn, memoryview(bytearray(wire.AUTH.size)))
                conn.sendall(wire.VERDICT.pack(wire.MAGIC, wire.VERDICT_OK, 0, bytes(32)))
                head = bytearray(wire.REQ.size)
                wire.recv_exact(conn, memoryview(head))
                _, _, _, _, rid, _, length = wire.REQ.unpack(head)
                body = bytearray(length)
                wire.recv_exact(conn, memoryview(body))
                req = control.decode_request(bytes(body))
                nic = nics[req.peer_nic]
                qp = nic.create_qp(128)
                psn = int.from_bytes(os.urandom(3), "little")
                # mtu 0: "the peer's is not known", so the QP runs at this port's own MTU
                nic.connect(qp, QpAddr(req.qpn, req.psn, req.gid, req.lid, 0), psn)
                keep.append(qp)
                reply = msgspec.msgpack.encode(
                    {"qpn": int(qp.qp_num), "psn": psn, "gid": nic.gid, "lid": nic.lid}
                )
                resp = wire.RESP.pack(wire.RESP_MAGIC, wire.ST_OK, 0, 0, rid, len(reply))
                conn.sendall(resp + reply)
                conn.recv(1)  # until the initiator hangs up
            except (OSError, ConnectionError):
                continue


def main() -> None:
    verbs = Verbs("pyverbs")
    nics = {name: verbs.open(name, 1, 3) for name in verbs.devices()}
    buf = ctypes.create_string_buffer(SIZE)
    addr = ctypes.addressof(buf)
    mrs = {n: nic.reg_mr(addr, SIZE, verbs.REMOTE_ACCESS) for n, nic in nics.items()}
    sock = socket.create_server(("127.0.0.1", 0))
    keep: list[Any] = []
    threading.Thread(target=serve, args=(sock, nics, keep), daemon=True).start()
    info = {
        "port": sock.getsockname()[1],
        "pid": os.getpid(),
        "addr": addr,
        "length": SIZE,
        "nics": {
            n: {"gid": nic.gid, "lid": nic.lid, "rkey": mrs[n].rkey} for n, nic in nics.items()
        },
    }
    print(json.dumps(info), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd and cmd[0] == "sha":
            print(hashlib.sha256(buf.raw[: int(cmd[1])]).hexdigest(), flush=True)
    sock.close()


if __name__ == "__main__":
    main()
