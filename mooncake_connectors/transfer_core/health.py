"""Path health: a failing (peer, transport, lane) cools down with decaying exponential backoff."""

from __future__ import annotations

import threading
import time


class PathHealth:
    """Failures double a path's cool-down (up to ``maximum``); each success halves the count."""

    def __init__(self, initial: float, maximum: float) -> None:
        self.initial = initial
        self.maximum = maximum
        self._lock = threading.Lock()
        self._failures: dict[tuple[str, str, int], int] = {}
        self._until: dict[tuple[str, str, int], float] = {}

    def any_failing(self) -> bool:
        """False in the common case, letting the data path skip per-lane checks."""
        return bool(self._until)

    def any_recorded(self) -> bool:
        """False while no path has failed since it last recovered: ``succeeded`` has nothing
        to do then."""
        return bool(self._failures)

    def recorded_for(self, peer: str) -> bool:
        """Whether a path to ``peer`` has failed since it last recovered."""
        return any(k[0] == peer for k in list(self._failures))  # (list(): one atomic copy)

    def usable(self, key: tuple[str, str, int], now: float | None = None) -> bool:
        until = self._until.get(key)
        return until is None or (now if now is not None else time.monotonic()) >= until

    def ready_at(self, key: tuple[str, str, int]) -> float:
        return float(self._until.get(key, 0.0))

    def failed(self, key: tuple[str, str, int]) -> float:
        """Record a failure; return the cool-down applied (seconds)."""
        with self._lock:
            n = self._failures.get(key, 0) + 1
            self._failures[key] = n
            delay = min(self.maximum, self.initial * 2.0 ** (n - 1))
            self._until[key] = time.monotonic() + delay
            return delay

    def succeeded(self, key: tuple[str, str, int]) -> None:
        if key not in self._failures:  # fast path: healthy paths cost one dict lookup
            return
        with self._lock:
            n = self._failures.get(key, 0) // 2
            if n:
                self._failures[key] = n
            else:
                self._failures.pop(key, None)
                self._until.pop(key, None)
