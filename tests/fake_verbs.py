"""A test-only fake of the pyverbs objects the rdma transport uses (its seam, ``verbs.py``).

Most rdma tests run on the emulated NIC instead: the FAKE libibverbs.so.1 (tests/fake_ibverbs)
under the real pyverbs, in .venv-rdma. This stand-in stays only for what that emulation cannot
give:
  - a transport in the pytest process itself: the C library is picked by the dynamic loader
    through LD_LIBRARY_PATH at process start, so it serves child processes only; tests that
    call the transport object directly (a Slice with a forged region, the control listener's
    socket, Registry and the dma-buf/peermem choice with a Python CUDA driver) run here;
  - the core venv (.venv, where CI runs the cross-transport contract suite): Debian's pyverbs
    is built for /usr/bin/python3 and imports only in .venv-rdma;
  - faults injected from the test into a running NIC: ``fail(n, status)`` of the next n
    requests, ``qps_to_error()``, ``vanish()`` (the CQ can no longer be polled), a per-request
    ``latency`` (a slow rail, a rail owing completions past rail_timeout, requests outlasting a
    deadline), and ``in_flight`` / ``lkeys`` to see what the NIC still holds; the C emulation
    has only a port going down, a fabric carrying one traffic class, and GID-table changes;
  - FAKE_VERBS_INSTANT=1, the benchmark mode below (``bench transfer --rdma-verbs fake_verbs``).

It models NICs in each process: memory regions with lkey/rkey, bounds and access checks, RC
queue pairs with the verbs state machine (RESET, INIT, RTR, RTS, ERR), one-sided READ and
WRITE, completions in order per QP (success only when signalled, errors always, everything
behind an error flushed), and a CQ per context. Each device answers remote requests the way a
NIC does, without the peer's code: a responder thread behind an abstract Unix socket named after
the device's GID, so peers in other processes of this host reach it.

Configured from the environment, so peer processes get the same fabric:
  FAKE_VERBS_NICS  device names of this process, comma-separated ("" = none; default two)
  FAKE_VERBS_DOWN  devices whose port is DOWN
  FAKE_VERBS_INSTANT=1  a request completes when posted and moves no bytes (benchmarks of the
                   CPU cost of the code above the verbs: a NIC moves the bytes without it)
Faults are injected on this process's devices: ``device(name).fail(n, status)``,
``.qps_to_error()``, ``.vanish()``, ``.latency = seconds``.
A DmaBufMR takes pyverbs' arguments (no iova: it starts at iova = offset, as pyverbs' does); this
stand-in maps no dma-buf, so its bytes are not reachable here (tests/fake_ibverbs moves them).
"""

from __future__ import annotations

import collections
import ctypes
import errno
import os
import socket
import threading
import time
import types
from typing import Any

from fake_nic import (
    _NOQP,
    _REQ,
    PyverbsError,
    PyverbsRDMAError,
    _env_devices,
    _keys,
    _qpns,
    _recv,
    configure,
    device,
    e,
    pin,
    unpin,
)

__all__ = ["PyverbsError", "PyverbsRDMAError", "configure", "device", "e"]


class _DevInfo:
    def __init__(self, name: str) -> None:
        self.name = name.encode()


def get_device_list() -> list[_DevInfo]:
    devs = [d for d in _env_devices().values() if not d.vanished]
    if not devs:
        raise PyverbsRDMAError("Failed to get devices list")
    return [_DevInfo(d.name) for d in devs]


class GID:
    def __init__(self, val: str = "") -> None:
        self.gid = val

    def __str__(self) -> str:
        return self.gid


class _PortAttr:
    def __init__(self, state: int, lid: int) -> None:
        self.state, self.lid, self.active_mtu = state, lid, e.IBV_MTU_4096
        self.link_layer, self.gid_tbl_len = 2, 1  # Ethernet (RoCE), one GID


