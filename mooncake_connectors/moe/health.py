"""Which EP ranks are alive: heartbeats through the metadata layer, or the engine's own word.

Each rank publishes a heartbeat under ``mooncake/moe/<group>/heartbeat/<rank>`` whose value is
JSON ``{"rank": r, "ts": <wall-clock seconds>, "seq": <n>}``. A monitor lists the prefix and
calls a rank alive while its newest heartbeat is younger than ``timeout``. The store is anything
with the four methods of :class:`MetadataStore` — the project's ``memory``, ``http`` and ``etcd``
metadata backends implement exactly those.

The engine can also set liveness directly (it often knows first: a collective timed out, a
process exited). Engine verdicts override heartbeats per rank until cleared, so a wedged rank
that still heartbeats can be fenced off.

Clocks are injectable (``clock=``) so tests advance time instead of sleeping. Heartbeats carry the
publisher's wall clock, so hosts need roughly synchronised clocks (NTP); a timestamp from the
future counts as fresh.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch

from ..errors import ConfigError
from .placement import as_alive, check_positive

log = logging.getLogger(__name__)

KEY_ROOT = "mooncake/moe"


@runtime_checkable
class MetadataStore(Protocol):
    """The slice of the metadata layer the heartbeat path needs."""

    def put(self, key: str, value: bytes) -> None: ...

    def get(self, key: str) -> bytes | None: ...

    def list(self, prefix: str) -> dict[str, bytes]: ...

    def delete(self, key: str) -> bool: ...


def heartbeat_prefix(group: str) -> str:
    """Key prefix under which the ranks of ``group`` publish heartbeats."""
    _check_group(group)
    return f"{KEY_ROOT}/{group}/heartbeat/"


def heartbeat_key(group: str, rank: int) -> str:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ConfigError(f"rank must be a non-negative integer, got {rank!r}")
    return f"{heartbeat_prefix(group)}{rank}"


class HeartbeatPublisher:
    """Publishes one rank's heartbeat; call :meth:`beat` from the engine's loop or a timer.

    store: a :class:`MetadataStore`.
    group: name of the EP group (one per model deployment), ``[A-Za-z0-9_.-]+``.
    rank: this process's EP rank.
    clock: wall-clock source in seconds (``time.time`` by default).
    """

    def __init__(
        self,
        store: MetadataStore,
        group: str,
        rank: int,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._key = heartbeat_key(group, rank)
        self._rank = rank
        self._clock = clock
        self._seq = 0

    @property
    def key(self) -> str:
        return self._key

    def beat(self) -> None:
        self._seq += 1
        value = {"rank": self._rank, "ts": float(self._clock()), "seq": self._seq}
        self._store.put(self._key, json.dumps(value).encode())

    def leave(self) -> bool:
        """Withdraw the heartbeat (clean shutdown): monitors see the rank gone at once."""
        return self._store.delete(self._key)


class HealthMonitor:
    """The live-rank mask of one EP group.

    num_ranks: ``R``.
    store / group: where heartbeats are read; without a store, liveness comes only from the
        engine (:meth:`set_alive`, :meth:`mark_dead`) and ranks start alive.
    timeout: seconds after which a heartbeat is stale.
    clock: wall-clock source, comparable with the publishers' clocks.

    Listeners registered with :meth:`subscribe` are called with the new mask whenever it
    changes (from :meth:`poll` or from an engine verdict) — hook the router's ``set_health``
    there.
    """

    def __init__(
        self,
        num_ranks: int,
        *,
        store: MetadataStore | None = None,
        group: str = "default",
        timeout: float = 10.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        check_positive(num_ranks, "num_ranks")
        if not (isinstance(timeout, int | float) and math.isfinite(timeout) and timeout > 0):
            raise ConfigError(f"timeout must be a finite number > 0, got {timeout!r}")
        self.num_ranks = num_ranks
        self._store = store
        self._prefix = heartbeat_prefix(group)
        self._timeout = float(timeout)
        self._clock = clock
        self._overrides: dict[int, bool] = {}
        self._heartbeat_alive = [store is None] * num_ranks
        self._listeners: list[Callable[[torch.Tensor], None]] = []
        self._mask = self._compose()

    @property
    def alive(self) -> torch.Tensor:
        """``[R]`` bool mask as of the last poll / verdict (a copy)."""
        return self._mask.clone()

    def subscribe(self, listener: Callable[[torch.Tensor], None]) -> Callable[[], None]:
        """Call ``listener(mask)`` on every change; returns a function that unsubscribes."""
        self._listeners.append(listener)

        def unsubscribe() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return unsubscribe

    def poll(self) -> torch.Tensor:
        """Read the heartbeats once and return the mask (no-op read without a store)."""
        if self._store is not None:
            now = float(self._clock())
            fresh = [False] * self.num_ranks
            for key, raw in self._store.list(self._prefix).items():
                rank, ts = self._parse(key, raw)
                if rank is not None and now - ts < self._timeout:
                    fresh[rank] = True
            self._heartbeat_alive = fresh
        self._update()
        return self.alive

    def set_alive(self, alive: torch.Tensor | Sequence[bool]) -> None:
        """The engine sets the whole mask; it overrides heartbeats for every rank."""
        mask = torch.as_tensor(alive) if not isinstance(alive, torch.Tensor) else alive
        values = as_alive(mask, self.num_ranks).tolist()
        self._overrides = dict(enumerate(values))
        self._update()

    def mark_dead(self, rank: int) -> None:
        self._override(rank, False)

    def mark_alive(self, rank: int) -> None:
        self._override(rank, True)

    def clear_override(self, rank: int | None = None) -> None:
        """Hand ``rank`` (or every rank) back to the heartbeats."""
        if rank is None:
            self._overrides.clear()
        else:
            self._check_rank(rank)
            self._overrides.pop(rank, None)
        self._update()

    # ------------------------------------------------------------ internals

    def _override(self, rank: int, value: bool) -> None:
        self._check_rank(rank)
        self._overrides[rank] = value
        self._update()

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.num_ranks:
            raise ConfigError(f"rank must be an integer in [0, {self.num_ranks}), got {rank!r}")

    def _compose(self) -> torch.Tensor:
        values = [self._overrides.get(r, self._heartbeat_alive[r]) for r in range(self.num_ranks)]
        return torch.tensor(values, dtype=torch.bool)

    def _update(self) -> None:
        mask = self._compose()
        if torch.equal(mask, self._mask):
            return
        self._mask = mask
        for listener in list(self._listeners):
            listener(mask.clone())

    def _parse(self, key: str, raw: bytes) -> tuple[int | None, float]:
        # One rank's garbage must not blind the monitor to the others: log it, count it dead.
        suffix = key[len(self._prefix) :] if key.startswith(self._prefix) else ""
        if not (suffix.isascii() and suffix.isdigit()):
            log.warning("ignoring unexpected heartbeat key %r", key)
            return None, 0.0
        rank = int(suffix)
        if rank >= self.num_ranks:
            log.debug("heartbeat from rank %d outside [0, %d) ignored", rank, self.num_ranks)
            return None, 0.0
        try:
            value = json.loads(raw)
            ts = float(value["ts"])
            if int(value["rank"]) != rank or not math.isfinite(ts):
                raise ValueError("rank mismatch or non-finite timestamp")
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("malformed heartbeat under %r: %s", key, exc)
            return None, 0.0
        return rank, ts


def _check_group(group: str) -> None:
    if not isinstance(group, str) or not group or not all(c.isalnum() or c in "_.-" for c in group):
        raise ConfigError(f"group must match [A-Za-z0-9_.-]+, got {group!r}")
