"""The NIC half of the test-only verbs fake (fake_verbs.py holds the pyverbs-shaped objects):
a device's memory regions, queue pairs, the responder that serves remote READ/WRITE without the
peer's code, injected faults, and the process's device list, configured from the environment.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import itertools
import os
import resource
import socket
import struct
import threading
import types
from collections.abc import Iterator
from typing import TYPE_CHECKING

from mooncake_connectors.transfer_core.transports.rdma.memlock import has_ipc_lock

if TYPE_CHECKING:
    from fake_verbs import MR, QP

e = types.SimpleNamespace(
    IBV_WC_SUCCESS=0,
    IBV_WC_LOC_PROT_ERR=4,
    IBV_WC_WR_FLUSH_ERR=5,
    IBV_WC_REM_INV_REQ_ERR=9,
    IBV_WC_REM_ACCESS_ERR=10,
    IBV_WC_RETRY_EXC_ERR=12,
    IBV_WR_RDMA_WRITE=0,
    IBV_WR_RDMA_READ=4,
    IBV_SEND_SIGNALED=2,
    IBV_QPS_RESET=0,
    IBV_QPS_INIT=1,
    IBV_QPS_RTR=2,
    IBV_QPS_RTS=3,
    IBV_QPS_ERR=6,
    IBV_QP_STATE=1,
    IBV_PORT_DOWN=1,
    IBV_PORT_ACTIVE=4,
    IBV_MTU_4096=5,
    IBV_QPT_RC=2,
    IBV_ACCESS_LOCAL_WRITE=1,
    IBV_ACCESS_REMOTE_WRITE=2,
    IBV_ACCESS_REMOTE_READ=4,
)
_NOQP = 255  # responder: no such QP in a state to receive (the requester retries, then fails)
_REQ = struct.Struct("<BIIIQQ")  # op (0 write, 1 read), src qpn, dst qpn, rkey, addr, length


class PyverbsError(Exception):
    def __init__(self, msg: str, error_code: int = -1) -> None:
        if error_code != -1:
            msg = f"{msg}. Errno: {error_code}, {os.strerror(error_code)}"
        super().__init__(msg)
        self.error_code = error_code


class PyverbsRDMAError(PyverbsError):
    pass


_lock = threading.RLock()
_devices: dict[str, Device] = {}
_locked = [0]  # bytes pinned by live MRs


def pin(length: int) -> None:
    """Count ``length`` pinned bytes against RLIMIT_MEMLOCK, as the kernel does without
    CAP_IPC_LOCK; ENOMEM past it."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    limited = soft != resource.RLIM_INFINITY and not has_ipc_lock()
    with _lock:
        if limited and _locked[0] + length > soft:
            raise PyverbsRDMAError("Failed to register a MR", errno.ENOMEM)
        _locked[0] += length


def unpin(length: int) -> None:
    with _lock:
        _locked[0] -= length


_keys = itertools.count(0x1000)
_qpns = itertools.count(0x100)
_generations = itertools.count()


def _env_devices() -> dict[str, Device]:
    with _lock:
        if not _devices:
            names = os.environ.get("FAKE_VERBS_NICS", "mlx5_0,mlx5_1")
            down = set(os.environ.get("FAKE_VERBS_DOWN", "").split(","))
            for i, n in enumerate(x for x in names.split(",") if x):
                _devices[n] = Device(n, i, e.IBV_PORT_DOWN if n in down else e.IBV_PORT_ACTIVE)
        return _devices


def configure(nics: str, down: str = "") -> None:
    """Replace this process's devices (the old ones vanish)."""
    with _lock:
        for d in _devices.values():
            d.vanish()
        _devices.clear()
        os.environ["FAKE_VERBS_NICS"] = nics
        os.environ["FAKE_VERBS_DOWN"] = down


@contextlib.contextmanager
def isolated() -> Iterator[None]:
    """Run a test module with its own fabric: the FAKE_VERBS_* variables it sets (and the
    processes it starts inherit) are put back afterwards, and its devices vanish."""
    saved = {k: os.environ.get(k) for k in ("FAKE_VERBS_NICS", "FAKE_VERBS_DOWN")}
    try:
        yield
    finally:
        with _lock:
            for d in _devices.values():
                d.vanish()
            _devices.clear()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def device(name: str) -> Device:
    """This process's fake device ``name``, for fault injection and counters."""
    return _env_devices()[name]


