"""The opt-in ``mooncake`` alias: ``import mooncake.engine`` / ``mooncake.store`` get our facades.

Engines import Mooncake themselves (vLLM's ``MooncakeConnector`` does
``from mooncake.engine import TransferEngine``, its ``MooncakeStoreConnector``
``from mooncake.store import MooncakeDistributedStore, ReplicateConfig``). With the alias on, those
imports resolve to :mod:`mooncake_connectors.compat`'s ``TransferEngine`` and
:mod:`mooncake_connectors.compat_store`'s ``MooncakeDistributedStore``, with no edit to the engine.

Switched on by :func:`install_as_mooncake` (this process, and its children through the
environment variable it sets) or by ``MOONCAKE_CONNECTORS_AS_MOONCAKE=1``, which
:func:`install_from_env` honours; vLLM's plugin loader calls it in every process vLLM starts
(API server, engine core, workers), before any connector imports ``mooncake``.

The alias is a finder at the front of ``sys.meta_path`` that answers for ``mooncake``,
``mooncake.engine`` and ``mooncake.store``; nothing is written to disk. Any other
``mooncake.*`` (``mooncake.allocator``, ...) is a ``ModuleNotFoundError`` naming what the alias
provides. An installed Mooncake is shadowed only when the alias is explicitly on: the one log line
says which installation it shadows. Where the real one was imported before the switch, the
switch raises a ConfigError instead: both would be in use at once.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys
from collections.abc import Sequence
from types import ModuleType

from .config import ALIAS_ENV, alias_from_env
from .errors import ConfigError

log = logging.getLogger(__name__)

# module -> (our module, the names it exports there)
EXPORTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "mooncake.engine": ("mooncake_connectors.compat", ("TransferEngine",)),
    "mooncake.store": (
        "mooncake_connectors.compat_store",
        (
            "BufferHandle",
            "MooncakeDistributedStore",
            "ObjectDataType",
            "ReplicateConfig",
            "SoftPinAction",
        ),
    ),
}
MARK = "__mooncake_connectors_alias__"


class _Loader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None  # the default module object

    def exec_module(self, module: ModuleType) -> None:
        setattr(module, MARK, True)
        if module.__name__ == "mooncake":
            module.__doc__ = "mooncake_connectors' alias of Mooncake's Python package."
            return
        source, names = EXPORTS[module.__name__]
        ours = importlib.import_module(source)
        for name in names:
            setattr(module, name, getattr(ours, name))
        module.__all__ = list(names)  # type: ignore[attr-defined]


class MooncakeAlias(importlib.abc.MetaPathFinder):
    """Answers for the ``mooncake`` package names; every other import passes by."""

    loader = _Loader()

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname == "mooncake":
            return importlib.util.spec_from_loader(fullname, self.loader, is_package=True)
        if fullname in EXPORTS:
            return importlib.util.spec_from_loader(fullname, self.loader)
        if fullname.startswith("mooncake."):
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: the mooncake alias of mooncake_connectors "
                f"provides {', '.join(EXPORTS)} only",
                name=fullname,
            )
        return None


def _finder() -> MooncakeAlias | None:
    return next((f for f in sys.meta_path if isinstance(f, MooncakeAlias)), None)


def installed() -> bool:
    """Whether the alias is on in this process."""
    return _finder() is not None


def _shadowed() -> str | None:
    """Where an installed Mooncake lives (None: none is), found as if the alias were off."""
    spec = importlib.machinery.PathFinder.find_spec("mooncake")
    if spec is None:
        return None
    return spec.origin or ", ".join(spec.submodule_search_locations or ()) or "?"


def install_as_mooncake() -> None:
    """Make ``mooncake``, ``mooncake.engine`` and ``mooncake.store`` ours in this process and,
    through ``MOONCAKE_CONNECTORS_AS_MOONCAKE=1`` in the environment, in the Python processes
    it starts that call :func:`install_from_env` (every vLLM process does). Idempotent."""
    os.environ[ALIAS_ENV] = "1"  # children inherit the switch
    if installed():
        return
    loaded = [m for m in ("mooncake", *EXPORTS) if m in sys.modules]
    real = [m for m in loaded if not getattr(sys.modules[m], MARK, False)]
    if real:
        where = getattr(sys.modules[real[0]], "__file__", None) or "?"
        raise ConfigError(
            f"the mooncake alias cannot take effect: {', '.join(real)} already imported from "
            f"{where}; switch it on ({ALIAS_ENV}=1 or install_as_mooncake()) before anything "
            "imports mooncake"
        )
    shadowed = _shadowed()
    sys.meta_path.insert(0, MooncakeAlias())
    log.warning(
        "mooncake alias on: %s resolve to mooncake_connectors in pid %d%s",
        ", ".join(EXPORTS),
        os.getpid(),
        f" (shadowing the Mooncake installed at {shadowed})" if shadowed else "",
    )


def install_from_env() -> bool:
    """Switch the alias on when ``MOONCAKE_CONNECTORS_AS_MOONCAKE`` says so; whether it is on."""
    if alias_from_env():
        install_as_mooncake()
    return installed()


def uninstall_mooncake_alias() -> None:
    """Switch the alias off in this process (modules already imported keep what they got)."""
    os.environ.pop(ALIAS_ENV, None)
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, MooncakeAlias)]
    for name in [m for m in sys.modules if m == "mooncake" or m.startswith("mooncake.")]:
        if getattr(sys.modules[name], MARK, False):
            del sys.modules[name]
