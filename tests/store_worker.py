"""A store client in its own process (concurrency and fault tests).

    python store_worker.py MASTER WORKER_ID MODE N
Modes: ``mixed`` puts N keys of varied sizes (single and batch calls), reads them back and then
reads every other worker's keys; ``hang`` allocates one put, prints ``allocated`` and waits to
be killed before committing. Prints one JSON line of counts.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from helpers import pattern

from mooncake_connectors.store import ClientConfig, StoreClient
from mooncake_connectors.store.protocol import PutStart


def value(worker: int, i: int) -> bytes:
    size = [0, 1, 4096, 65537, 300_000][i % 5]
    return bytes(pattern(worker * 100_000 + i, size))


def main() -> None:
    master, wid, mode, n = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    c = StoreClient(ClientConfig(master=master, timeout=20)).start()
    out = {"put_errors": 0, "bad": 0, "ok": 0, "missing": 0}
    if mode == "hang":
        reply = c._master(PutStart(12345, ["dying-put"], [1 << 20]), c._deadline())
        print(json.dumps({"allocated": True, "reply": type(reply).__name__}), flush=True)
        time.sleep(3600)
    keys = [f"w{wid}-{i}" for i in range(n)]
    rng = random.Random(wid)
    i = 0
    while i < n:
        if rng.random() < 0.5:
            step = min(n - i, 8)
            errs = c.put_batch(keys[i : i + step], [value(wid, j) for j in range(i, i + step)])
            out["put_errors"] += sum(e is not None for e in errs)
        else:
            step = 1
            c.put(keys[i], value(wid, i), replicas=1 + i % 2)
        i += step
    for j, got in enumerate(c.get_batch(keys)):
        out["ok" if got == value(wid, j) else "bad"] += 1
    for other in range(3):
        if other == wid:
            continue
        end = time.monotonic() + 30
        for j in range(n):
            while True:
                got = c.get(f"w{other}-{j}")
                if got is not None or time.monotonic() > end:
                    break
                time.sleep(0.01)
            if got is None:
                out["missing"] += 1
            else:
                out["ok" if got == value(other, j) else "bad"] += 1
    c.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
