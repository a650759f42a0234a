"""The SSD tier with real processes: striped and unstriped objects spilled past the memory
watermark, every one served back byte-identical through every get form, promotion back into
memory, the SSD budget watched on disk throughout, a server killed with objects on its SSD (and
spills in flight), and damaged files: always a clear miss, never wrong bytes."""

from __future__ import annotations

import contextlib
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from helpers import free_port, pattern, wait_until
from store_cluster import FAST, Proc, client, start_master, start_server, wait_servers

from mooncake_connectors.errors import MooncakeConnectorsError
from mooncake_connectors.store import StoreClient
from mooncake_connectors.store.ssd import files_bytes

KiB = 1024
MiB = 1 << 20
SSD = 6 * MiB  # per server
STRIPED = 600 * KiB  # 3 stripes of 200 KiB with --stripe-size 256K
SMALL = 100 * KiB


class DiskWatch:
    """Samples the bytes under each SSD directory (temporary files included) until stopped."""

    def __init__(self, dirs: list[Path]) -> None:
        self.dirs = dirs
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            for d in self.dirs:
                self.peak = max(self.peak, files_bytes(d))
            self.samples += 1

    def stop(self) -> int:
        self._stop.set()
        self._t.join(timeout=5)
        return self.peak


@pytest.fixture
def tiered(tmp_path: Path) -> Iterator[tuple[StoreClient, list[Proc], list[Path], int]]:
    """A master (256 KiB stripes, metrics on) and two servers of 4 MiB memory + 6 MiB SSD."""
    port = free_port()
    procs: list[Proc] = []
    c: StoreClient | None = None
    try:
        m, addr = start_master(*FAST, "--stripe-size", "256K", "--metrics-port", str(port))
        procs.append(m)
        dirs = [tmp_path / f"ssd{i}" for i in range(2)]
        for d in dirs:
            procs.append(start_server(addr, "4M", "--ssd-dir", str(d), "--ssd-size", str(SSD)))
        c = client(addr, timeout=30.0)
        wait_servers(c, 2)
        yield c, procs, dirs, port
    finally:
        if c is not None:
            c.close()
        for p in procs:
            p.close()


def fill(c: StoreClient) -> dict[str, bytes]:
    """~12.8 MiB (striped, some with two replicas, and unstriped) into 8 MiB of memory."""
    vals: dict[str, bytes] = {}
    for i in range(16):
        vals[f"big{i}"] = pattern(i, STRIPED + i).tobytes()
        c.put(f"big{i}", vals[f"big{i}"], replicas=2 if i % 4 == 0 else 1)
        vals[f"small{i}"] = pattern(100 + i, SMALL).tobytes()
        c.put(f"small{i}", vals[f"small{i}"])
        vals[f"small{i}b"] = pattern(200 + i, SMALL - 7).tobytes()
        c.put(f"small{i}b", vals[f"small{i}b"])
    wait_until(lambda: c.stats()["spilling"] == 0, 30, "spills to finish")
    return vals


def test_spilled_objects_are_served_back_and_promoted_within_the_budget(
    tiered: tuple[StoreClient, list[Proc], list[Path], int],
) -> None:
    c, _, dirs, port = tiered
    watch = DiskWatch(dirs)
    try:
        vals = fill(c)
        st = c.stats()
        assert st["spills"] >= 10, st
        assert 0 < st["ssd_used_bytes"] <= 2 * SSD
        assert st["ssd_drops"] == 0  # it all fits: nothing may be lost
        # every form of get, every byte
        for k, v in vals.items():
            assert c.get(k) == v, k
        keys = list(vals)
        assert c.get_batch(keys) == [vals[k] for k in keys]
        buf = np.zeros(len(keys) * (STRIPED + 64), np.uint8)
        c.register_buffer(buf)
        base = buf.ctypes.data
        addrs = [base + i * (STRIPED + 64) for i in range(len(keys))]
        sizes = [STRIPED + 64] * len(keys)
        got = c.batch_get_into(keys, addrs, sizes)
        for i, k in enumerate(keys):
            assert got[i] == len(vals[k]), (k, got[i])
            off = i * (STRIPED + 64)
            assert buf[off : off + len(vals[k])].tobytes() == vals[k], k
        one = np.zeros(STRIPED + 64, np.uint8)  # unregistered: read through staging
        for k in keys[::5]:
            assert c.get_into(k, one.ctypes.data, one.nbytes) == len(vals[k])
            assert one[: len(vals[k])].tobytes() == vals[k]
        st = c.stats()
        assert st["ssd_hits"] > 0, st
        # Make room, then read what is on SSD: it comes back into memory.
        for i in range(16):
            assert c.remove(f"small{i}")
        hits0 = st["ssd_hits"]
        promoted0 = st["promotions"]

        def promoted() -> bool:
            c.get_batch(keys[:16])
            return c.stats()["promotions"] > promoted0

        wait_until(promoted, 30, "a promotion")
        for k in keys:
            if not k.startswith("small") or k.endswith("b"):
                assert c.get(k) == vals[k], k
        wait_until(lambda: c.stats()["promoting"] == 0, 10, "promotions to finish")
        st = c.stats()
        assert st["ssd_hits"] > hits0

        def scrape() -> str:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                return r.read().decode()

        wait_until(lambda: "promotions_total" in scrape(), 10, "the metrics snapshot")
        text = scrape()
        for name in ("spills_total", "ssd_hits_total", "promotions_total", "ssd_used_bytes"):
            assert f"mooncake_connectors_store_{name}" in text, name
    finally:
        peak = watch.stop()
    assert watch.samples > 10
    assert peak <= SSD, f"an SSD directory held {peak} bytes, budget {SSD}"


