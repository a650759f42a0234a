"""Lazy re-exports for a package's ``__init__``: a name imports its module on first access.

Packages whose modules pull in an engine or a heavy dependency use this so that importing the
package (or checking its config) stays cheap and works without that dependency installed.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """The module ``__getattr__`` for ``package``: ``exports`` maps each public name to the
    relative module (``".config"``) that defines it; any other name is an AttributeError."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module, package), name)

    return __getattr__
