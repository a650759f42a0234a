"""Transfer requests and the Batch that tracks them: what ``TransferEngine.submit`` returns.

A Batch counts each request's slices; the engine reports every slice's outcome into it, and the
caller waits on it with a deadline (never forever: without a timeout, until the batch's own
deadline plus a grace for the watchdog).
"""

from __future__ import annotations

import contextlib
import operator
import threading
import time
from collections.abc import Sequence
from typing import NamedTuple

from ..errors import ConfigError, MooncakeConnectorsError, TransferTimeout
from ..types import TransferOp, TransferStatus
from . import metrics


class TransferRequest(NamedTuple):
    """One one-sided transfer: READ copies remote → local, WRITE local → remote."""

    op: TransferOp
    target: str
    local_addr: int
    remote_addr: int
    length: int


def with_ops(requests: Sequence[TransferRequest]) -> Sequence[TransferRequest]:
    """``requests`` with every op a TransferOp (a plain 0/1 becomes READ/WRITE: the data path
    compares ops by identity); an op that names no operation stays, for ``_plan`` to refuse."""
    for r in requests:
        if type(r.op) is not TransferOp:
            break
    else:
        return requests
    out = list(requests)
    for i, r in enumerate(out):
        if type(r.op) is not TransferOp:
            with contextlib.suppress(ValueError, TypeError):
                out[i] = r._replace(op=TransferOp(r.op))
    return out


def check_request(req: TransferRequest) -> None:
    """Refuse (ConfigError) a request whose fields are not of the types the data path uses."""
    if not isinstance(req.target, str):
        raise ConfigError(f"target must be a segment name, got {type(req.target).__name__}")
    try:
        req.target.encode()
    except UnicodeEncodeError as exc:
        raise ConfigError(f"segment name {req.target!r} is not valid UTF-8: {exc.reason}") from None
    for name in ("local_addr", "remote_addr", "length"):
        value = getattr(req, name)
        try:
            operator.index(value)
        except TypeError:
            raise ConfigError(f"{name} must be an int, got {type(value).__name__}") from None


class Batch:
    """Requests submitted together; completion is waited on with a deadline."""

    def __init__(self, requests: Sequence[TransferRequest], deadline: float) -> None:
        self.requests = list(requests)
        self.deadline = deadline
        n = len(self.requests)
        self._status = [TransferStatus.PENDING] * n
        self._errors: list[MooncakeConnectorsError | None] = [None] * n
        self._left = [0] * n
        self._pending = n
        self._failed = 0  # requests finished with an error
        self._lock = threading.Lock()
        self._event: threading.Event | None = None  # made only if someone must block
        self._t0 = time.perf_counter()

    # -- engine side ------------------------------------------------------------------------
    def _finish(self, i: int, status: TransferStatus, err: MooncakeConnectorsError | None) -> None:
        # caller holds self._lock
        if self._status[i] is not TransferStatus.PENDING:
            return
        self._status[i] = status
        if err is not None:
            self._errors[i] = err
            self._failed += 1
        op = self.requests[i].op
        # ``_name_``, not ``name``: the enum property costs more than the rest of this method
        name = op._name_ if isinstance(op, TransferOp) else "INVALID"  # a request refused as such
        metrics.finished(name, status._name_, time.perf_counter() - self._t0)
        self._pending -= 1
        if self._pending == 0 and self._event is not None:
            self._event.set()

    def _slice_done(self, i: int, err: MooncakeConnectorsError | None) -> None:
        with self._lock:
            self._left[i] -= 1
            if err is not None:
                status = (
                    TransferStatus.TIMEOUT
                    if isinstance(err, TransferTimeout)
                    else TransferStatus.FAILED
                )
                self._finish(i, status, err)
            elif self._left[i] == 0:
                self._finish(i, TransferStatus.COMPLETED, None)

    def _fail(self, i: int, err: MooncakeConnectorsError) -> None:
        with self._lock:
            self._finish(i, TransferStatus.FAILED, err)

    # -- caller side ------------------------------------------------------------------------
    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every request finished or ``timeout`` passed; True when all finished.

        Without ``timeout`` this waits until the batch's own deadline (plus a small grace for the
        watchdog to fail what is still in flight) — never forever.
        """
        with self._lock:
            if self._pending == 0:
                return True
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        if timeout is None:
            timeout = max(0.0, self.deadline - time.monotonic()) + 1.0
        return event.wait(timeout)

    def done(self) -> bool:
        return self._pending == 0

    @property
    def statuses(self) -> list[TransferStatus]:
        with self._lock:
            return list(self._status)

    @property
    def errors(self) -> list[MooncakeConnectorsError | None]:
        with self._lock:
            return list(self._errors)

    def raise_for_status(self) -> None:
        """Raise the first request's error (TransferTimeout if any is still pending)."""
        if self._pending == 0 and self._failed == 0:  # the common case, without the lock
            return
        with self._lock:
            for i, st in enumerate(self._status):
                if st is TransferStatus.PENDING:
                    r = self.requests[i]
                    raise TransferTimeout("request still pending", peer=r.target, index=i)
            for err in self._errors:
                if err is not None:
                    raise err


__all__ = ["Batch", "TransferRequest"]