def _recv(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError("closed")
        got += k
    return bytes(buf)


class Device:
    """One NIC: its memory regions, queue pairs, responder, and injected faults."""

    def __init__(self, name: str, index: int, state: int) -> None:
        pid = os.getpid()
        self.name = name
        self.port_state = state
        self.lid = (pid * 8 + index + 1) & 0xFFFF
        gen = next(_generations)  # a device made after configure() is a new NIC
        self.gid = f"fe80:0000:0000:{gen:04x}:{pid >> 16:04x}:{pid & 0xFFFF:04x}:0000:{index:04x}"
        self.mrs: dict[int, MR] = {}  # rkey -> MR
        self.lkeys: dict[int, MR] = {}
        self.qps: dict[int, QP] = {}
        self.lock = threading.Lock()
        self.vanished = False
        self.latency = 0.0
        self.failures: collections.deque[int] = collections.deque()
        self.completed = 0  # work requests this device finished, in any way
        self.in_flight = 0  # work requests a QP worker has taken up and not finished
        self.responder: socket.socket | None = None

    # -- faults -----------------------------------------------------------------------------
    def fail(self, count: int, status: int = e.IBV_WC_RETRY_EXC_ERR) -> None:
        """The next ``count`` work requests sent from this device complete with ``status``."""
        self.failures.extend([status] * count)

    def qps_to_error(self) -> None:
        for qp in list(self.qps.values()):
            qp._set_state(e.IBV_QPS_ERR)

    def vanish(self) -> None:
        """The device is gone: every verb on it fails, nothing it held completes."""
        self.vanished = True
        if self.responder is not None:
            with contextlib.suppress(OSError):  # wakes the accepting thread
                self.responder.shutdown(socket.SHUT_RDWR)
            self.responder.close()

    def check(self) -> None:
        if self.vanished:
            raise PyverbsRDMAError(f"device {self.name} is gone", errno.EIO)

    # -- responder --------------------------------------------------------------------------
    def serve(self) -> None:
        with self.lock:
            if self.responder is not None:
                return
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind(b"\0fake-verbs-" + self.gid.encode())
            s.listen(64)
            self.responder = s
        threading.Thread(target=self._accept, args=(s,), daemon=True).start()

    def _accept(self, s: socket.socket) -> None:
        while not self.vanished:
            try:
                conn, _ = s.accept()
            except OSError:
                return
            threading.Thread(target=self._respond, args=(conn,), daemon=True).start()

    def _respond(self, conn: socket.socket) -> None:
        try:
            src_gid = _recv(conn, 64).rstrip(b"\0").decode()
            while not self.vanished:
                op, src_qpn, dst_qpn, rkey, addr, length = _REQ.unpack(_recv(conn, _REQ.size))
                payload = _recv(conn, length) if op == 0 else b""
                if self.vanished:
                    return
                status, data = self._execute(src_gid, op, src_qpn, dst_qpn, rkey, addr, length)
                if status == 0 and op == 0:
                    ctypes.memmove(addr, payload, length)
                conn.sendall(bytes([status]) + data)
        except (ConnectionError, OSError, struct.error):
            pass
        finally:
            conn.close()

    def _execute(
        self, src_gid: str, op: int, src_qpn: int, dst_qpn: int, rkey: int, addr: int, n: int
    ) -> tuple[int, bytes]:
        qp = self.qps.get(dst_qpn)
        if (
            qp is None
            or qp.state not in (e.IBV_QPS_RTR, e.IBV_QPS_RTS)
            or qp.remote != (src_gid, src_qpn)
        ):
            return _NOQP, b""
        mr = self.mrs.get(rkey)
        need = e.IBV_ACCESS_REMOTE_WRITE if op == 0 else e.IBV_ACCESS_REMOTE_READ
        if (
            mr is None
            or mr.pd is not qp.pd
            or not mr.access & need
            or addr < mr.addr
            or addr + n > mr.addr + mr.length
        ):
            qp._set_state(e.IBV_QPS_ERR)  # the responder's QP goes to ERR with the requester's
            return e.IBV_WC_REM_ACCESS_ERR, b""
        return 0, (ctypes.string_at(addr, n) if op == 1 else b"")
