"""Loading pyverbs (or a module with the same names, for tests) into one flat namespace: the
verbs objects, the errors, and every ``IBV_*`` constant as a plain int (``e``). Part of the seam
of verbs.py, which alone calls what this returns."""

from __future__ import annotations

import enum
import importlib
import types
from typing import Any

from ....errors import ConfigError

_NAMES = (
    "Context",
    "PD",
    "MR",
    "DmaBufMR",
    "CQ",
    "QP",
    "QPCap",
    "QPInitAttr",
    "QPAttr",
    "AHAttr",
    "GlobalRoute",
    "GID",
    "SendWR",
    "SGE",
    "get_device_list",
    "PyverbsError",
    "PyverbsRDMAError",
)
# The IBV_* constants this module reads; start fails clearly when pyverbs lacks one.
_ENUMS = (
    "IBV_WC_SUCCESS",
    "IBV_WC_REM_ACCESS_ERR",
    "IBV_WC_LOC_PROT_ERR",
    "IBV_WC_REM_INV_REQ_ERR",
    "IBV_ACCESS_LOCAL_WRITE",
    "IBV_ACCESS_REMOTE_WRITE",
    "IBV_ACCESS_REMOTE_READ",
    "IBV_QPT_RC",
    "IBV_QPS_RESET",
    "IBV_QPS_INIT",
    "IBV_QPS_RTR",
    "IBV_QPS_RTS",
    "IBV_QPS_ERR",
    "IBV_QP_STATE",
    "IBV_WR_RDMA_WRITE",
    "IBV_WR_RDMA_READ",
    "IBV_SEND_SIGNALED",
)
_PYVERBS_FIX = (
    "install rdma-core's Python bindings (Debian/Ubuntu: apt-get install python3-pyverbs) and "
    "run a Python of the same version that can import them (a venv made with "
    "--system-site-packages, or /usr/lib/python3/dist-packages on PYTHONPATH)"
)


def _flat_enums(mods: list[types.ModuleType]) -> types.SimpleNamespace:
    """Every ``IBV_*`` constant of pyverbs' enum modules, as plain ints in one namespace.

    rdma-core <= 58 (``pyverbs.enums``, Cython < 3.1) puts each member at module level as well as
    in its enum class; v59 moved them to ``pyverbs.libibverbs_enums``, and Cython >= 3.1 builds
    keep them only in the classes (``ibv_qp_type.IBV_QPT_RC``). Reading the classes covers both.
    """
    flat: dict[str, int] = {}
    for mod in mods:
        for name, val in vars(mod).items():
            if isinstance(val, enum.EnumMeta):
                members: dict[str, Any] = dict(val.__members__)
                for member_name, member in members.items():
                    if member_name.startswith("IBV_"):
                        flat.setdefault(member_name, int(member))
            elif name.startswith("IBV_") and isinstance(val, int):
                flat.setdefault(name, int(val))
    return types.SimpleNamespace(**flat)


def _enum_modules() -> list[types.ModuleType]:
    mods = []
    for name in ("pyverbs.libibverbs_enums", "pyverbs.enums"):  # v59+, then v28..v58
        try:
            mods.append(importlib.import_module(name))
        except ImportError:
            continue
    return mods


def _load_pyverbs() -> types.SimpleNamespace:
    try:
        from pyverbs import addr, cq, device, mr, pd, pyverbs_error, qp, wr
    except ImportError as exc:
        if exc.name == "pyverbs":
            raise ConfigError(f"the rdma transport needs pyverbs ({exc}): {_PYVERBS_FIX}") from None
        raise ConfigError(
            f"pyverbs is installed but does not load ({exc}): run a Python of the version it was "
            "built for, or reinstall rdma-core's Python bindings"
        ) from None
    mods = _enum_modules()
    e = _flat_enums(mods)
    missing = [n for n in _ENUMS if not hasattr(e, n)]
    if missing:
        import pyverbs

        where = getattr(pyverbs, "__file__", "?")
        raise ConfigError(
            f"pyverbs at {where} lacks the verbs constants {missing} (enum modules found: "
            f"{[m.__name__ for m in mods]}): this layout of rdma-core's bindings is not known here"
        )
    ns = types.SimpleNamespace(
        Context=device.Context,
        get_device_list=device.get_device_list,
        PD=pd.PD,
        MR=mr.MR,
        DmaBufMR=getattr(mr, "DmaBufMR", None),
        CQ=cq.CQ,
        QP=qp.QP,
        QPCap=qp.QPCap,
        QPInitAttr=qp.QPInitAttr,
        QPAttr=qp.QPAttr,
        AHAttr=addr.AHAttr,
        GlobalRoute=addr.GlobalRoute,
        GID=addr.GID,
        SendWR=wr.SendWR,
        SGE=wr.SGE,
        PyverbsError=pyverbs_error.PyverbsError,
        PyverbsRDMAError=pyverbs_error.PyverbsRDMAError,
        e=e,
    )
    return ns


def load(module: str) -> types.SimpleNamespace:
    """The verbs namespace from ``module`` ("pyverbs", or a module with the same names)."""
    if module == "pyverbs":
        return _load_pyverbs()
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(f"rdma verbs module {module!r} does not import: {exc}") from None
    missing = [n for n in (*_NAMES, "e") if not hasattr(mod, n)]
    if missing:
        raise ConfigError(f"rdma verbs module {module!r} lacks {missing}")
    return types.SimpleNamespace(**{n: getattr(mod, n) for n in (*_NAMES, "e")})
