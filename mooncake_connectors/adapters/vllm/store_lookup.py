"""The store connector's lookups off vLLM's scheduler loop (``lookup_async``).

vLLM 0.32's scheduler skips a waiting request for one step when ``get_num_new_matched_tokens``
answers ``None`` and asks again on the next; so the scheduler submits the ``batch_exists`` to one
lookup thread, answers ``None`` while it runs, and takes the answer on a later step. A lookup
that has not answered by its deadline counts as a miss: a store that hangs costs each request at
most that deadline in the waiting queue, and never a scheduler step.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable

PENDING = object()  # still running: answer None, ask again next step


class Lookups:
    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mc-store-lookup")
        # request id -> (started, first block looked up, the lookup)
        self._running: dict[str, tuple[float, int, concurrent.futures.Future[int]]] = {}

    def poll(self, rid: str, start: int, lookup: Callable[[], int]) -> int | object:
        """``lookup()``'s answer for ``rid`` from block ``start`` (held blocks), starting it on
        the first call; PENDING until it ends; 0 once it is past its deadline or failed."""
        entry = self._running.get(rid)
        if entry is not None and entry[1] != start:  # asked from another block: look again
            self.forget(rid)
            entry = None
        if entry is None:
            entry = (time.monotonic(), start, self._pool.submit(lookup))
            self._running[rid] = entry
        t0, _, fut = entry
        if not fut.done():
            if time.monotonic() - t0 < self.deadline:
                return PENDING
            self.forget(rid)  # one queued behind a hung lookup never runs
            return 0
        del self._running[rid]
        try:
            return fut.result()
        except Exception:  # _held_blocks maps store failures to 0 itself; anything else too
            return 0

    def forget(self, rid: str) -> None:
        entry = self._running.pop(rid, None)
        if entry is not None:
            entry[2].cancel()

    def in_flight(self) -> int:
        return len(self._running)

    def close(self) -> None:
        # never waits: a lookup still running ends by the store client's own deadline
        self._pool.shutdown(wait=False, cancel_futures=True)