class Context:
    def __init__(self, name: str = "") -> None:
        dev = _env_devices().get(name)
        if dev is None:
            raise PyverbsRDMAError(f"No IB device named {name}", errno.ENODEV)
        dev.check()
        self.dev = dev
        dev.serve()

    def query_port(self, port: int) -> _PortAttr:
        self.dev.check()
        if port != 1:
            raise PyverbsRDMAError(f"Failed to query port {port}", errno.EINVAL)
        return _PortAttr(self.dev.port_state, self.dev.lid)

    def query_gid(self, port: int, index: int) -> GID:
        self.dev.check()
        return GID(self.dev.gid)

    def query_gid_type(self, port: int, index: int) -> int:
        self.dev.check()
        return 1  # IBV_GID_TYPE_SYSFS_ROCE_V2

    def query_device(self) -> Any:
        self.dev.check()  # ConnectX-like caps
        return types.SimpleNamespace(
            max_qp_wr=32768, max_cqe=4194303, max_qp_rd_atom=16, max_qp_init_rd_atom=16
        )

    def close(self) -> None:
        pass


class PD:
    def __init__(self, ctx: Context) -> None:
        ctx.dev.check()
        self.dev = ctx.dev

    def close(self) -> None:
        pass


class MR:
    def __init__(self, pd: PD, length: int, access: int, address: int | None = None) -> None:
        pd.dev.check()
        if address is None:
            raise PyverbsRDMAError("this fake registers given addresses only", errno.EINVAL)
        if access & e.IBV_ACCESS_REMOTE_WRITE and not access & e.IBV_ACCESS_LOCAL_WRITE:
            raise PyverbsRDMAError("Failed to register a MR", errno.EINVAL)
        pin(length)
        self.pd, self.dev = pd, pd.dev
        self.addr, self.length, self.access = address, length, access
        self.lkey, self.rkey = next(_keys), next(_keys)
        self.dev.lkeys[self.lkey] = self
        self.dev.mrs[self.rkey] = self
        self.closed = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.dev.lkeys.pop(self.lkey, None)
        self.dev.mrs.pop(self.rkey, None)
        unpin(self.length)


class DmaBufMR(MR):
    def __init__(self, pd: PD, length: int, access: int, dmabuf: int = -1, offset: int = 0) -> None:
        super().__init__(pd, length, access, address=offset)
        self.dmabuf, self.offset = dmabuf, offset


class WC:
    def __init__(self, wr_id: int, status: int, qp_num: int, opcode: int) -> None:
        self.wr_id, self.status, self.qp_num, self.opcode = wr_id, status, qp_num, opcode


class CQ:
    def __init__(self, ctx: Context, cqe: int, *args: Any, **kw: Any) -> None:
        self.dev = ctx.dev
        self.entries: collections.deque[WC] = collections.deque()
        self.lock = threading.Lock()

    def push(self, wc: WC) -> None:
        with self.lock:
            self.entries.append(wc)

    def poll(self, num_entries: int = 1) -> tuple[int, list[WC]]:
        self.dev.check()
        with self.lock:
            out = [self.entries.popleft() for _ in range(min(num_entries, len(self.entries)))]
        return len(out), out

    def close(self) -> None:
        pass


class QPCap:
    def __init__(self, max_send_wr: int = 1, max_recv_wr: int = 1, **kw: int) -> None:
        self.max_send_wr, self.max_recv_wr = max_send_wr, max_recv_wr


class QPInitAttr:
    def __init__(
        self, qp_type: int, scq: CQ, rcq: CQ, cap: QPCap, sq_sig_all: int = 0, **kw: Any
    ) -> None:
        self.qp_type, self.scq, self.cap, self.sq_sig_all = qp_type, scq, cap, sq_sig_all


class QPAttr:
    def __init__(self, qp_state: int = 0, cur_qp_state: int = 0) -> None:
        self.qp_state, self.cur_qp_state = qp_state, cur_qp_state
        self.port_num: int | None = None
        self.qp_access_flags: int | None = None
        self.dest_qp_num: int | None = None
        self.ah_attr: AHAttr | None = None
        self.path_mtu: int | None = None
        self.rq_psn: int | None = None
        self.sq_psn: int | None = None


