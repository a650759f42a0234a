"""More scenarios over the real cuda-python and the FAKE libcuda (see scenario.py): completion
waits, host pinning off the data path, read-only and page-sharing host regions, VMM access for
every local device. One per run, one JSON line of facts out.

    python tests/fake_libcuda/scenario_more.py NAME
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import resource
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np
from helpers import pattern
from scenario import MIB, Pair, round_trips, sha

from fake_libcuda import counters, mem
from mooncake_connectors.errors import TransferTimeout
from mooncake_connectors.transfer_core import cuda_driver


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []
        logging.getLogger("mooncake_connectors").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING:
            self.seen.append(record.getMessage())


def waits() -> dict[str, Any]:
    """An event that answers NOT_READY 20 times is waited through without sleeping (the
    thread's voluntary context switches); one that never completes ends the wait at its
    deadline, directly and through a transfer, and leaves no thread behind."""
    out: dict[str, Any] = {}
    drv = cuda_driver.driver()
    stream, event = drv.stream_create(0), drv.event_create(0)
    os.environ["FAKE_CUDA_NOT_READY"] = "20"
    drv.event_record(event, stream)
    before_q, before = counters()["not_ready"], resource.getrusage(resource.RUSAGE_THREAD)
    done = cuda_driver.wait_event(drv, event, time.monotonic() + 30)
    after = resource.getrusage(resource.RUSAGE_THREAD)
    out["short"] = [done, counters()["not_ready"] - before_q, after.ru_nvcsw - before.ru_nvcsw]
    os.environ["FAKE_CUDA_NOT_READY"] = "-1"  # never completes
    drv.event_record(event, stream)
    start = time.monotonic()
    done = cuda_driver.wait_event(drv, event, start + 0.3)
    out["never"] = [done, time.monotonic() - start, threading.active_count()]
    del os.environ["FAKE_CUDA_NOT_READY"]
    drv.event_destroy(event)
    drv.stream_destroy(stream)
    p = Pair(("cuda_ipc",))
    try:
        remote = p.remote("real_cuda", MIB, seed=30)
        local = p.local_gpu(0, MIB)
        os.environ["FAKE_CUDA_NOT_READY"] = "-1"
        start = time.monotonic()
        try:
            p.engine.read(p.seg, local, remote, MIB, timeout=0.5)
            out["transfer"] = "completed"
        except TransferTimeout:
            out["transfer"] = "TransferTimeout"
        out["transfer_s"] = time.monotonic() - start
        del os.environ["FAKE_CUDA_NOT_READY"]
    finally:
        p.close()
    out["threads_after"] = [t.name for t in threading.enumerate() if t.name.startswith("mc-")]
    return out


SCENARIOS: dict[str, Callable[[], dict[str, Any]]] = {
    "waits": waits,
}


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    mem.init()
    try:
        result = SCENARIOS[sys.argv[1]]()
    except Exception as exc:
        result = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
