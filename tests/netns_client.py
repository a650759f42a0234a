"""A store client for the multi-host (network namespace) test, run inside its own namespace.

    python netns_client.py MASTER HOST MODE FIRST COUNT [SERVERS]

``put`` waits for SERVERS live store servers, then puts keys FIRST..FIRST+COUNT-1 (sizes cycle
over small, medium and striped) with two replicas; ``check`` reads them back, one by one and as
one batch. Prints one JSON line of counts. Every client call has the client's deadline.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from helpers import pattern

from mooncake_connectors.errors import MooncakeConnectorsError
from mooncake_connectors.store import ClientConfig, StoreClient

SIZES = [4096, 100_000, 600_000]  # the last is striped with --stripe-size 256K


def verdict(key: str, got: bytes | None) -> str:
    return "ok" if got == value(int(key[2:])) else "miss" if got is None else "wrong"


def value(i: int) -> bytes:
    return bytes(pattern(7000 + i, SIZES[i % len(SIZES)]))


def main() -> None:
    master, host, mode, first, count = sys.argv[1:6]
    keys = [f"nk{i}" for i in range(int(first), int(first) + int(count))]
    cfg = ClientConfig(master=master, host=host, timeout=30.0, rpc_timeout=5.0)
    out: dict[str, object] = {"mode": mode}
    with StoreClient(cfg) as c:
        if mode == "put":
            want = int(sys.argv[6])
            end = time.monotonic() + 60
            while c.stats()["servers"] < want:
                if time.monotonic() > end:
                    raise SystemExit(f"only {c.stats()['servers']} of {want} servers registered")
                time.sleep(0.1)
            failed = []
            for k in keys:
                try:
                    c.put(k, value(int(k[2:])), replicas=2)
                except MooncakeConnectorsError as exc:  # counted; the test asserts
                    failed.append(f"{k}: {exc}")
            out.update(ok=len(keys) - len(failed), failed=failed)
        else:
            t0 = time.monotonic()
            single = {"ok": 0, "miss": 0, "wrong": 0}
            for k in keys:
                single[verdict(k, c.get(k))] += 1
            batch = {"ok": 0, "miss": 0, "wrong": 0}
            for k, got in zip(keys, c.get_batch(keys), strict=True):
                batch[verdict(k, got)] += 1
            out.update(single=single, batch=batch, seconds=round(time.monotonic() - t0, 2))
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
