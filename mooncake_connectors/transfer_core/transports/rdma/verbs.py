"""The seam: every call into pyverbs goes through this module, and nothing else imports it.

``Verbs(module)`` loads the verbs objects from ``pyverbs`` (Debian's python3-pyverbs, part of
rdma-core) or, for tests, from a module with the same names (a flat namespace: ``Context``,
``PD``, ``MR``, ``DmaBufMR``, ``CQ``, ``QP``, ``QPCap``, ``QPInitAttr``, ``QPAttr``, ``AHAttr``,
``GlobalRoute``, ``GID``, ``SendWR``, ``SGE``, ``get_device_list``, ``PyverbsError``,
``PyverbsRDMAError`` and ``e`` holding the ``IBV_*`` constants). pyverbs is imported lazily, at
start, so the package imports where rdma-core is absent.

Failures at start (no pyverbs, no device, a port not ACTIVE, ``ulimit -l`` too low) are a
ConfigError that says how to fix them; failures on the data path are TransportBroken.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import threading
from dataclasses import dataclass
from typing import Any

from ....errors import ConfigError, TransportBroken
from .memlock import MEMLOCK_FIX as MEMLOCK_FIX  # where it was
from .memlock import check_memlock
from .memlock import has_ipc_lock as has_ipc_lock  # where it was
from .pyverbs_load import load

log = logging.getLogger(__name__)

PORT_ACTIVE = 4  # IBV_PORT_ACTIVE
LINK_LAYER_INFINIBAND = 1  # IBV_LINK_LAYER_INFINIBAND (a #define in verbs.h, not in every pyverbs)
LINK_LAYER_ETHERNET = 2  # IBV_LINK_LAYER_ETHERNET: RoCE
CQ_ENTRIES = 4096  # the CQ of one NIC, or the device's max_cqe when smaller
RD_ATOMIC = 16  # READs in flight per QP (ConnectX's max_qp_rd_atom), or the device's cap
TRANSPORT_IB = 0  # IBV_TRANSPORT_IB: InfiniBand and RoCE; iWARP is 1, usNIC 2-3, EFA 4
GID_TYPE_ROCE_V2 = 1  # IBV_GID_TYPE_SYSFS_ROCE_V2, what Context.query_gid_type answers


@dataclass(frozen=True)
class QpAddr:
    """What a peer needs to connect an RC QP to ours (sent in the connect exchange). ``mtu``:
    the sender's active path MTU (an IBV_MTU_* value; 0 from a peer that does not send it)."""

    qpn: int
    psn: int
    gid: str
    lid: int
    mtu: int = 0


def _gid_rank(gid: str, gid_type: int) -> int | None:
    """How good a RoCE source GID is (lower is better), None for an empty entry. Routed RoCE v2
    with an IPv4-mapped address first (what a datacenter fabric routes), then other RoCE v2, and
    RoCE v1 (L2 only: a routed fabric drops it) last."""
    digits = gid.replace(":", "")
    if not digits.strip("0"):
        return None
    v4 = digits[:20] == "0" * 20 and digits[20:24].lower() == "ffff"
    local = digits[:4].lower() == "fe80"
    if gid_type != GID_TYPE_ROCE_V2:
        return 3
    return 0 if v4 else 2 if local else 1


class GidChanged(TransportBroken):
    """This NIC's source GID changed under a connect: connect again with the new one."""


@dataclass(frozen=True)
class Completion:
    wr_id: int
    ok: bool
    status: int
    qp_num: int


