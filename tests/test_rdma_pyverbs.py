"""The rdma seam (verbs.py) over the real pyverbs: Debian's python3-pyverbs (rdma-core 44), in the
venv scripts/bootstrap makes from /usr/bin/python3 (.venv-rdma), or a v59+ build from PyPI's
sdist. Skipped where pyverbs does not import.

These need no device: the import path, the enum constants from either module layout (rdma-core
<= 58's ``pyverbs.enums`` with module-level names, v59+'s ``pyverbs.libibverbs_enums`` whose
names live only in the enum classes under Cython >= 3.1), and the data objects the seam builds.
Each layout runs over the installed build as it is, and the other one is made from its classes."""

from __future__ import annotations

import enum
import importlib
import sys
import types
from collections.abc import Iterator

import pytest

from mooncake_connectors.errors import ConfigError
from mooncake_connectors.transfer_core.transports.rdma.verbs import Verbs

pytest.importorskip("pyverbs.device", reason="pyverbs (python3-pyverbs) does not import here")


def _installed_enums() -> types.ModuleType:
    """The enum module of the installed build: v59's name first, then the older one."""
    for name in ("pyverbs.libibverbs_enums", "pyverbs.enums"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    pytest.fail("pyverbs imports but has neither pyverbs.libibverbs_enums nor pyverbs.enums")


pyverbs_enums = _installed_enums()

# Values from rdma-core's verbs.h, which pyverbs mirrors.
WANT = {
    "IBV_QPT_RC": 2,
    "IBV_QPS_RESET": 0,
    "IBV_QPS_INIT": 1,
    "IBV_QPS_RTR": 2,
    "IBV_QPS_RTS": 3,
    "IBV_QPS_ERR": 6,
    "IBV_QP_STATE": 1,
    "IBV_WR_RDMA_WRITE": 0,
    "IBV_WR_RDMA_READ": 4,
    "IBV_SEND_SIGNALED": 2,
    "IBV_WC_SUCCESS": 0,
    "IBV_WC_LOC_PROT_ERR": 4,
    "IBV_WC_REM_INV_REQ_ERR": 9,
    "IBV_WC_REM_ACCESS_ERR": 10,
    "IBV_ACCESS_LOCAL_WRITE": 1,
    "IBV_ACCESS_REMOTE_WRITE": 2,
    "IBV_ACCESS_REMOTE_READ": 4,
}


def _drop(monkeypatch: pytest.MonkeyPatch, sub: str) -> None:
    """Make ``pyverbs.<sub>`` fail to import, as where that release lacks it."""
    monkeypatch.setitem(sys.modules, f"pyverbs.{sub}", None)
    monkeypatch.delattr(sys.modules["pyverbs"], sub, raising=False)


def _classes(name: str) -> types.ModuleType:
    """A module ``name`` holding the installed build's enum classes and nothing else."""
    mod = types.ModuleType(name)
    for attr, val in vars(pyverbs_enums).items():
        if isinstance(val, enum.EnumMeta):
            setattr(mod, attr, val)
    assert not hasattr(mod, "IBV_QPT_RC")
    return mod


@pytest.fixture
def v59_layout(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """rdma-core v59's layout: ``pyverbs.enums`` gone (a None entry in sys.modules makes its
    import fail, as there), and ``pyverbs.libibverbs_enums`` holding only the enum classes, as
    Cython >= 3.1 builds it (no module-level copies of the members)."""
    _drop(monkeypatch, "enums")
    monkeypatch.setitem(
        sys.modules, "pyverbs.libibverbs_enums", _classes("pyverbs.libibverbs_enums")
    )
    yield


@pytest.fixture
def v58_layout(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """rdma-core <= 58's layout: no ``pyverbs.libibverbs_enums``, and ``pyverbs.enums`` with each
    member at module level as well as in its class (what Cython < 3.1 builds)."""
    mod = _classes("pyverbs.enums")
    for cls in [v for v in vars(mod).values() if isinstance(v, enum.EnumMeta)]:
        for member_name, member in cls.__members__.items():
            setattr(mod, member_name, member)
    _drop(monkeypatch, "libibverbs_enums")
    monkeypatch.setitem(sys.modules, "pyverbs.enums", mod)
    yield


def test_real_pyverbs_loads_with_the_verbs_constants() -> None:
    v = Verbs("pyverbs")
    assert {n: getattr(v.lib.e, n) for n in WANT} == WANT
    assert v.REMOTE_ACCESS == 7 and v.READ_ONLY_ACCESS == 4
    assert v.lib.QP.__module__.startswith("pyverbs")


def test_v59_layout_loads(v59_layout: None) -> None:
    v = Verbs("pyverbs")
    assert {n: getattr(v.lib.e, n) for n in WANT} == WANT


def test_v58_layout_loads(v58_layout: None) -> None:
    v = Verbs("pyverbs")
    assert {n: getattr(v.lib.e, n) for n in WANT} == WANT


def test_pyverbs_without_enums_says_so_not_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    _drop(monkeypatch, "enums")
    _drop(monkeypatch, "libibverbs_enums")
    with pytest.raises(ConfigError) as info:
        Verbs("pyverbs")
    msg = str(info.value)
    assert "lacks the verbs constants" in msg and "IBV_QPT_RC" in msg
    assert "apt-get install" not in msg


def test_the_seam_builds_real_pyverbs_objects() -> None:
    """The keywords and values verbs.py passes are the ones pyverbs' classes take."""
    lib = Verbs("pyverbs").lib
    e = lib.e
    cap = lib.QPCap(max_send_wr=128, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
    init = lib.QPInitAttr(qp_type=e.IBV_QPT_RC, cap=cap, sq_sig_all=0)
    assert init.qp_type == 2 and init.cap.max_send_wr == 128
    attr = lib.QPAttr(qp_state=e.IBV_QPS_RTR, cur_qp_state=e.IBV_QPS_INIT)
    attr.path_mtu, attr.dest_qp_num, attr.rq_psn = 3, 0x1234, 0xABCDEF
    gid = "fe80:0000:0000:0000:0202:c9ff:fe00:0001"
    gr = lib.GlobalRoute(dgid=lib.GID(gid), sgid_index=3)
    attr.ah_attr = lib.AHAttr(dlid=7, is_global=1, port_num=1, gr=gr)
    assert (attr.path_mtu, attr.dest_qp_num, attr.rq_psn) == (3, 0x1234, 0xABCDEF)
    ah = attr.ah_attr
    assert (str(ah.dgid), ah.sgid_index, ah.dlid, ah.is_global) == (gid, 3, 7, 1)
    sge = lib.SGE(0x1000, 65536, 42)
    wr = lib.SendWR(
        wr_id=9, opcode=e.IBV_WR_RDMA_READ, num_sge=1, sg=[sge], send_flags=e.IBV_SEND_SIGNALED
    )
    wr.set_wr_rdma(77, 0x2000)
    assert wr.wr_id == 9 and wr.opcode == 4 and wr.send_flags == 2
