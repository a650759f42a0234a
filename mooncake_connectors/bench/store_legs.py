"""``mooncake-connectors bench store-legs``: where one small ``get`` of ours spends its time.

A get is two round trips: ``Get`` to the master (the value's location and a read lease), then a
READ of the bytes from the store server that holds them. Measured in one window, interleaved
round by round, each a loop of single calls on the same keys:
  * ``master_round_trip``: the ``Get`` alone (the client's lookup of one key);
  * ``data_round_trip``: one READ of the value's bytes through the client's transfer engine, to
    the address that lookup returned, into registered memory;
  * ``get``: the whole ``StoreClient.get`` (the two legs and the client's own work around them);
  * ``mooncake_get``: Mooncake's ``get`` of the same keys (when its wheel is installed).
µs per call, median of the rounds. ``client_work`` = get - both legs: what the client spends
outside the two round trips.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from ..errors import ConfigError
from ..transfer_core.engine import TransferRequest
from ..types import TransferOp
from .procs import loadavg, machine
from .store import OUR_VARIANTS, _Mooncake, _Ours
from .transfer import parse_size


def run_store_legs(
    size: str = "4K",
    calls: int = 2000,
    rounds: int = 5,
    variant: str = "ours-tcp",
    with_mooncake: bool = True,
) -> dict[str, Any]:
    import numpy as np

    if variant not in OUR_VARIANTS:
        raise ConfigError(f"unknown variant {variant!r} of ours; known: {sorted(OUR_VARIANTS)}")
    n = parse_size(size)
    notes: list[str] = []
    start_load = loadavg()
    ours = _Ours(max(64 << 20, 4 * n * calls), variant)
    mooncake: _Mooncake | None = None
    try:
        if with_mooncake:
            try:
                mooncake = _Mooncake(max(64 << 20, 4 * n * calls))
            except ImportError:
                notes.append("Mooncake wheel not installed: no mooncake_get")
        value = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
        keys = [f"legs-{i}" for i in range(calls)]
        for k in keys:
            ours.put(k, value)
            if mooncake is not None:
                mooncake.put(k, value)
        client = ours.c
        assert client.engine is not None
        engine = client.engine
        loc = client._lookup(keys[:1], time.monotonic() + 10)[0]
        if loc is None or len(loc.stripes) != 1:
            raise RuntimeError(f"expected one stripe for a {size} value, got {loc}")
        segment, remote = loc.stripes[0][0]
        dest = np.zeros(n, dtype=np.uint8)
        client.register_buffer(dest)
        read = [TransferRequest(TransferOp.READ, segment, int(dest.ctypes.data), remote, n)]

        def lookups() -> None:
            for k in keys:
                client._lookup([k], time.monotonic() + 10)

        def reads() -> None:
            for _ in keys:
                engine.transfer(read)

        def gets() -> None:
            for k in keys:
                if client.get(k) is None:
                    raise RuntimeError(f"ours: miss on {k}")

        cases: dict[str, Callable[[], None]] = {
            "master_round_trip": lookups,
            "data_round_trip": reads,
            "get": gets,
        }
        if mooncake is not None:
            mc = mooncake

            def mooncake_gets() -> None:
                for k in keys:
                    mc.get(k)

            cases["mooncake_get"] = mooncake_gets
        for fn in cases.values():  # warm-up: connections, mappings
            fn()
        samples: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(rounds):
            for name, fn in cases.items():
                t0 = time.perf_counter()
                fn()
                samples[name].append((time.perf_counter() - t0) / calls * 1e6)
    finally:
        ours.close()
        if mooncake is not None:
            mooncake.close()
    us = {name: round(statistics.median(v), 1) for name, v in samples.items()}
    us["client_work"] = round(us["get"] - us["master_round_trip"] - us["data_round_trip"], 1)
    return {
        "benchmark": "store-legs",
        "unit": "µs per call, median of rounds",
        "size": n,
        "calls": calls,
        "rounds": rounds,
        "variant": f"{variant} ({','.join(OUR_VARIANTS[variant])})",
        "machine": machine(),
        "results": us,
        "per_round": {name: [round(x, 1) for x in v] for name, v in samples.items()},
        "load_average": {"start": start_load, "end": loadavg()},
        "notes": notes,
    }
