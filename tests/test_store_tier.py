"""The SSD tier's rules on the master (no I/O): striped spills, SSD budget and LRU, promotion,
a server lost mid-spill, re-reported disk copies. The servers' side is played by hand: what the
master asks them is read from their records, and their answers are fed back."""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from mooncake_connectors.store.config import MasterConfig
from mooncake_connectors.store.protocol import SSD_HEADER, Code
from mooncake_connectors.store.records import PROMOTING, SPILLING
from mooncake_connectors.store.recovery import collect
from mooncake_connectors.store.ssd import CORRUPT, MISSING, SsdStore, files_bytes
from mooncake_connectors.store.state import MasterState
from mooncake_connectors.store.tier import ssd_bytes

KiB = 1024
MiB = 1 << 20


def make(n: int = 2, seg: int = 1 * MiB, ssd: int = 4 * MiB, **cfg: object) -> MasterState:
    cfg.setdefault("server_ttl", 1e6)  # servers here never heartbeat
    s = MasterState(MasterConfig(port=0, stripe_size=64 * KiB, **cfg), now=-100.0)  # type: ignore[arg-type]
    for i in range(n):
        rec = s.server(f"srv{i}", None, 0.0)
        s.mount(rec, f"seg{i}", (i + 1) << 32, seg, "host", f"127.0.0.1:{9000 + i}", ssd, False)
    return s


def put(s: MasterState, key: str, size: int, nrep: int = 1, now: float = 0.0) -> int:
    pid = abs(hash(key)) + 1
    codes, _ = s.put_start(pid, [key], [size], nrep, 0, 0, "", now)
    if codes[0] != Code.OK:
        return codes[0]
    return s.put_end(pid, [key], [], now)[0]


def answer_spills(s: MasterState, ok: bool = True, now: float = 0.0) -> int:
    """Every server writes what it was asked to spill; returns how many files."""
    n = 0
    for rec in list(s.servers.values()):
        spills, rec.spills = rec.spills, []
        for fid, _, _ in spills:
            s.spill_done(rec.client_id, fid, ok, now)
            n += 1
    return n


def test_a_striped_object_spills_each_stripe_to_its_own_server() -> None:
    s = make(2, promote_hits=0)
    assert put(s, "big", 200_000, nrep=2) == Code.OK  # 4 stripes x 2 replicas
    obj = s.objects["big"]
    from mooncake_connectors.store import eviction

    eviction.evict(s, "big", 1.0)
    assert obj.meta & SPILLING and s.stats()["spilling"] == 1
    asked = {rec.client_id: len(rec.spills) for rec in s.servers.values()}
    assert sum(asked.values()) == 4  # one file per stripe, one copy only
    assert s.get(["big"], 1.0)[0] is not None  # still readable from memory while spilling
    assert answer_spills(s) == 4
    s.tick(10.0)  # the read lease ends: the memory copies are freed
    loc = s.get(["big"], 10.0)[0]
    assert loc is not None and loc.stripes == [] and loc.disk is not None and len(loc.disk) == 4
    assert {ep for ep, _, _ in loc.disk} <= {"127.0.0.1:9000", "127.0.0.1:9001"}
    assert s.used() == 0  # memory freed (the lease had ended at t=10)
    assert s.stats()["ssd_used_bytes"] == 4 * ssd_bytes(50_000)
    assert s.counters["ssd_hits"] == 1


def test_a_failed_stripe_drops_the_object_and_frees_every_file() -> None:
    s = make(2)
    assert put(s, "big", 200_000) == Code.OK
    from mooncake_connectors.store import eviction

    eviction.evict(s, "big", 1.0)
    recs = list(s.servers.values())
    first = recs[0].spills.pop(0)
    s.spill_done(recs[0].client_id, first[0], False, 1.0)
    assert answer_spills(s) == 3
    assert "big" not in s.objects and s.stats()["ssd_used_bytes"] == 0
    assert s.counters["spill_failures"] == 1
    assert sum(len(r.dropfiles) for r in recs) == 4


def test_a_report_for_another_servers_file_is_ignored() -> None:
    s = make(2, seg=256 * KiB)
    assert put(s, "k", 10_000) == Code.OK
    from mooncake_connectors.store import eviction

    eviction.evict(s, "k", 1.0)
    owner = next(r for r in s.servers.values() if r.spills)
    other = next(r for r in s.servers.values() if r is not owner)
    s.spill_done(other.client_id, owner.spills[0][0], True, 1.0)
    assert s.objects["k"].meta & SPILLING  # still waiting for the owner


