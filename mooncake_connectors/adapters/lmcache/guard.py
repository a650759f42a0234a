"""Store calls for a host that must not wait on the store: threads, deadlines, a cool-down.

The store client's calls block. A host such as LMCache runs its storage I/O as coroutines on one
event loop, so a blocking call there would stall every other request. :class:`StoreGuard` runs
each call on its own small thread pool and gives the caller the answer, or :data:`FAILED`, within
the call's deadline:

- the client is created (connected) lazily on a pool thread, so a host starts even while the
  store is down, and picks the store up when it comes;
- a store-level failure (no master, a call past its deadline, a broken transport) opens a
  cool-down: for ``cooldown`` seconds calls answer FAILED at once without touching the store,
  then the next call probes it; per-key failures (one key unreadable, no room) do not;
- failures are logged at most once per :data:`LOG_INTERVAL` per kind, with a count of the rest;
- a call the caller stopped waiting for (deadline, cancellation) may still be running on a pool
  thread and using the caller's memory: ``unclaimed`` runs on its result when it ends, so the
  memory it holds is released exactly once, after the store is done with it.

Nothing here imports the host; the LMCache connector is one user.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import enum
import logging
import threading
import time
from collections.abc import Callable
from typing import Final, Generic, TypeVar

from ...errors import (
    MasterUnavailable,
    MooncakeConnectorsError,
    ProtocolError,
    TransferError,
)
from ...store.client import StoreClient

log = logging.getLogger(__name__)
T = TypeVar("T")
LOG_INTERVAL = 10.0
# Added to a call's deadline before the caller gives up on it: the client's own deadlines should
# end the call first, so this only matters when something inside overruns.
GRACE = 0.5
# Store errors that say the store (not one key) is unreachable.
_STORE_DOWN: tuple[type[BaseException], ...] = (
    MasterUnavailable,
    TransferError,
    ProtocolError,
    OSError,
    TimeoutError,
)


class Failed(enum.Enum):
    """The answer of a call that failed (already logged); test with ``is FAILED``."""

    FAILED = "FAILED"


FAILED: Final = Failed.FAILED


def _safely(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception:
        log.exception("a store call's clean-up failed")


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


class StoreGuard:
    def __init__(
        self,
        connect: Callable[[], StoreClient],
        *,
        timeout: float,
        cooldown: float,
        workers: int,
        name: str = "store",
    ) -> None:
        self._connect = connect
        self.timeout = timeout
        self.cooldown = cooldown
        self.name = name
        self.log = RateLimitedLog(log)
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix=name)
        self._lock = threading.Lock()
        self._client: StoreClient | None = None
        self._down_until = 0.0
        self._closed = False
        self.counters: dict[str, int] = {"calls": 0, "failed": 0, "skipped": 0, "timeouts": 0}

    # -- state ------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def down(self) -> bool:
        """True while the cool-down after a store failure lasts (or once closed)."""
        return self._closed or time.monotonic() < self._down_until

    def trip(self, op: str, exc: BaseException | str) -> None:
        """Record a store-level failure: answer FAILED without calling for ``cooldown`` s."""
        self._down_until = time.monotonic() + self.cooldown
        self.log.warn(
            "down",
            "%s: store unavailable during %s, answering misses for %.1f s: %s",
            self.name,
            op,
            self.cooldown,
            exc,
        )

    def client(self) -> StoreClient:
        """The connected client (connecting on first use); pool threads only."""
        with self._lock:
            if self._closed:
                raise MasterUnavailable("the connector is closed")
            if self._client is None:
                self._client = self._connect()
            return self._client

    def connect_soon(self) -> None:
        """Connect in the background, so the first call does not pay for it."""

        def connect() -> None:
            try:
                self.client()
            except Exception as exc:
                self.trip("connect", exc)

        with contextlib.suppress(RuntimeError):  # the pool is shut down: closed already
            self._pool.submit(connect)

    # -- calls ------------------------------------------------------------------------------
    def _call(self, op: str, fn: Callable[[StoreClient], T]) -> T:
        try:
            return fn(self.client())
        except _STORE_DOWN as exc:
            self.trip(op, exc)
            raise
        except MooncakeConnectorsError as exc:
            self.log.warn(op, "%s: %s failed: %s", self.name, op, exc)
            raise

    def _submit(
        self, op: str, fn: Callable[[StoreClient], T]
    ) -> concurrent.futures.Future[T] | None:
        if self.down():
            self.counters["skipped"] += 1
            return None
        self.counters["calls"] += 1
        try:
            return self._pool.submit(self._call, op, fn)
        except RuntimeError:  # pool shut down by close()
            return None

    def _failure(self, op: str, exc: BaseException) -> Failed:
        self.counters["failed"] += 1
        if not isinstance(exc, (*_STORE_DOWN, MooncakeConnectorsError)):
            # A bug (ours or the host's), not a store failure: loud, but not once per call.
            self.log.warn("bug:" + op, "%s: %s raised %r", self.name, op, exc, exc_info=exc)
        return FAILED

    async def run(
        self,
        op: str,
        fn: Callable[[StoreClient], T],
        unclaimed: Callable[[T], None] | None = None,
        ended: Callable[[], None] | None = None,
    ) -> T | Failed:
        """``fn(client)`` on a pool thread; its result, or FAILED (logged) within the deadline.

        If the caller stops waiting (deadline, cancellation) while ``fn`` still runs,
        ``unclaimed(result)`` runs when it ends. ``ended()`` runs once ``fn`` no longer runs:
        when it returns or raises, is cancelled before it starts, or was never started.
        Cancellation of the caller is re-raised.
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
        try:
            done, _ = await asyncio.wait({waiter}, timeout=self.timeout + GRACE)
        except asyncio.CancelledError:
            waiter.cancel()
            claim.leave(fut)
            raise
        if not done:
            waiter.cancel()
            claim.leave(fut)
            return self._overdue(op)
        if waiter.cancelled():  # dropped from the queue by close()
            self.counters["failed"] += 1
            return FAILED
        exc = waiter.exception()
        return waiter.result() if exc is None else self._failure(op, exc)

    def run_sync(self, op: str, fn: Callable[[StoreClient], T]) -> T | Failed:
        """Blocking variant for the host's synchronous calls (never on its event loop)."""
        fut = self._submit(op, fn)
        if fut is None:
            return FAILED
        done, _ = concurrent.futures.wait([fut], timeout=self.timeout + GRACE)
        if not done:
            fut.cancel()
            return self._overdue(op)
        if fut.cancelled():  # dropped from the queue by close()
            self.counters["failed"] += 1
            return FAILED
        exc = fut.exception()
        return fut.result() if exc is None else self._failure(op, exc)

    def _overdue(self, op: str) -> Failed:
        self.counters["timeouts"] += 1
        self.counters["failed"] += 1
        self.trip(op, f"no answer within {self.timeout + GRACE:.1f} s")
        return FAILED

    def close(self) -> None:
        """Stop taking calls, drop queued ones, close the client (running calls then fail)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            client, self._client = self._client, None
        self._pool.shutdown(wait=False, cancel_futures=True)
        if client is not None:
            try:
                client.close()
            except Exception as exc:
                log.warning("%s: closing the store client failed: %s", self.name, exc)