class GlobalRoute:
    def __init__(self, dgid: GID, sgid_index: int = 0, **kw: Any) -> None:
        self.dgid, self.sgid_index = dgid, sgid_index


class AHAttr:
    def __init__(
        self,
        dlid: int = 0,
        sl: int = 0,
        is_global: int = 0,
        port_num: int = 1,
        gr: GlobalRoute | None = None,
    ) -> None:
        self.dlid, self.is_global, self.port_num, self.gr = dlid, is_global, port_num, gr
        self.sl = sl


class SGE:
    def __init__(self, addr: int, length: int, lkey: int) -> None:
        self.addr, self.length, self.lkey = addr, length, lkey


class SendWR:
    def __init__(
        self,
        wr_id: int = 0,
        opcode: int = 0,
        num_sge: int = 1,
        sg: list[SGE] | None = None,
        send_flags: int = 0,
    ) -> None:
        self.wr_id, self.opcode, self.sg, self.send_flags = wr_id, opcode, sg or [], send_flags
        self.rkey = self.remote_addr = 0

    def set_wr_rdma(self, rkey: int, addr: int) -> None:
        self.rkey, self.remote_addr = rkey, addr


class QP:
    """An RC queue pair; its send queue is worked in order by one thread, as a NIC would."""

    def __init__(self, pd: PD, init_attr: QPInitAttr) -> None:
        pd.dev.check()
        if init_attr.qp_type != e.IBV_QPT_RC:
            raise PyverbsRDMAError("this fake models RC QPs only", errno.EINVAL)
        self.pd, self.dev, self.cq = pd, pd.dev, init_attr.scq
        self.max_wr = init_attr.cap.max_send_wr
        self.qp_num = next(_qpns)
        self.state = e.IBV_QPS_RESET
        self.remote: tuple[str, int] | None = None
        self.sq: collections.deque[SendWR] = collections.deque()
        self.cv = threading.Condition()
        self.conn: socket.socket | None = None
        self.closed = False
        self.instant = os.environ.get("FAKE_VERBS_INSTANT") == "1"
        self.dev.qps[self.qp_num] = self
        threading.Thread(target=self._work, name=f"fake-qp-{self.qp_num}", daemon=True).start()

    @property
    def qp_state(self) -> int:
        return self.state

    def _set_state(self, state: int) -> None:
        with self.cv:
            self.state = state
            self.cv.notify_all()

    def _need(self, attr: QPAttr, *fields: str) -> None:
        for f in fields:
            if getattr(attr, f) is None:
                raise PyverbsRDMAError(f"Failed to modify QP state: {f} missing", errno.EINVAL)

    def to_init(self, attr: QPAttr) -> None:
        self.dev.check()
        if self.state not in (e.IBV_QPS_RESET, e.IBV_QPS_INIT):
            raise PyverbsRDMAError("Failed to modify QP state to INIT", errno.EINVAL)
        self._need(attr, "port_num", "qp_access_flags")
        self._set_state(e.IBV_QPS_INIT)

    def to_rtr(self, attr: QPAttr) -> None:
        self.dev.check()
        if self.state == e.IBV_QPS_RESET:
            self.to_init(attr)
        if self.state != e.IBV_QPS_INIT:
            raise PyverbsRDMAError("Failed to modify QP state to RTR", errno.EINVAL)
        self._need(attr, "dest_qp_num", "ah_attr", "path_mtu", "rq_psn")
        assert attr.ah_attr is not None and attr.dest_qp_num is not None
        gr = attr.ah_attr.gr
        if not attr.ah_attr.is_global or gr is None:
            raise PyverbsRDMAError("RoCE needs a GRH (is_global and a dgid)", errno.EINVAL)
        self.remote = (str(gr.dgid), attr.dest_qp_num)
        self._set_state(e.IBV_QPS_RTR)

    def to_rts(self, attr: QPAttr) -> None:
        self.dev.check()
        if self.state != e.IBV_QPS_RTR:
            raise PyverbsRDMAError("Failed to modify QP state to RTS", errno.EINVAL)
        self._need(attr, "sq_psn")
        self._set_state(e.IBV_QPS_RTS)

    def modify(self, attr: QPAttr, mask: int) -> None:
        self.dev.check()
        if attr.qp_state not in (e.IBV_QPS_ERR, e.IBV_QPS_RESET):
            raise PyverbsRDMAError("this fake modifies to ERR or RESET only", errno.EINVAL)
        self._set_state(attr.qp_state)

    def post_send(self, wr: SendWR, bad_wr: Any = None) -> None:
        self.dev.check()
        if self.state not in (e.IBV_QPS_RTS, e.IBV_QPS_ERR):
            raise PyverbsRDMAError("Failed to post send", errno.EINVAL)
        if self.instant and self.state == e.IBV_QPS_RTS and not self.dev.failures:
            self._complete(wr, 0)
            return
        with self.cv:
            if len(self.sq) >= self.max_wr:
                raise PyverbsRDMAError("Failed to post send", errno.ENOMEM)
            self.sq.append(wr)
            self.cv.notify_all()

    def close(self) -> None:
        with self.cv:
            self.closed = True
            self.cv.notify_all()
        self.dev.qps.pop(self.qp_num, None)

    # -- the requester ----------------------------------------------------------------------
    def _complete(self, wr: SendWR, status: int) -> None:
        self.dev.completed += 1
        if status != 0 or wr.send_flags & e.IBV_SEND_SIGNALED:
            self.cq.push(WC(wr.wr_id, status, self.qp_num, wr.opcode))

    def _work(self) -> None:
        while True:
            with self.cv:
                while not self.sq and not self.closed:
                    self.cv.wait()
                if self.closed:
                    if self.conn is not None:
                        self.conn.close()
                    return
                wr = self.sq[0]
                with self.dev.lock:
                    self.dev.in_flight += 1
            if self.dev.vanished:
                return  # a dead device completes nothing
            if self.dev.latency:
                time.sleep(self.dev.latency)
            status = e.IBV_WC_WR_FLUSH_ERR if self.state == e.IBV_QPS_ERR else self._execute(wr)
            with self.cv:
                if self.sq and self.sq[0] is wr:
                    self.sq.popleft()
            with self.dev.lock:
                self.dev.in_flight -= 1
            if status not in (0, e.IBV_WC_WR_FLUSH_ERR):
                self._set_state(e.IBV_QPS_ERR)
            if not self.dev.vanished and not self.closed:
                self._complete(wr, status)

    def _execute(self, wr: SendWR) -> int:
        if self.dev.failures:
            return self.dev.failures.popleft()
        sge = wr.sg[0]
        mr = self.dev.lkeys.get(sge.lkey)
        read = wr.opcode == e.IBV_WR_RDMA_READ
        if (
            mr is None
            or mr.pd is not self.pd
            or sge.addr < mr.addr
            or sge.addr + sge.length > mr.addr + mr.length
            or (read and not mr.access & e.IBV_ACCESS_LOCAL_WRITE)
        ):
            return e.IBV_WC_LOC_PROT_ERR
        assert self.remote is not None
        try:
            if self.conn is None:
                c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                c.connect(b"\0fake-verbs-" + self.remote[0].encode())
                c.sendall(self.dev.gid.encode().ljust(64, b"\0"))
                self.conn = c
            head = _REQ.pack(
                1 if read else 0, self.qp_num, self.remote[1], wr.rkey, wr.remote_addr, sge.length
            )
            self.conn.sendall(head if read else head + ctypes.string_at(sge.addr, sge.length))
            status = _recv(self.conn, 1)[0]
            if status == 0 and read:
                ctypes.memmove(sge.addr, _recv(self.conn, sge.length), sge.length)
        except OSError:
            status = _NOQP
        return e.IBV_WC_RETRY_EXC_ERR if status == _NOQP else status