def test_ssd_budget_holds_and_the_least_recently_read_object_goes_first() -> None:
    s = make(1, seg=512 * KiB, ssd=3 * ssd_bytes(64 * KiB), promote_hits=0)
    rec = s.servers["srv0"]
    now = 0.0
    for i in range(16):  # 1 MiB of 64 KiB values through 512 KiB of memory
        while put(s, f"k{i}", 64 * KiB, now=now) == Code.BUSY:  # a spill makes room
            answer_spills(s, now=now)
            now += 0.1
            s.tick(now)
            assert rec.ssd_used <= rec.ssd_size
        answer_spills(s, now=now)
        assert rec.ssd_used <= rec.ssd_size
    on_disk = [key for key, _ in rec.disk.values()]
    assert len(on_disk) == 3 and s.counters["ssd_drops"] > 0
    s.get([on_disk[0]], now)  # read: now the most recently read file
    now += 10
    while put(s, "x", 64 * KiB, now=now) == Code.BUSY:
        answer_spills(s, now=now)
        now += 0.1
        s.tick(now)
    left = [key for key, _ in rec.disk.values()]
    assert on_disk[0] in left and on_disk[1] not in left
    assert rec.ssd_used <= rec.ssd_size


def test_promotion_brings_an_ssd_hit_back_into_memory() -> None:
    s = make(2, promote_hits=2)
    assert put(s, "big", 200_000) == Code.OK
    from mooncake_connectors.store import eviction

    eviction.evict(s, "big", 1.0)
    answer_spills(s)
    obj = s.objects["big"]
    assert obj.locs == () and s.used() == 0
    s.get(["big"], 2.0)  # first SSD hit: not hot enough yet
    assert not obj.meta & PROMOTING
    s.get(["big"], 3.0)
    assert obj.meta & PROMOTING and s.stats()["promoting"] == 1
    asked = [(rec, item) for rec in s.servers.values() for item in rec.promotes]
    assert len(asked) == 4
    for rec, (fid, addr, size) in asked:
        seg = rec.segments[0]
        assert seg.base <= addr and addr + size <= seg.base + seg.size  # its own memory
        s.promote_done(rec.client_id, fid, True, 3.0)
    loc = s.get(["big"], 4.0)[0]
    assert loc is not None and loc.disk is None and len(loc.stripes) == 4
    assert s.counters["promotions"] == 1 and s.counters["ssd_hits"] == 2
    assert s.stats()["ssd_used_bytes"] > 0  # the files outlive the readers' leases
    s.tick(100.0)
    assert s.stats()["ssd_used_bytes"] == 0
    assert sum(len(r.dropfiles) for r in s.servers.values()) == 4


def test_failed_promotion_keeps_the_ssd_copy_and_frees_its_memory() -> None:
    s = make(1)
    assert put(s, "k", 30_000) == Code.OK
    from mooncake_connectors.store import eviction

    eviction.evict(s, "k", 1.0)
    answer_spills(s)
    s.get(["k"], 10.0)
    rec = s.servers["srv0"]
    ((fid, _, _),) = rec.promotes
    assert s.used() > 0
    s.promote_done("srv0", fid, False, 10.0)
    assert s.used() == 0 and s.counters["promotion_failures"] == 1
    loc = s.get(["k"], 11.0)[0]
    assert loc is not None and loc.disk is not None


def test_no_promotion_above_the_high_watermark() -> None:
    s = make(1, seg=256 * KiB)
    assert put(s, "k", 30_000) == Code.OK
    from mooncake_connectors.store import eviction

    eviction.evict(s, "k", 1.0)
    answer_spills(s)
    for i in range(3):
        assert put(s, f"fill{i}", 75 * KiB, now=10.0) == Code.OK  # ~88 % used
    s.get(["k"], 10.0)
    assert not s.servers["srv0"].promotes


def test_a_server_lost_mid_spill_fails_the_spill_and_its_disk_copies_read_as_misses() -> None:
    s = make(2)
    assert put(s, "a", 200_000) == Code.OK
    assert put(s, "b", 200_000) == Code.OK
    from mooncake_connectors.store import eviction

    eviction.evict(s, "a", 1.0)
    answer_spills(s)  # "a" is on both SSDs now
    eviction.evict(s, "b", 1.0)  # "b" is being spilled
    s.server_lost(s.servers["srv1"])
    answer_spills(s)  # srv0 finishes its half; the spill failed as a whole
    assert "b" not in s.objects and s.stats()["spilling"] == 0
    s.tick(10.0)
    assert s.get(["a"], 10.0) == [None]  # half of it was on the dead server's SSD
    assert s.servers["srv0"].ssd_used == 0


