"""The tcp transport's compiled per-request loops (``_tcp_fast``, built from Cython at install
time when a C compiler is present), or None: then the transport runs its pure-Python loops,
which speak the same frames with the same deadlines and errors.

``MOONCAKE_CONNECTORS_PURE_PYTHON=1`` keeps the compiled loops off (for comparison, or to rule
them out when debugging); the tests run the tcp suites both ways.
"""

from __future__ import annotations

import logging
import os
from types import ModuleType

log = logging.getLogger(__name__)
PURE_ENV = "MOONCAKE_CONNECTORS_PURE_PYTHON"


def load() -> ModuleType | None:
    if os.environ.get(PURE_ENV, "") not in ("", "0"):
        return None
    try:
        from . import _tcp_fast
    except ImportError as exc:
        log.debug("compiled tcp loops not built (%s): pure Python", exc)
        return None
    return _tcp_fast


tcp = load()
