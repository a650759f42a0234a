"""The compiled data path of a NIC: ``FastNic``, a verbs.Nic whose PD, CQ, MRs and QPs are made
by ``_rdma_fast`` (Cython over libibverbs, built at install where a C compiler and
libibverbs-dev are present) on its own device context.

pyverbs ships no .pxd, so compiled code cannot reach the C objects behind pyverbs' PD, MR or QP
safely (their layout is private to that build). A second context on the same device is what
every verbs user may open: the compiled module makes everything the data path touches there,
and pyverbs keeps the control path it is good at (device list, port and GID queries, device
caps, on its own context). Nothing made by one is handed to the other: the lkeys, rkeys and QP
numbers the rails use all come from the compiled module's objects.

``MOONCAKE_CONNECTORS_PURE_PYTHON=1`` keeps the compiled path off (the rails then post through
pyverbs, one call per WR); ``MOONCAKE_CONNECTORS_SPIN_US`` bounds how long a poll that found
the CQ empty spins in C without the interpreter lock before it returns (default 50).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from types import ModuleType
from typing import Any

from ....errors import ConfigError, TransportBroken
from ..fast import PURE_ENV, spin_us
from .verbs import Completion, GidChanged, Nic, QpAddr, Verbs

log = logging.getLogger(__name__)
_loaded: list[ModuleType | None] = []


def fast_module() -> ModuleType | None:
    """``_rdma_fast``, or None where it is not built or MOONCAKE_CONNECTORS_PURE_PYTHON is set."""
    if os.environ.get(PURE_ENV, "") not in ("", "0"):
        return None
    if not _loaded:
        try:
            from . import _rdma_fast  # type: ignore[attr-defined]
        except ImportError as exc:
            log.debug("compiled rdma data path not built (%s): pyverbs posts", exc)
            _loaded.append(None)
        else:
            _loaded.append(_rdma_fast)
    return _loaded[0]


def gid_bytes(gid: str) -> bytes:
    """The 16 bytes of a GID written as pyverbs writes it (8 groups of 4 hex digits)."""
    raw = bytes.fromhex(gid.replace(":", ""))
    if len(raw) != 16:
        raise ValueError(f"a GID is 16 bytes, got {gid!r}")
    return raw


class FastNic(Nic):
    """A Nic whose data path is compiled (see the module's docstring)."""

    compiled = True

    def __init__(self, verbs: Verbs, name: str, port: int, gid_index: int, fast: Any) -> None:
        self.fast = fast
        self.dev: Any = None
        super().__init__(verbs, name, port, gid_index)

    def _open_data(self) -> None:
        try:
            self.dev = self.fast.Device(self.name, self.cq_size)
        except OSError as exc:
            self.ctx.close()
            raise ConfigError(
                f"RDMA device {self.name} cannot be opened: {exc}", nic=self.name
            ) from None
        self.spin = spin_us() * 1e-6
        self.pd = self.cq = None

    # -- memory -----------------------------------------------------------------------------
    def reg_mr(self, addr: int, length: int, access: int) -> Any:
        try:
            return self.dev.reg_mr(addr, length, access)
        except OSError as exc:
            raise self._reg_error(_with_code(exc), addr, length) from None

    def reg_dmabuf_mr(
        self, fd: int, offset: int, length: int, addr: int, access: int
    ) -> tuple[Any, int]:
        # at iova = offset, as pyverbs' DmaBufMR registers it (verbs.Nic.reg_dmabuf_mr)
        try:
            return self.dev.reg_dmabuf_mr(fd, offset, length, offset, access), offset
        except OSError as exc:
            raise self._reg_error(_with_code(exc), addr, length) from None

    # -- queue pairs ------------------------------------------------------------------------
    def create_qp(self, max_wr: int, own_cq: bool = False) -> Any:
        """An RC QP on the NIC's CQ, or (``own_cq``, a direct QP) on a CQ of its own."""
        try:
            return self.dev.create_qp(min(max_wr, self.max_qp_wr), own_cq)
        except OSError as exc:
            raise TransportBroken(f"cannot create a QP on {self.name}: {exc}") from None

    def connect(self, qp: Any, remote: QpAddr, psn: int, sent_gid: str | None = None) -> None:
        if sent_gid is not None and sent_gid != self.gid:
            raise GidChanged(f"the GID of {self.name} changed to {self.gid} since {sent_gid}")
        mtu = min(self.mtu, remote.mtu) if remote.mtu else self.mtu
        try:
            dgid = gid_bytes(remote.gid)
            qp.to_init(self.port, self.verbs.REMOTE_ACCESS)
            try:
                qp.to_rtr(mtu, remote.qpn, remote.psn, self.max_dest_rd_atomic, 12, remote.lid,
                          self.service_level, self.port, dgid, self.gid_index,
                          self.traffic_class)  # fmt: skip
            except OSError as exc:
                old = self.gid_index
                if exc.errno == errno.EINVAL and self.reprobe_gid():
                    raise GidChanged(
                        f"{self.name} refused its GID index {old} (EINVAL at RTR: the entry "
                        f"is gone or changed); re-probed: index {self.gid_index}"
                    ) from None
                raise
            qp.to_rts(psn, 14, 7, 7, self.max_rd_atomic)
        except OSError as exc:
            raise TransportBroken(f"cannot connect a QP on {self.name}: {exc}") from None
        except (OverflowError, TypeError, ValueError) as exc:
            raise TransportBroken(
                f"cannot connect a QP on {self.name}: the peer sent {remote}: {exc}"
            ) from None

    def to_error(self, qp: Any) -> None:
        qp.to_error()

    def destroy(self, obj: Any) -> None:
        with contextlib.suppress(OSError, self.lib.PyverbsError):
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
        self.post_runs(qp, write, [(wr_id, laddr, lkey, raddr, rkey, length, max(length, 1),
                                    signaled)])  # fmt: skip

    def post_runs(self, qp: Any, write: bool, runs: list[tuple[int, ...]]) -> int:
        """One chain of WRs for all ``runs``, one doorbell (see verbs.Nic.post_runs)."""
        try:
            return int(qp.post_runs(write, runs))
        except (OSError, ValueError, OverflowError) as exc:
            raise TransportBroken(f"post_send on {self.name} failed: {exc}") from None

    def poll(self, n: int, spin: bool = False) -> list[Completion]:
        """As verbs.Nic.poll; ``spin`` (the poller thread): when one poll (with the GIL) finds
        the CQ empty, poll it in C without the GIL for up to MOONCAKE_CONNECTORS_SPIN_US before
        returning none."""
        ok = self.verbs.WC_SUCCESS
        try:
            wcs = self.dev.poll(n, self.spin if spin else 0.0)
        except OSError as exc:
            raise TransportBroken(f"polling the CQ of {self.name} failed: {exc}") from None
        return [Completion(w, s == ok, s, q) for w, s, q in wcs]

    def close(self) -> None:
        if self.dev is not None:
            self.dev.close()
        self.destroy(self.ctx)


def _with_code(exc: OSError) -> OSError:
    """``exc`` with pyverbs' ``error_code`` attribute, which verbs.Nic._reg_error reads."""
    exc.error_code = exc.errno  # type: ignore[attr-defined]
    return exc