class Verbs:
    """The verbs objects of one module, and the errors they raise."""

    def __init__(self, module: str = "pyverbs") -> None:
        self.lib = load(module)
        self.module = module
        e = self.lib.e
        self.WC_SUCCESS = int(e.IBV_WC_SUCCESS)
        # Completion statuses that are final for the request (access rights or bounds):
        # retrying the same address elsewhere cannot help.
        self.ACCESS_ERRORS = frozenset(
            int(getattr(e, n)) for n in ("IBV_WC_REM_ACCESS_ERR", "IBV_WC_LOC_PROT_ERR")
        )
        # The peer's NIC NAKed a request as invalid: on first contact, the two ends of that rail
        # disagree (path MTU above all), not the rkey; the rail fails, other rails take over.
        self.INVALID_REQUEST = int(e.IBV_WC_REM_INV_REQ_ERR)
        self.REMOTE_ACCESS = int(
            e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ
        )
        self.READ_ONLY_ACCESS = int(e.IBV_ACCESS_REMOTE_READ)
        self.transport_of: dict[str, int] = {}  # device -> IBV_TRANSPORT_*, from devices()

    def devices(self) -> list[str]:
        """Names of the RDMA devices; ConfigError with the fix when there are none."""
        why = "the device list is empty"
        try:
            devs = self.lib.get_device_list()
        except self.lib.PyverbsError as exc:  # pyverbs raises rather than return [] with none
            devs, why = [], f"listing devices failed: {exc}"
        names = [d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in devs]
        self.transport_of = {
            n: int(getattr(d, "transport_type", TRANSPORT_IB))
            for n, d in zip(names, devs, strict=True)
        }
        if not names:
            raise ConfigError(
                f"no RDMA device ({why}): the rdma transport needs an InfiniBand/RoCE NIC with "
                "its kernel driver loaded (ls /sys/class/infiniband; `rdma link` lists ports); "
                "without one, leave rdma out of `transports`"
            )
        return names

    def open(self, name: str, port: int, gid_index: int = -1, compiled: bool = True) -> Nic:
        """Open ``name``; ``gid_index`` -1 picks this NIC's GID itself (Nic.probe_gid). Its
        data path is the compiled one (fastverbs.FastNic) where ``compiled``, this module is
        the real pyverbs and ``_rdma_fast`` is built, else pyverbs'."""
        from .fastverbs import fast_module

        fast = fast_module() if compiled and self.module == "pyverbs" else None
        if fast is not None:
            from .fastverbs import FastNic

            return FastNic(self, name, port, gid_index, fast)
        return Nic(self, name, port, gid_index)

    def check_memlock(self, minimum: int) -> None:
        """memlock.check_memlock: ConfigError when ``ulimit -l`` is below ``minimum`` bytes."""
        check_memlock(minimum)


