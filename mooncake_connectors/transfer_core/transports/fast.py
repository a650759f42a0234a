"""The tcp transport's compiled per-request loops (``_tcp_fast``, built from Cython at install
time when a C compiler is present), or None: then the transport runs its pure-Python loops,
which speak the same frames with the same deadlines and errors.

``MOONCAKE_CONNECTORS_PURE_PYTHON=1`` keeps the compiled loops off (for comparison, or to rule
them out when debugging); the tests run the tcp suites both ways.

``MOONCAKE_CONNECTORS_SPIN_US`` (default 50): how long a compiled wait for a peer polls
without sleeping before it sleeps in the kernel, in microseconds; 0 never spins. A thread that
sleeps on a socket costs a wake-up when the answer comes, and on a virtual machine that is tens
of microseconds, as long as a small request itself. The budget counts from the last progress, so
a stream that keeps arriving is read without sleeping; a peer that stays silent longer costs at
most the budget in CPU per wait. Set 0 where cores are oversubscribed.
"""

from __future__ import annotations

import logging
import os
from types import ModuleType

log = logging.getLogger(__name__)
PURE_ENV = "MOONCAKE_CONNECTORS_PURE_PYTHON"
SPIN_ENV = "MOONCAKE_CONNECTORS_SPIN_US"
DEFAULT_SPIN_US = 50
MAX_SPIN_US = 10_000


def spin_us() -> int:
    """The spin budget asked for by ``MOONCAKE_CONNECTORS_SPIN_US`` (a bad value is reported
    and the default used)."""
    text = os.environ.get(SPIN_ENV, "").strip()
    if not text:
        return DEFAULT_SPIN_US
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_SPIN_US:
        log.warning(
            "%s=%r is not a whole number of microseconds in 0..%d; using %d",
            SPIN_ENV,
            text,
            MAX_SPIN_US,
            DEFAULT_SPIN_US,
        )
        return DEFAULT_SPIN_US
    return value


def load() -> ModuleType | None:
    if os.environ.get(PURE_ENV, "") not in ("", "0"):
        return None
    try:
        from . import _tcp_fast
    except ImportError as exc:
        log.debug("compiled tcp loops not built (%s): pure Python", exc)
        return None
    _tcp_fast.set_spin(spin_us() * 1e-6)
    return _tcp_fast


tcp = load()
