"""The store end to end: a master and store servers as processes, clients in and out of process.

Round trips from 0 bytes to several stripes, batches, zero-copy paths, replicas, concurrent
client processes, embedded mode, metrics and health, the benchmark command.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from helpers import free_port, pattern, wait_until
from store_cluster import CLI, client, cluster, start_master, start_server, wait_servers

from mooncake_connectors.errors import ObjectExists
from mooncake_connectors.store import StoreClient

STRIPE = 256 * 1024
WORKER = Path(__file__).parents[1] / "tests" / "store_worker.py"


@pytest.fixture(scope="module")
def store() -> Iterator[StoreClient]:
    with cluster(3, "64M", ("--stripe-size", "256K")) as (_, _, c, _):
        yield c


SIZES = [0, 1, 7, 4095, 4096, 65537, STRIPE, STRIPE + 1, 3 * STRIPE + 5, (2 << 20) + 3]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("replicas", [1, 2])
def test_round_trip(store: StoreClient, size: int, replicas: int) -> None:
    key = f"rt-{size}-{replicas}"
    data = pattern(size + replicas, size)
    store.put(key, data, replicas=replicas)
    assert store.get(key) == data.tobytes()
    buf = np.zeros(size + 64, dtype=np.uint8)
    store.register_buffer(buf)
    assert store.get_into(key, buf.ctypes.data + 3, size + 10) == size
    assert np.array_equal(buf[3 : 3 + size], data)
    store.unregister_buffer(buf.ctypes.data)
    with pytest.raises(ObjectExists):
        store.put(key, b"other")
    assert store.get(key) == data.tobytes()
    assert store.remove(key) and store.get(key) is None and not store.exists(key)


def test_striped_values_spread_over_servers(store: StoreClient) -> None:
    data = pattern(9, 5 * STRIPE)
    store.put("striped", data, replicas=2)
    loc = store._lookup(["striped"], store._deadline())[0]
    assert loc is not None and len(loc.stripes) == 5
    assert all(len({seg for seg, _ in copies}) == 2 for copies in loc.stripes)
    assert len({copies[0][0] for copies in loc.stripes}) >= 2
    assert store.get("striped") == data.tobytes()


def test_batches_and_zero_copy(store: StoreClient) -> None:
    keys = [f"b-{i}" for i in range(40)]
    vals = [pattern(i, [0, 100, 4096, 70_000][i % 4]) for i in range(40)]
    assert store.put_batch(keys, vals) == [None] * 40
    got = store.get_batch([*keys, "b-missing"])
    assert got[-1] is None
    assert all(g == v.tobytes() for g, v in zip(got, vals, strict=False))
    assert store.batch_exists(["b-0", "b-missing"]) == [True, False]
    errs = store.put_batch(["b-0", "b-new"], [b"x", b"y"])
    assert isinstance(errs[0], ObjectExists) and errs[1] is None
    # zero copy: from and into registered memory
    src = pattern(77, 32 * 70_000)
    dst = np.zeros_like(src)
    store.register_buffer(src)
    store.register_buffer(dst)
    zk = [f"z-{i}" for i in range(32)]
    addrs = [src.ctypes.data + i * 70_000 for i in range(32)]
    assert store.batch_put_from(zk, addrs, [70_000] * 32) == [None] * 32
    daddrs = [dst.ctypes.data + i * 70_000 for i in range(32)]
    out = store.batch_get_into([*zk, "z-missing"], [*daddrs, dst.ctypes.data], [70_000] * 33)
    assert out == [70_000] * 32 + [None]
    assert np.array_equal(src, dst)
    small = store.batch_get_into(["z-0"], [dst.ctypes.data], [10])
    assert "too small" in str(small[0])
    # unregistered memory works too, through staging
    plain = pattern(5, 5000)
    store.put_from("plain", plain.ctypes.data, plain.nbytes)
    into = np.zeros(5000, dtype=np.uint8)
    assert store.get_into("plain", into.ctypes.data, 5000) == 5000
    assert np.array_equal(plain, into)


def test_remove_all(store: StoreClient) -> None:
    store.put_batch([f"ra-{i}" for i in range(10)], [b"v"] * 10)
    assert store.remove_all() >= 10
    assert store.stats()["keys"] == 0
    assert store.get("ra-1") is None


def test_concurrent_client_processes(store: StoreClient) -> None:
    master = store.cfg.master
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), master, str(w), "mixed", "40"],
            stdout=subprocess.PIPE,
            text=True,
        )
        for w in range(3)
    ]
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0
        results.append(json.loads(out.strip().splitlines()[-1]))
    for r in results:
        assert r == {"put_errors": 0, "bad": 0, "ok": 120, "missing": 0}, results


def test_embedded_client_contributes_and_prefers_its_own_memory() -> None:
    m, addr = start_master()
    try:
        with client(addr, global_segment_size=16 << 20) as a, client(addr) as b:
            wait_servers(a, 1)
            data = pattern(4, 1 << 20)
            a.put("mine", data, preferred_segment=a.local_segment)
            loc = a._lookup(["mine"], a._deadline())[0]
            assert loc is not None and loc.stripes[0][0][0] == a.local_segment
            assert a._reader is not None and a._reader.rank(a.local_segment) == 0
            assert b.get("mine") == data.tobytes()  # another process reads it over shm
            b.put("theirs", b"t" * 100)  # the only segment is a's
            assert a.get("theirs") == b"t" * 100
    finally:
        m.close()


def test_metrics_and_health() -> None:
    port = free_port()
    m, addr = start_master("--metrics-port", str(port))
    s = start_server(addr, "16M")
    try:
        with client(addr) as c:
            wait_servers(c, 1)
            c.put("m", b"1")
            c.get("m")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            health = json.loads(r.read())
        assert health["status"] == "ok" and health["role"] == "leader"

        def scrape() -> str:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                return r.read().decode()

        # the exported values are a snapshot the master refreshes every tick (50 ms)
        wait_until(lambda: "mooncake_connectors_store_keys 1.0" in scrape(), 10, "the snapshot")
        text = scrape()
        assert "mooncake_connectors_store_keys" in text
        assert "mooncake_connectors_store_puts_total" in text
        assert "mooncake_connectors_store_capacity_bytes 1.6777216e+07" in text
    finally:
        s.close()
        m.close()


def test_bench_store_emits_json() -> None:
    out = subprocess.run(
        [
            *CLI,
            "bench",
            "store",
            "--rounds",
            "1",
            "--scale",
            "0.02",
            "--sizes",
            "4K,256K",
            "--batches",
            "8x4K",
            "--memory",
            "64M",
            "--no-mooncake",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    result = json.loads(out.stdout)
    assert result["benchmark"] == "store"
    assert result["results"]["get 4K"]["ours"]["ops_s"] > 0
    assert result["results"]["put_batch 8x4K"]["ours"]["gb_s"] > 0
    # ours runs twice in one window: defaults, and TCP only (data and control)
    assert result["results"]["get 4K"]["ours-tcp"]["ops_s"] > 0
    assert result["systems"] == {"ours": "shm,tcp", "ours-tcp": "tcp"}
    assert len(result["load_average"]) == 3


def test_large_values_go_direct_and_the_same_buffer_twice_is_fine(store: StoreClient) -> None:
    import threading

    big = pattern(31, 3 << 20)
    assert store.put_batch(["d1", "d2", "d3"], [big, big, big[1 << 20 :]]) == [None] * 3
    errors: list[object] = []

    def put(i: int) -> None:
        try:
            store.put(f"dt{i}", big)
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=put, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    regions = len(store.engine.local.regions()) if store.engine else 0
    got = store.get_batch(["d1", "d2", "d3", "dt0", "dt3"])
    assert got == [big.tobytes()] * 2 + [big[1 << 20 :].tobytes()] + [big.tobytes()] * 2
    assert store.engine is not None and len(store.engine.local.regions()) == regions


def test_values_read_straight_into_the_callers_objects(store: StoreClient) -> None:
    """``get_batch_as``: each value lands in the object the allocator made for its size (large
    values read into it directly, a batch with small ones through staging); misses are None."""
    import ctypes

    made: list[int] = []

    def alloc(size: int) -> tuple[bytearray, int]:
        made.append(size)
        buf = bytearray(size)
        return buf, ctypes.addressof(ctypes.c_char.from_buffer(buf)) if size else 0

    big, small = pattern(41, (1 << 20) + 9), pattern(43, 4099)
    keys = ["as-big", "as-big2", "as-small", "as-empty"]
    assert store.put_batch(keys, [big, big[9:], small, b""]) == [None] * 4
    assert store._direct  # a pure client on p2p metadata: large values go direct
    assert store.get_batch_as(["as-big", "nope", "as-big2"], alloc) == [
        bytearray(big.tobytes()),
        None,
        bytearray(big[9:].tobytes()),
    ]
    assert made == [big.nbytes, big.nbytes - 9]
    got = store.get_batch_as(["as-small", "as-big", "as-empty"], alloc)
    assert got == [bytearray(small.tobytes()), bytearray(big.tobytes()), bytearray()]
    assert all(type(v) is bytearray for v in got)
    assert store.get_batch_as([], alloc) == []


def test_ttl_and_pins_through_the_client(store: StoreClient) -> None:
    store.put("ttl", b"short-lived", ttl=0.3, soft_pin=True)
    assert store.get("ttl") == b"short-lived"
    wait_until(lambda: store.get("ttl") is None, 10, "the TTL to expire")
    store.put("pinned", b"p", hard_pin=True)
    assert store.remove("pinned", force=True) and not store.exists("pinned")