def test_a_full_ssd_drops_least_recently_read_objects_and_stays_in_budget(
    tiered: tuple[StoreClient, list[Proc], list[Path], int],
) -> None:
    c, _, dirs, _ = tiered
    watch = DiskWatch(dirs)
    try:
        vals = {}
        for i in range(40):  # 24 MiB into 8 MiB of memory + 12 MiB of SSD
            vals[f"v{i}"] = pattern(i, STRIPED).tobytes()
            c.put(f"v{i}", vals[f"v{i}"])
        wait_until(lambda: c.stats()["spilling"] == 0, 30, "spills to finish")
        assert c.stats()["ssd_drops"] > 0
        got = c.get_batch(list(vals))
        for k, g in zip(vals, got, strict=True):
            assert g is None or g == vals[k], k  # a miss, never wrong bytes
        assert got[-1] == vals["v39"]  # the newest are there
        assert got[0] is None  # the oldest made room
    finally:
        peak = watch.stop()
    assert peak <= SSD, f"an SSD directory held {peak} bytes, budget {SSD}"


def test_killed_server_with_objects_on_ssd_and_spills_in_flight_reads_as_misses(
    tiered: tuple[StoreClient, list[Proc], list[Path], int],
) -> None:
    c, procs, _, _ = tiered
    vals = fill(c)
    extra = {f"late{i}": pattern(500 + i, STRIPED).tobytes() for i in range(6)}
    done = threading.Event()

    def more() -> None:  # keeps spills in flight while the server dies
        try:
            for k, v in extra.items():
                with contextlib.suppress(MooncakeConnectorsError):  # its server may be dying
                    c.put(k, v)
        finally:
            done.set()

    t = threading.Thread(target=more, daemon=True)
    t.start()
    # kill it while spills are being written (or, on a fast machine, right after the puts)
    wait_until(lambda: c.stats()["spilling"] > 0 or done.is_set(), 60, "a spill in flight")
    procs[2].kill()  # the second store server, SIGKILL
    wait_until(done.is_set, 60, "the puts to end")
    t.join(timeout=5)
    wait_until(lambda: c.stats()["servers"] == 1, 30, "the server to be declared dead")
    wait_until(lambda: c.stats()["spilling"] == 0, 30, "spills to settle")
    every = {**vals, **extra}
    got = c.get_batch(list(every))
    wrong = [k for k, g in zip(every, got, strict=True) if g is not None and g != every[k]]
    assert not wrong, f"corrupt reads: {wrong}"
    misses = [k for k, g in zip(every, got, strict=True) if g is None]
    assert misses, "some objects lived on the dead server"
    assert len(misses) < len(every), "the surviving server's objects stay readable"
    for k in list(every)[:10]:  # single gets agree: exact bytes or None
        g = c.get(k)
        assert g is None or g == every[k]
    c.put("after", b"still serving")
    assert c.get("after") == b"still serving"


def test_damaged_ssd_files_read_as_misses_not_wrong_bytes(
    tiered: tuple[StoreClient, list[Proc], list[Path], int],
) -> None:
    c, _, dirs, _ = tiered
    vals = fill(c)
    files = [p for d in dirs for p in d.glob("*.obj")]
    assert files
    for p in files:  # flip one payload byte of every file
        raw = bytearray(p.read_bytes())
        if len(raw) > 40:
            raw[40] ^= 0x5A
            p.write_bytes(bytes(raw))
    got = c.get_batch(list(vals))
    wrong = [k for k, g in zip(vals, got, strict=True) if g is not None and g != vals[k]]
    assert not wrong, f"corrupt reads: {wrong}"
    missed = [k for k, g in zip(vals, got, strict=True) if g is None]
    assert missed, "objects on SSD read as misses"
    assert len(missed) < len(vals), "objects in memory still read"
    # the servers report the damaged files: the master forgets those objects
    wait_until(lambda: not any(c.batch_exists(missed)), 30, "damaged objects to be dropped")
    assert c.stats()["ssd_damaged"] > 0
    c.put("after", b"ok")
    assert c.get("after") == b"ok"


def test_restarted_master_rebuilds_objects_on_ssd_from_the_servers(tmp_path: Path) -> None:
    master_args = (*FAST, "--stripe-size", "256K", "--promote-hits", "0")
    m, addr = start_master(*master_args)
    port = int(addr.rsplit(":", 1)[1])
    dirs = [tmp_path / f"ssd{i}" for i in range(2)]
    servers = [start_server(addr, "4M", "--ssd-dir", str(d), "--ssd-size", str(SSD)) for d in dirs]
    try:
        with client(addr, timeout=30.0) as c:
            wait_servers(c, 2)
            vals = fill(c)
            spilled = c.stats()["ssd_used_bytes"]
            assert spilled > 0
            wait_until(lambda: c.stats()["holdings_unsent"] == 0, 10, "holdings to reach servers")
            m.kill()
            m, _ = start_master(*master_args, port=port)
            wait_servers(c, 2)
            # every stripe's disk copy was re-reported by the server holding it
            wait_until(lambda: c.stats()["ssd_used_bytes"] == spilled, 30, "disk copies back")
            got = c.get_batch(list(vals))
            assert got == list(vals.values())
            assert c.stats()["ssd_hits"] > 0
    finally:
        for s in servers:
            s.close()
        m.close()
