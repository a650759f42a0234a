"""Store faults with real processes: a store server killed under a read workload, a client killed
mid-put, a full store, a master restarted, the SSD tier spilling and serving back."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import pattern, wait_until
from store_cluster import FAST, client, cluster, start_master, start_server, wait_servers

from mooncake_connectors.errors import CapacityExceeded
from mooncake_connectors.store.ssd import files_bytes

WORKER = Path(__file__).parents[1] / "tests" / "store_worker.py"
KiB = 1024


def test_killed_server_under_read_workload_loses_no_read_and_no_byte() -> None:
    with cluster(3, "32M", tuple(FAST)) as (addr, servers, c, _):
        data = {f"k{i}": pattern(i, [4096, 65537, 300_000][i % 3]).tobytes() for i in range(45)}
        assert c.put_batch(list(data), list(data.values()), replicas=2) == [None] * 45
        single = {f"s{i}": pattern(1000 + i, 5000).tobytes() for i in range(30)}
        for k, v in single.items():  # one call each: successive calls rotate over servers
            c.put(k, v)
        reads, failures, corrupt = [0], [], []
        stop = threading.Event()

        def reader(seed: int) -> None:
            rng = random.Random(seed)
            with client(addr) as rc:
                while not stop.is_set():
                    key = rng.choice(list(data))
                    got = rc.get(key)
                    if got is None:
                        failures.append(key)
                    elif got != data[key]:
                        corrupt.append(key)
                    reads[0] += 1

        threads = [threading.Thread(target=reader, args=(s,)) for s in range(3)]
        for t in threads:
            t.start()
        try:
            wait_until(lambda: reads[0] >= 150, 60, "reads before the kill")
            servers[0].kill()
            killed_at = reads[0]
            wait_until(lambda: c.stats()["servers"] == 2, 20, "the master to drop the server")
            wait_until(lambda: reads[0] >= killed_at + 300, 60, "reads after the kill")
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        assert not failures and not corrupt, (failures[:5], corrupt[:5])
        # Objects whose only copy was on the dead server are misses, answered at once.
        t0 = time.monotonic()
        got = c.get_batch(list(single))
        assert time.monotonic() - t0 < 2.0
        lost = [k for k, v in zip(single, got, strict=True) if v is None]
        assert lost and all(v == single[k] for k, v in zip(single, got, strict=True) if v)
        assert c.get_batch(list(data)) == list(data.values())


def test_client_killed_mid_put_leaves_nothing_visible_and_no_leak() -> None:
    with cluster(1, "16M", tuple(FAST)) as (addr, _, c, _):
        base = c.stats()["used_bytes"]
        p = subprocess.Popen(
            [sys.executable, str(WORKER), addr, "0", "hang", "1"], stdout=subprocess.PIPE, text=True
        )
        try:
            assert p.stdout is not None
            line = json.loads(p.stdout.readline())
            assert line == {"allocated": True, "reply": "Allocs"}
            st = c.stats()
            assert st["pending_puts"] == 1 and st["used_bytes"] >= base + (1 << 20)
            assert not c.exists("dying-put") and c.get("dying-put") is None
        finally:
            p.kill()
            p.wait(timeout=10)
        wait_until(
            lambda: c.stats()["pending_puts"] == 0 and c.stats()["used_bytes"] == base,
            15,
            "the dead client's allocation to be reclaimed",
        )
        assert not c.exists("dying-put")
        c.put("dying-put", b"fresh")
        assert c.get("dying-put") == b"fresh"


def test_full_store_is_a_clear_error_and_eviction_makes_room() -> None:
    with cluster(1, "4M", tuple(FAST)) as (_, _, c, _):
        v = pattern(3, 512 * KiB)
        pinned = 0
        with pytest.raises(CapacityExceeded, match="no room"):
            for i in range(20):
                c.put(f"pin{i}", v, hard_pin=True)
                pinned += 1
        assert 6 <= pinned <= 8
        assert c.remove_all() == pinned
        for i in range(24):  # 12 MiB through a 4 MiB store: eviction runs
            c.put(f"k{i}", v)
            if i == 20:
                assert c.get("k20") == v.tobytes()  # leased now: must survive what follows
        st = c.stats()
        assert st["evictions"] >= 16 and st["used_bytes"] <= st["capacity_bytes"]
        assert c.get("k0") is None  # least recently used went first
        assert c.get("k20") == v.tobytes() and c.get("k23") == v.tobytes()


def test_restarted_master_rebuilds_from_the_servers() -> None:
    m, addr = start_master(*FAST)
    port = int(addr.rsplit(":", 1)[1])
    servers = [start_server(addr, "16M") for _ in range(2)]
    try:
        with client(addr, timeout=20) as c:
            wait_servers(c, 2)
            data = {f"r{i}": pattern(i, 3000 + i).tobytes() for i in range(30)}
            for i, (k, v) in enumerate(data.items()):
                c.put(k, v, replicas=1 + i % 2)
            wait_until(lambda: c.stats()["holdings_unsent"] == 0, 10, "holdings to reach servers")
            m.kill()
            m, _ = start_master(*FAST, port=port)
            wait_servers(c, 2)
            assert c.get_batch(list(data)) == list(data.values())
            c.put("after", b"ok")
            assert c.get("after") == b"ok"
    finally:
        for s in servers:
            s.close()
        m.close()


def test_ssd_tier_spills_serves_back_and_keeps_its_budget(tmp_path: Path) -> None:
    # No promotion: an SSD hit would otherwise bring objects back into memory as room allows,
    # and which of them end up dropped would depend on timing (promotion has its own tests).
    m, addr = start_master(*FAST, "--promote-hits", "0")
    ssd = tmp_path / "ssd"
    s = start_server(addr, "2M", "--ssd-dir", str(ssd), "--ssd-size", "4M")
    try:
        with client(addr) as c:
            wait_servers(c, 1)
            vals = {f"d{i}": pattern(i, 256 * KiB).tobytes() for i in range(20)}
            for k, v in vals.items():  # 5 MiB into 2 MiB of memory + 4 MiB of SSD
                c.put(k, v)
            wait_until(lambda: c.stats()["spilling"] == 0, 10, "spills to finish")
            st = c.stats()
            assert st["spills"] >= 12 and 0 < st["ssd_used_bytes"] <= 4 << 20
            assert c.get_batch(list(vals)) == list(vals.values())  # every byte, some from SSD
            disk = files_bytes(ssd, "*.obj")
            assert 0 < disk <= 4 << 20
            more = {f"e{i}": pattern(100 + i, 256 * KiB).tobytes() for i in range(20)}

            def put(k: str) -> bool:
                try:
                    c.put(k, more[k])
                except CapacityExceeded:  # every object left in memory is leased by our reads
                    return False
                return True

            for k in more:
                wait_until(lambda k=k: put(k), 10, "the read leases to end")
            wait_until(lambda: c.stats()["spilling"] == 0, 10, "spills to finish")
            assert files_bytes(ssd, "*.obj") <= 4 << 20
            assert c.stats()["ssd_drops"] > 0
            assert c.get("d0") is None  # the least recently read file on SSD made room
            assert c.get("e19") == more["e19"]
    finally:
        s.close()
        m.close()


def test_a_full_ssd_makes_room_for_the_next_spill_instead_of_failing_it(tmp_path: Path) -> None:
    """Once the SSD is full each spill comes with a drop of the least recently read file: the
    server must get the drop first, or it refuses the write as over its budget and the spilled
    object is lost as well (9 of 32 spills failed so)."""
    m, addr = start_master(*FAST, "--promote-hits", "0")
    s = start_server(addr, "2M", "--ssd-dir", str(tmp_path / "ssd"), "--ssd-size", "4M")
    try:
        with client(addr) as c:
            wait_servers(c, 1)
            for i in range(40):  # 10 MiB through 2 MiB of memory and 4 MiB of SSD
                c.put(f"d{i}", pattern(i, 256 * KiB).tobytes())
                wait_until(lambda: c.stats()["spilling"] == 0, 10, "the spill to finish")
            st = c.stats()
            assert st["ssd_drops"] > 0 and st["spill_failures"] == 0, st
            assert c.get("d0") is None and c.get("d25") == pattern(25, 256 * KiB).tobytes()
    finally:
        s.close()
        m.close()


def test_a_batch_read_with_one_copy_on_a_dead_server_loses_only_that_copy() -> None:
    """One-copy values on two servers, one killed (the master not yet aware): a batch read
    gets the live server's values whole and a miss (or a typed error) for the dead one's."""
    import numpy as np

    from mooncake_connectors.errors import ReplicaUnavailable

    with cluster(2, "16M") as (_, servers, c, _):
        data = {f"k{i}": pattern(i, 4096 + 64 * i).tobytes() for i in range(12)}
        keys = list(data)
        for half in (keys[:6], keys[6:]):  # successive batches start on successive servers
            assert c.put_batch(half, [data[k] for k in half]) == [None] * 6
        locs = c._lookup(list(data), time.monotonic() + 5)
        segment = {k: loc.stripes[0][0][0] for k, loc in zip(data, locs, strict=True) if loc}
        assert len(segment) == len(data) and len(set(segment.values())) == 2
        servers[0].kill()
        got = c.get_batch(list(data))
        dead = {k for k, g in zip(data, got, strict=True) if g is None}
        assert dead and {segment[k] for k in dead} != set(segment.values())  # one server's
        assert dead == {k for k in data if segment[k] == segment[next(iter(dead))]}
        assert all(g == data[k] for k, g in zip(data, got, strict=True) if k not in dead)
        buf = np.zeros(len(data) * 8192, dtype=np.uint8)
        c.register_buffer(buf)
        addrs = [buf.ctypes.data + i * 8192 for i in range(len(data))]
        out = c.batch_get_into(list(data), addrs, [8192] * len(data))
        for i, ((k, v), o) in enumerate(zip(data.items(), out, strict=True)):
            if k in dead:
                assert isinstance(o, ReplicaUnavailable), (k, o)
            else:
                assert o == len(v) and buf[i * 8192 : i * 8192 + len(v)].tobytes() == v, k
