"""A store that is optional to its host: connected lazily, skipped for a cool-down after it fails.

Every engine adapter must keep its engine serving whether the store is up or not, and must never
wait on an absent master more than once per interval. :class:`GuardedStore` holds that policy
for one :class:`StoreClient`:

- it connects on a daemon thread of its own, retrying every ``cooldown`` seconds until it
  succeeds, so a host starts while the store is down and picks it up when it comes;
- a store-level failure (no master, a call past its deadline, a broken transport) opens a
  cool-down: for ``cooldown`` seconds the store counts as unavailable and calls answer at once
  without touching it, then the next call probes it; a per-key failure (one key unreadable, no
  room) does not;
- failures are logged at most once per ``log_interval`` per kind, with a count of the rest;
- :meth:`GuardedStore.call` runs one call on the caller's thread: its result, or :data:`FAILED`;
  :meth:`~GuardedStore.run` and :meth:`~GuardedStore.run_sync` do the same on worker threads with
  a deadline, for a host (LMCache's event loop) that must not block at all.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import logging
import threading
import time
from collections.abc import Callable
from typing import Final, Generic, TypeVar

from ..errors import MasterUnavailable, MooncakeConnectorsError, ProtocolError, TransferError
from .client import StoreClient
from .config import ClientConfig

log = logging.getLogger(__name__)
T = TypeVar("T")
LOG_INTERVAL = 10.0
# Added to a call's deadline before the caller gives up on it: the client's own deadlines should
# end the call first, so this only matters when something inside overruns.
GRACE = 0.5
# Retrying a connect sooner than this gains nothing and would spin with ``cooldown`` 0.
_MIN_RETRY = 0.2
# Errors that say the store (not one key) is unreachable: they open the cool-down.
STORE_DOWN: tuple[type[BaseException], ...] = (
    MasterUnavailable,
    TransferError,
    ProtocolError,
    OSError,
    TimeoutError,
)


# A failed store call, never a bug, whichever ``down_errors`` a host picks.
_ALWAYS: tuple[type[BaseException], ...] = (MooncakeConnectorsError, OSError)


class Failed(enum.Enum):
    """The answer of a call that did not happen or failed (already logged): ``is FAILED``."""

    FAILED = "FAILED"


FAILED: Final = Failed.FAILED


class RateLimitedLog:
    """``warn(kind, ...)`` logs at most once per ``interval`` per kind, counting the rest."""

    def __init__(self, logger: logging.Logger, interval: float = LOG_INTERVAL) -> None:
        self.logger = logger
        self.interval = interval
        self._last: dict[str, float] = {}
        self._quiet: dict[str, int] = {}
        self._lock = threading.Lock()

    def warn(
        self, kind: str, msg: str, *args: object, exc_info: BaseException | None = None
    ) -> bool:
        now = time.monotonic()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self.interval:
                self._quiet[kind] = self._quiet.get(kind, 0) + 1
                return False
            self._last[kind] = now
            quiet = self._quiet.pop(kind, 0)
        if quiet:
            msg += " (%d more like this in the last %.0f s)"
            args = (*args, quiet, self.interval)
        self.logger.warning(msg, *args, exc_info=exc_info)
        return True


def _safely(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception:
        log.exception("a store call's clean-up failed")


class _Claim(Generic[T]):
    """Who gets a call's result: the waiting caller, or ``unclaimed`` once the caller left."""

    def __init__(self, unclaimed: Callable[[T], None] | None) -> None:
        self.unclaimed = unclaimed
        self.lock = threading.Lock()
        self.left = False
        self.done_with = False

    def on_done(self, fut: concurrent.futures.Future[T]) -> None:
        with self.lock:
            if not self.left or self.done_with:
                return
            self.done_with = True
        self._release(fut)

    def leave(self, fut: concurrent.futures.Future[T]) -> None:
        """The caller stops waiting; release the result now if the call already ended."""
        with self.lock:
            self.left = True
            if not fut.done() or self.done_with:
                return
            self.done_with = True
        self._release(fut)

    def _release(self, fut: concurrent.futures.Future[T]) -> None:
        if self.unclaimed is None or fut.cancelled() or fut.exception() is not None:
            return
        try:
            self.unclaimed(fut.result())
        except Exception:
            log.exception("releasing the result of an abandoned store call failed")