def test_disk_copies_are_re_reported_per_stripe() -> None:
    s = make(2)
    assert put(s, "big", 200_000) == Code.OK
    from mooncake_connectors.store import eviction

    eviction.evict(s, "big", 1.0)
    answer_spills(s)
    parts = {
        rec.client_id: [p for p in rec.ops if not isinstance(p, str)] for rec in s.servers.values()
    }
    t = MasterState(s.cfg, now=0.0)
    for i, cid in enumerate(sorted(parts)):
        rec = t.server(cid, None, 0.0)
        t.mount(rec, f"seg{i}", (i + 1) << 32, 1 * MiB, "host", f"ep{i}", 4 * MiB, True)
        disk_parts = [p for p in parts[cid] if not p.segment]
        assert all(p.nst == 4 for p in disk_parts)
        collect(t, rec, disk_parts, True, 0.0)
    loc = t.get(["big"], 0.0)[0]
    assert loc is not None and loc.disk is not None and len(loc.disk) == 4
    assert t.stats()["ssd_used_bytes"] == s.stats()["ssd_used_bytes"]


def test_ssd_files_are_checked_on_read(tmp_path: object) -> None:
    store = SsdStore(str(tmp_path), 1 * MiB)
    data = bytes(range(256)) * 40
    assert store.write(7, memoryview(data))
    assert store.used == len(data) + SSD_HEADER
    out = bytearray(len(data))
    assert store.read_into(7, memoryview(out)) == len(data) and bytes(out) == data
    assert store.read_into(8, memoryview(out)) == MISSING
    assert store.read_into(7, memoryview(bytearray(10))) == CORRUPT  # wrong length
    path = store._path(7)
    raw = bytearray(path.read_bytes())
    raw[SSD_HEADER + 100] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert store.read_into(7, memoryview(out)) == CORRUPT
    path.write_bytes(bytes(raw[: SSD_HEADER + 50]))  # torn
    assert store.read_into(7, memoryview(out)) == CORRUPT
    assert zlib.crc32(b"") == 0 and store.write(9, memoryview(b""))
    assert store.read_into(9, memoryview(bytearray())) == 0
    assert not store.write(10, memoryview(bytes(1 * MiB)))  # over budget
    store.delete(7)
    assert store.used == SSD_HEADER


@pytest.mark.parametrize("bad", [-1])
def test_promote_hits_is_validated(bad: int) -> None:
    from mooncake_connectors.errors import ConfigError

    with pytest.raises(ConfigError):
        MasterConfig(promote_hits=bad)


def test_a_damaged_file_drops_its_object_from_ssd() -> None:
    s = make(2, promote_hits=0)
    assert put(s, "big", 200_000) == Code.OK
    from mooncake_connectors.store import eviction

    eviction.evict(s, "big", 1.0)
    answer_spills(s)
    disk = s.objects["big"].extra.disk  # type: ignore[union-attr]
    assert disk is not None
    cid, fid = disk[1]
    s.file_lost(s.servers[cid], fid)
    assert "big" not in s.objects and s.exists(["big"], 2.0) == [False]
    assert s.counters["ssd_damaged"] == 1 and s.counters["ssd_drops"] == 0
    assert s.stats()["ssd_used_bytes"] == 0  # every stripe's file goes
    s.file_lost(s.servers[cid], fid)  # a repeated report is harmless


def test_disk_bytes_counts_a_file_deleted_between_listing_and_stat_as_zero(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server deletes SSD files while a reader sums them: a file listed but gone by its
    ``stat`` is 0 bytes, not a ``FileNotFoundError`` (a test failed on it under load)."""
    store = SsdStore(str(tmp_path), 1 * MiB)
    for fid in range(3):
        assert store.write(fid, memoryview(bytes(1000 * (fid + 1))))
    real_glob = Path.glob

    def glob_then_delete(self: Path, pattern: str) -> Iterator[Path]:
        listed = sorted(real_glob(self, pattern))
        os.unlink(listed[0])  # the server's delete, landing after the listing
        return iter(listed)

    monkeypatch.setattr(Path, "glob", glob_then_delete)
    assert store.disk_bytes() == (SSD_HEADER + 2000) + (SSD_HEADER + 3000)  # file 0 went
    assert files_bytes(tmp_path, "*.obj") == SSD_HEADER + 3000  # and now file 1