class Nic:
    """One opened device: context, PD, one CQ, and the QPs made on it."""

    def __init__(self, verbs: Verbs, name: str, port: int, gid_index: int) -> None:
        lib = verbs.lib
        self.verbs = verbs
        self.lib = lib
        self.name = name
        self.port = port
        self.gid_index = gid_index
        self.auto_gid = gid_index < 0  # probed here: probed again when the table changes
        self.lock = threading.Lock()  # post_send and poll are not safe to call concurrently
        self._gid_lock = threading.Lock()
        self.traffic_class = 0  # the GRH's, on RoCE: DSCP << 2 (the transport sets both)
        self.service_level = 0  # the LRH's, on InfiniBand
        try:
            self.ctx = lib.Context(name=name)
            attr = self.ctx.query_port(port)
            if int(attr.state) != PORT_ACTIVE:
                self.ctx.close()
                raise ConfigError(
                    f"RDMA device {name} port {port} is not ACTIVE (state {int(attr.state)}): "
                    "check the link (`rdma link`, `ibstat`), the cable and the subnet manager, "
                    "or list only healthy NICs in transport_settings['rdma']['nics']",
                    nic=name,
                )
            self.lid = int(attr.lid)
            self.mtu = int(attr.active_mtu)
            self.link_layer = int(getattr(attr, "link_layer", LINK_LAYER_ETHERNET))
            table_len = int(getattr(attr, "gid_tbl_len", 1))
            why = self._unsupported(verbs.transport_of.get(name, TRANSPORT_IB), table_len)
            if why:
                self.ctx.close()
                raise ConfigError(f"RDMA device {name} port {port} {why}", nic=name)
            if gid_index < 0:
                self.gid_index = self.probe_gid(table_len)
            self.gid = str(self.ctx.query_gid(port, self.gid_index))
            self._caps(self.ctx.query_device())
            self._open_data()
        except lib.PyverbsError as exc:
            raise ConfigError(f"RDMA device {name} cannot be opened: {exc}", nic=name) from None

    compiled = False  # the data path of fastverbs.FastNic (compiled) or this one (pyverbs)

    def _open_data(self) -> None:
        """The PD and the CQ the data path uses (here pyverbs'; FastNic makes its own)."""
        self.pd = self.lib.PD(self.ctx)
        self.cq = self.lib.CQ(self.ctx, self.cq_size)

    def _caps(self, dev: Any) -> None:
        """What this device allows, from ibv_query_device: a QP, CQ or rd_atomic depth above
        the device's is refused (EINVAL) at create or connect time, and devices differ."""
        self.max_qp_wr = max(1, int(dev.max_qp_wr))
        # One CQ per NIC holds the completions of every QP on it; the rails bound what they
        # post by it (NicState credits), so it cannot overrun.
        self.cq_size = max(1, min(CQ_ENTRIES, int(dev.max_cqe)))
        self.max_rd_atomic = max(1, min(RD_ATOMIC, int(dev.max_qp_init_rd_atom)))
        self.max_dest_rd_atomic = max(1, min(RD_ATOMIC, int(dev.max_qp_rd_atom)))

    def _unsupported(self, transport: int, table_len: int) -> str | None:
        """Why this device cannot carry the transport's RC QPs (None: it can). They are brought
        up by hand (modify_qp with an address vector), which only InfiniBand and RoCE devices
        take: an iWARP device needs the RDMA CM, EFA has no RC, a management or storage NIC
        with no GID has no address to be reached at."""
        if transport != TRANSPORT_IB:
            return (
                f"is not an InfiniBand/RoCE device (transport type {transport}: iWARP, usNIC or "
                "EFA), whose QPs this transport cannot connect"
            )
        if self.link_layer not in (LINK_LAYER_INFINIBAND, LINK_LAYER_ETHERNET):
            return f"has link layer {self.link_layer}, neither InfiniBand nor Ethernet (RoCE)"
        if table_len < 1:
            return "has an empty GID table (no IP address on its netdev?)"
        return None

    def port_active(self) -> bool:
        """Is the port ACTIVE now? False too when the device no longer answers."""
        try:
            return int(self.ctx.query_port(self.port).state) == PORT_ACTIVE
        except self.lib.PyverbsError:
            return False

    def probe_gid(self, table_len: int) -> int:
        """This NIC's best source GID index. InfiniBand routes by LID: index 0, the port GID.
        RoCE: the table's best entry by _gid_rank (index 0 on mlx5 is RoCE v1 link-local, which
        a routed fabric drops, so a fixed index would silently leave RDMA unused)."""
        best = self._best_gid(table_len)
        if best is None:
            self.ctx.close()
            raise ConfigError(
                f"RDMA device {self.name} port {self.port} has no usable GID (is an IP address "
                "configured on its netdev?); or set transport_settings['rdma']['gid_index']",
                nic=self.name,
            )
        return best

    def _best_gid(self, table_len: int) -> int | None:
        if self.link_layer == LINK_LAYER_INFINIBAND:
            return 0
        best: tuple[int, int] | None = None
        for i in range(max(table_len, 1)):
            try:
                gid = str(self.ctx.query_gid(self.port, i))
                gid_type = int(self.ctx.query_gid_type(self.port, i))
            except self.lib.PyverbsError:
                continue  # an empty or unreadable entry
            rank = _gid_rank(gid, gid_type)
            if rank is not None and (best is None or rank < best[0]):
                best = (rank, i)
        return None if best is None else best[1]

    def reprobe_gid(self) -> bool:
        """Probe the GID table again (once the kernel refused our source GID: its address left
        the netdev, or changed); True when it gave another index or GID, now this NIC's."""
        if not self.auto_gid:
            return False
        with self._gid_lock:
            try:
                table_len = int(getattr(self.ctx.query_port(self.port), "gid_tbl_len", 1))
                best = self._best_gid(table_len)
                gid = "" if best is None else str(self.ctx.query_gid(self.port, best))
            except self.lib.PyverbsError:
                return False
            if best is None or (best, gid) == (self.gid_index, self.gid):
                return False
            log.warning(
                "rdma NIC %s: GID index %d (%s) is gone or changed; using index %d (%s)",
                self.name,
                self.gid_index,
                self.gid,
                best,
                gid,
            )
            self.gid_index, self.gid = best, gid
            return True

    # -- memory -----------------------------------------------------------------------------
    def reg_mr(self, addr: int, length: int, access: int) -> Any:
        try:
            return self.lib.MR(self.pd, length, access, address=addr)
        except self.lib.PyverbsError as exc:
            raise self._reg_error(exc, addr, length) from None

    def reg_dmabuf_mr(
        self, fd: int, offset: int, length: int, addr: int, access: int
    ) -> tuple[Any, int]:
        """A dma-buf MR over device memory ``[addr, addr + length)``, and the iova it starts at.
        pyverbs' DmaBufMR (rdma-core 34..64) takes no iova and registers at iova = ``offset``,
        so work requests address it from there, not by ``addr``, on both sides."""
        if self.lib.DmaBufMR is None:
            raise ConfigError("this pyverbs has no DmaBufMR (rdma-core >= 34 has it)")
        try:
            mr = self.lib.DmaBufMR(self.pd, length, access, dmabuf=fd, offset=offset)
        except self.lib.PyverbsError as exc:
            raise self._reg_error(exc, addr, length) from None
        return mr, offset

    def _reg_error(self, exc: Exception, addr: int, length: int) -> ConfigError:
        code = getattr(exc, "error_code", -1)
        hint = f": {MEMLOCK_FIX}" if code in (errno.ENOMEM, errno.EPERM) else ""
        return ConfigError(
            f"registering {length} bytes at {addr:#x} on {self.name} failed: {exc}{hint}",
            nic=self.name,
        )

    # -- queue pairs ------------------------------------------------------------------------
    def create_qp(self, max_wr: int) -> Any:
        lib, e = self.lib, self.lib.e
        cap = lib.QPCap(
            max_send_wr=min(max_wr, self.max_qp_wr), max_recv_wr=1, max_send_sge=1, max_recv_sge=1
        )
        init = lib.QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap, sq_sig_all=0)
        try:
            return lib.QP(self.pd, init)
        except lib.PyverbsError as exc:
            raise TransportBroken(f"cannot create a QP on {self.name}: {exc}") from None

    def connect(self, qp: Any, remote: QpAddr, psn: int, sent_gid: str | None = None) -> None:
        """RESET -> INIT -> RTR -> RTS, aimed at ``remote``, at the smaller path MTU of the two
        ends (a packet longer than the peer's MTU is dropped or NAKed as an invalid request).
        GidChanged when our GID is no longer ``sent_gid`` (what the peer was told), or the
        kernel refused our GID index at RTR (EINVAL) and a new probe found another: the caller
        connects once more, telling the peer the new one."""
        lib, e = self.lib, self.lib.e
        if sent_gid is not None and sent_gid != self.gid:
            raise GidChanged(f"the GID of {self.name} changed to {self.gid} since {sent_gid}")
        mtu = min(self.mtu, remote.mtu) if remote.mtu else self.mtu
        try:
            attr = lib.QPAttr(qp_state=e.IBV_QPS_INIT, cur_qp_state=e.IBV_QPS_RESET)
            attr.port_num = self.port
            attr.pkey_index = 0
            attr.qp_access_flags = self.verbs.REMOTE_ACCESS
            qp.to_init(attr)
            attr = lib.QPAttr(qp_state=e.IBV_QPS_RTR, cur_qp_state=e.IBV_QPS_INIT)
            attr.path_mtu = mtu
            attr.dest_qp_num = remote.qpn
            attr.rq_psn = remote.psn
            attr.max_dest_rd_atomic = self.max_dest_rd_atomic
            attr.min_rnr_timer = 12
            gr = lib.GlobalRoute(
                dgid=lib.GID(remote.gid),
                sgid_index=self.gid_index,
                traffic_class=self.traffic_class,
            )
            attr.ah_attr = lib.AHAttr(
                dlid=remote.lid, sl=self.service_level, is_global=1, port_num=self.port, gr=gr
            )
            try:
                qp.to_rtr(attr)
            except lib.PyverbsRDMAError as exc:
                old = self.gid_index
                if getattr(exc, "error_code", 0) == errno.EINVAL and self.reprobe_gid():
                    raise GidChanged(
                        f"{self.name} refused its GID index {old} (EINVAL at RTR: the entry "
                        f"is gone or changed); re-probed: index {self.gid_index}"
                    ) from None
                raise
            attr = lib.QPAttr(qp_state=e.IBV_QPS_RTS, cur_qp_state=e.IBV_QPS_RTR)
            attr.sq_psn = psn
            attr.timeout = 14
            attr.retry_cnt = 7
            attr.rnr_retry = 7
            attr.max_rd_atomic = self.max_rd_atomic
            qp.to_rts(attr)
        except lib.PyverbsError as exc:
            raise TransportBroken(f"cannot connect a QP on {self.name}: {exc}") from None
        except (OverflowError, TypeError, ValueError) as exc:
            # pyverbs' Cython setters refuse a peer's QPN, PSN, LID or MTU out of their range
            raise TransportBroken(
                f"cannot connect a QP on {self.name}: the peer sent {remote}: {exc}"
            ) from None

    def to_error(self, qp: Any) -> None:
        """Move ``qp`` to ERR: the NIC stops moving its bytes and flushes what is queued."""
        lib, e = self.lib, self.lib.e
        # A vanished device refuses, and nothing moves on it any more anyway.
        with contextlib.suppress(lib.PyverbsError):
            qp.modify(lib.QPAttr(qp_state=e.IBV_QPS_ERR), e.IBV_QP_STATE)

    def destroy(self, obj: Any) -> None:
        with contextlib.suppress(self.lib.PyverbsError):
            obj.close()

    # -- data path --------------------------------------------------------------------------
    def post(
        self,
        qp: Any,
        wr_id: int,
        write: bool,
        laddr: int,
        length: int,
        lkey: int,
        raddr: int,
        rkey: int,
        signaled: bool,
    ) -> None:
        lib, e = self.lib, self.lib.e
        sge = lib.SGE(laddr, length, lkey)
        wr = lib.SendWR(
            wr_id=wr_id,
            opcode=e.IBV_WR_RDMA_WRITE if write else e.IBV_WR_RDMA_READ,
            num_sge=1,
            sg=[sge],
            send_flags=e.IBV_SEND_SIGNALED if signaled else 0,
        )
        wr.set_wr_rdma(rkey, raddr)
        try:
            with self.lock:
                qp.post_send(wr)
        except lib.PyverbsError as exc:
            raise TransportBroken(f"post_send on {self.name} failed: {exc}") from None

    def post_runs(self, qp: Any, write: bool, runs: list[tuple[int, ...]]) -> int:
        """Post ``runs`` (wr_id, laddr, lkey, raddr, rkey, length, part, signaled), each cut
        into WRs of at most ``part`` bytes; returns how many went out whole (TransportBroken
        when none did). pyverbs: one post_send per WR, as ``post``."""
        for i, (wr_id, laddr, lkey, raddr, rkey, length, part, signaled) in enumerate(runs):
            try:
                for off in range(0, max(length, 1), part):
                    last = off + part >= length
                    n = min(part, length - off)
                    self.post(qp, wr_id, write, laddr + off, n, lkey, raddr + off, rkey,
                              bool(signaled) and last)  # fmt: skip
            except TransportBroken:
                if i == 0:
                    raise
                return i
        return len(runs)

    def poll(self, n: int, spin: bool = False) -> list[Completion]:
        """Up to ``n`` completions (``spin``: only the compiled path spins, FastNic.poll)."""
        ok = self.verbs.WC_SUCCESS
        try:
            with self.lock:
                _, wcs = self.cq.poll(n)
        except self.lib.PyverbsError as exc:
            raise TransportBroken(f"polling the CQ of {self.name} failed: {exc}") from None
        return [
            Completion(int(w.wr_id), int(w.status) == ok, int(w.status), int(w.qp_num)) for w in wcs
        ]

    def close(self) -> None:
        for obj in (self.cq, self.pd, self.ctx):
            self.destroy(obj)