class GuardedStore:
    """One optional store client; see the module docstring.

    config: the client's settings, built once; every call of the client ends by its
    ``timeout``. on_connect: runs on the new client before any call sees it (registering the
    host's memory); if it raises, the attempt failed. down_errors: the exceptions that open the
    cool-down. workers: threads for :meth:`run` / :meth:`run_sync` (0: those are not used).
    """

    def __init__(
        self,
        config: ClientConfig,
        *,
        cooldown: float,
        name: str = "store",
        on_connect: Callable[[StoreClient], None] | None = None,
        log_interval: float = LOG_INTERVAL,
        down_errors: tuple[type[BaseException], ...] = STORE_DOWN,
        workers: int = 0,
    ) -> None:
        self.config = config
        self.cooldown = cooldown
        self.name = name
        self.on_connect = on_connect
        self.down_errors = down_errors
        self._store_errors: tuple[type[BaseException], ...] = (*down_errors, *_ALWAYS)
        self.log = RateLimitedLog(log, log_interval)
        self.counters = dict.fromkeys(("calls", "failed", "skipped", "timeouts", "connects"), 0)
        self._client: StoreClient | None = None
        self._down_until = 0.0
        self._closed = False
        self._connecting = True
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._pool = (
            concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix=name)
            if workers
            else None
        )
        self._thread = threading.Thread(
            target=self._connect_loop, name=f"{name}-connect", daemon=True
        )
        self._thread.start()

    # -- connecting -------------------------------------------------------------------------
    def _connect_loop(self) -> None:
        while not self._stop.is_set():
            if self._connect_once():
                return
            self._stop.wait(max(self.cooldown, _MIN_RETRY))

    def _connect_once(self) -> bool:
        with self._cond:
            self._connecting = True
        client = StoreClient(self.config)
        try:
            client.start()
            if self.on_connect is not None:
                self.on_connect(client)
        except (MooncakeConnectorsError, OSError) as exc:
            client.close()
            self.trip("connect", exc)
            with self._cond:
                self._connecting = False
                self._cond.notify_all()
            return False
        with self._cond:
            self._connecting = False
            self._cond.notify_all()
            if self._closed:
                client.close()
                return True
            self._client = client
            self.counters["connects"] += 1
        log.info("%s: connected to the store master %s", self.name, self.config.master)
        return True

    @property
    def connected(self) -> bool:
        return self._client is not None

    def wait_connected(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` s) until connected; whether it is."""
        with self._cond:
            self._cond.wait_for(lambda: self._client is not None or self._closed, timeout)
        return self.connected

    def settle(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` s) for the connect attempt under way; whether connected."""
        with self._cond:
            self._cond.wait_for(
                lambda: self._client is not None or self._closed or not self._connecting, timeout
            )
        return self.connected

    # -- availability -----------------------------------------------------------------------
    def down(self) -> bool:
        """True during the cool-down after a store failure (and once closed)."""
        return self._closed or time.monotonic() < self._down_until

    def trip(self, op: str, exc: BaseException | str) -> None:
        """A store-level failure: the store counts as unavailable for ``cooldown`` s."""
        self._down_until = time.monotonic() + self.cooldown
        self.log.warn(
            "down",
            "%s: store %s unavailable during %s, skipped for %.1f s: %s",
            self.name,
            self.config.master,
            op,
            self.cooldown,
            exc,
        )

    def ready(self, wait: float = 0.0) -> StoreClient | None:
        """The client to call now, or None: closed, cooling down, or not connected (after
        waiting up to ``wait`` s for a connect attempt under way)."""
        if self.down():
            return None
        if self._client is None and wait > 0:
            self.settle(wait)
        return None if self.down() else self._client

    def client(self) -> StoreClient:
        """The client even during a cool-down, for tools; MasterUnavailable when there is none."""
        self.settle(self.config.timeout)
        client = self._client
        if client is None:
            raise MasterUnavailable(f"{self.name}: not connected to the store")
        return client

    # -- calls ------------------------------------------------------------------------------
    def _invoke(self, op: str, fn: Callable[[StoreClient], T], wait: float) -> T:
        client = self.ready(wait)
        if client is None:
            raise MasterUnavailable(f"{self.name}: not connected to the store")
        try:
            return fn(client)
        except self.down_errors as exc:
            self.trip(op, exc)
            raise
        except _ALWAYS as exc:
            self.log.warn(op, "%s: %s failed: %s", self.name, op, exc)
            raise

    def call(self, op: str, fn: Callable[[StoreClient], T]) -> T | Failed:
        """``fn(client)`` on this thread: its result, or FAILED at once while the store is
        unavailable, or FAILED (logged) when it raises a store error. Other errors propagate."""
        if self.down() or self._client is None:
            self.counters["skipped"] += 1
            return FAILED
        self.counters["calls"] += 1
        try:
            return self._invoke(op, fn, 0.0)
        except self._store_errors:
            self.counters["failed"] += 1
            return FAILED

    def _submit(
        self, op: str, fn: Callable[[StoreClient], T]
    ) -> concurrent.futures.Future[T] | None:
        if self._pool is None:
            raise RuntimeError(f"{self.name}: built without worker threads")
        if self.down():
            self.counters["skipped"] += 1
            return None
        self.counters["calls"] += 1
        try:
            # A call that finds a connect under way waits for it within its own deadline.
            return self._pool.submit(self._invoke, op, fn, self.config.timeout)
        except RuntimeError:  # the pool is shut down: closed already
            return None

    def _failure(self, op: str, exc: BaseException) -> Failed:
        self.counters["failed"] += 1
        if not isinstance(exc, self._store_errors):
            # A bug (ours or the host's), not a store failure: loud, but not once per call.
            self.log.warn("bug:" + op, "%s: %s raised %r", self.name, op, exc, exc_info=exc)
        return FAILED

    def _outcome(
        self, op: str, fut: asyncio.Future[T] | concurrent.futures.Future[T]
    ) -> T | Failed:
        """A finished call's result, or FAILED (counted, and logged by ``_failure``)."""
        if fut.cancelled():  # dropped from the queue by close()
            self.counters["failed"] += 1
            return FAILED
        exc = fut.exception()
        return fut.result() if exc is None else self._failure(op, exc)

    def _overdue(self, op: str, waited: float) -> Failed:
        self.counters["timeouts"] += 1
        self.counters["failed"] += 1
        self.trip(op, f"no answer within {waited:.1f} s")
        return FAILED

    async def run(
        self,
        op: str,
        fn: Callable[[StoreClient], T],
        unclaimed: Callable[[T], None] | None = None,
        ended: Callable[[], None] | None = None,
    ) -> T | Failed:
        """``fn(client)`` on a worker thread: its result, or FAILED (logged) within the deadline.

        If the caller stops waiting (deadline, cancellation) while ``fn`` still runs,
        ``unclaimed(result)`` runs when it ends, so memory the result holds is released once,
        after the store is done with it. ``ended()`` runs once ``fn`` no longer runs: when it
        returns or raises, is cancelled before it starts, or was never started. Cancellation of
        the caller is re-raised.
        """
        fut = self._submit(op, fn)
        if fut is None:
            if ended is not None:
                ended()
            return FAILED
        if ended is not None:
            fut.add_done_callback(lambda _: _safely(ended))
        claim: _Claim[T] = _Claim(unclaimed)
        fut.add_done_callback(claim.on_done)
        waiter = asyncio.wrap_future(fut)
        waited = self.config.timeout + GRACE
        try:
            done, _ = await asyncio.wait({waiter}, timeout=waited)
        except asyncio.CancelledError:
            waiter.cancel()
            claim.leave(fut)
            raise
        if not done:
            waiter.cancel()
            claim.leave(fut)
            return self._overdue(op, waited)
        return self._outcome(op, waiter)

    def run_sync(self, op: str, fn: Callable[[StoreClient], T]) -> T | Failed:
        """``fn(client)`` on a worker thread, for a host's synchronous calls: its result, or
        FAILED (logged) within the call's deadline."""
        fut = self._submit(op, fn)
        if fut is None:
            return FAILED
        waited = self.config.timeout + GRACE
        done, _ = concurrent.futures.wait([fut], timeout=waited)
        if not done:
            fut.cancel()
            return self._overdue(op, waited)
        return self._outcome(op, fut)

    def close(self, wait: float | None = None) -> None:
        """Stop connecting and taking calls, drop queued calls, close the client (calls still
        running then fail). Waits at most ``wait`` s (default: the client's deadline) for a
        connect attempt under way."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            client, self._client = self._client, None
            self._cond.notify_all()
        self._stop.set()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if client is not None:
            try:
                client.close()
            except Exception as exc:
                log.warning("%s: closing the store client failed: %s", self.name, exc)
        if self._thread is not threading.current_thread():
            self._thread.join(self.config.timeout + 1.0 if wait is None else wait)
