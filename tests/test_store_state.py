"""The master's rules, driven directly with an explicit clock: allocation, replicas, leases,
eviction, pins, TTL, put-lease expiry, dead servers, rebuild from re-reports."""

from __future__ import annotations

import random

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake_connectors.store.allocator import ALIGN, RangeAllocator, aligned
from mooncake_connectors.store.config import MasterConfig
from mooncake_connectors.store.protocol import Code, Part, stripe_bounds
from mooncake_connectors.store.records import HARD, SOFT
from mooncake_connectors.store.recovery import collect
from mooncake_connectors.store.state import MasterState

MiB = 1 << 20


# -- allocator ---------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 70000)), max_size=200))
def test_allocator_never_overlaps_and_accounts(ops: list[tuple[bool, int]]) -> None:
    a = RangeAllocator(1 * MiB)
    live: dict[int, int] = {}
    rng = random.Random(7)
    for is_alloc, n in ops:
        if is_alloc or not live:
            off = a.alloc(n)
            if off is None:
                assert a.largest_free() < aligned(n)
                continue
            assert off % ALIGN == 0 and off + aligned(n) <= a.size
            for o, m in live.items():
                assert off + aligned(n) <= o or o + aligned(m) <= off, "overlap"
            live[off] = n
        else:
            off = rng.choice(sorted(live))
            a.release(off, live.pop(off))
        assert a.used == sum(aligned(m) for m in live.values())
    for off, n in list(live.items()):
        a.release(off, n)
    assert a.used == 0 and a.free_blocks() == 1 and a.largest_free() == a.size


def test_allocator_best_fit_and_rebuild() -> None:
    a = RangeAllocator(4096)
    offs = [a.alloc(512) for _ in range(8)]
    assert offs == [i * 512 for i in range(8)]
    assert a.alloc(1) is None
    a.release(512, 512)
    a.release(2048, 512)
    a.release(2560, 512)
    assert a.alloc(400) == 512  # the smallest hole that fits
    b = RangeAllocator.with_used(4096, [(0, 100), (1024, 1000), (4000, 500)])  # last is bogus
    assert b.used == aligned(100) + aligned(1000)
    assert b.alloc(800) == aligned(100)  # the hole between the two used ranges
    assert b.alloc(900) == 2048


def test_stripe_bounds_cover_the_value() -> None:
    for size in (0, 1, 10, 4096, 10 * MiB + 7):
        for nst in (1, 2, 3, 7):
            b = stripe_bounds(size, nst)
            assert len(b) == nst and sum(n for _, n in b) == size
            assert all(off == i * b[0][1] or n == 0 for i, (off, n) in enumerate(b))


# -- master state ------------------------------------------------------------------------------
def make(n_servers: int = 2, seg: int = 1 * MiB, **cfg: object) -> MasterState:
    s = MasterState(MasterConfig(port=0, **cfg), now=-100.0)  # type: ignore[arg-type]
    for i in range(n_servers):
        rec = s.server(f"srv{i}", None, 0.0)
        s.mount(rec, f"seg{i}", (i + 1) << 32, seg, "host", "", 0, False)
    return s


def put(s: MasterState, key: str, size: int, now: float = 0.0, **kw: object) -> int:
    nrep = int(kw.pop("nrep", 1))  # type: ignore[call-overload]
    flags = int(kw.pop("flags", 0))  # type: ignore[call-overload]
    ttl_ms = int(kw.pop("ttl_ms", 0))  # type: ignore[call-overload]
    pid = random.getrandbits(40) + 1
    codes, _ = s.put_start(pid, [key], [size], nrep, ttl_ms, flags, "", now)
    if codes[0] != Code.OK:
        return codes[0]
    return s.put_end(pid, [key], [], now)[0]


def test_replicas_land_on_distinct_servers_and_stripes_spread() -> None:
    s = make(3, stripe_size=64 * 1024)
    codes, stripes = s.put_start(1, ["k"], [200_000], 2, 0, 0, "", 0.0)
    assert codes == [Code.OK]
    assert len(stripes[0]) == 4  # 200000 / 64 KiB -> 4 stripes
    for copies in stripes[0]:
        assert len({seg for seg, _ in copies}) == 2  # two replicas, two servers
    assert len({copies[0][0] for copies in stripes[0]}) > 1  # stripes spread over servers
    assert s.put_end(1, ["k"], [], 0.0) == [Code.OK]
    loc = s.get(["k"], 0.0)[0]
    assert loc is not None and loc.size == 200_000 and all(len(c) == 2 for c in loc.stripes)


def test_more_replicas_than_servers_is_best_effort() -> None:
    s = make(2)
    codes, stripes = s.put_start(1, ["k"], [10], 4, 0, 0, "", 0.0)
    assert codes == [Code.OK] and len(stripes[0][0]) == 2


def test_pending_puts_are_invisible_and_expire_without_leaking() -> None:
    s = make(1, put_lease_ttl=2.0)
    used0 = s.used()
    codes, _ = s.put_start(5, ["k"], [100_000], 1, 0, 0, "", 0.0)
    assert codes == [Code.OK] and s.used() > used0
    assert s.get(["k"], 0.0) == [None] and s.exists(["k"], 0.0) == [False]
    assert s.put_start(6, ["k"], [10], 1, 0, 0, "", 1.0)[0] == [Code.EXISTS]  # being written
    s.tick(2.5)
    assert s.used() == used0 and not s.pending
    assert s.put_end(5, ["k"], [], 3.0) == [Code.PUT_EXPIRED]
    assert put(s, "k", 10, now=3.0) == Code.OK


def test_lru_eviction_from_high_watermark_skips_leased_and_pinned() -> None:
    s = make(1, seg=1 * MiB, high_watermark=0.9, low_watermark=0.5)
    size = 64 * 1024
    for i in range(14):  # 14 x 64 KiB = 87.5 %
        assert put(s, f"k{i}", size, flags=HARD if i == 1 else SOFT if i == 2 else 0) == 0
    s.get(["k0"], 0.0)  # leased and most recently used
    assert put(s, "k14", size) == 0  # 93.75 % > high watermark
    s.tick(0.1)
    assert s.used() <= 0.5 * s.capacity()
    left = {k for k in s.objects}
    assert {"k0", "k1", "k2", "k14"} <= left  # leased, hard pin, soft pin, newest
    assert "k3" not in left  # least recently used went first


def test_full_store_evicts_lru_for_a_new_put_then_reports_no_space() -> None:
    s = make(1, seg=256 * 1024)
    for i in range(4):
        assert put(s, f"k{i}", 64 * 1024) == 0
    assert put(s, "new", 64 * 1024, now=1.0) == 0  # evicts k0
    assert "k0" not in s.objects and s.counters["evictions"] == 1
    for k in list(s.objects):
        s.objects[k].meta |= HARD
    assert put(s, "more", 64 * 1024, now=2.0) == Code.NO_SPACE
    assert put(s, "huge", 2 * MiB, now=2.0) == Code.NO_SPACE  # larger than any segment


def test_remove_of_a_leased_object_defers_the_free() -> None:
    s = make(1)
    assert put(s, "k", 100_000) == 0
    used = s.used()
    s.get(["k"], 0.0)  # lease until 5.0
    assert s.remove(["k"], False, 1.0) == [Code.OK]
    assert s.get(["k"], 1.0) == [None]
    s.tick(2.0)
    assert s.used() == used  # a reader may still be copying
    s.tick(5.1)
    assert s.used() < used
    assert s.remove(["k"], False, 6.0) == [Code.NOT_FOUND]


def test_ttl_expires_objects() -> None:
    s = make(1)
    assert put(s, "k", 10, ttl_ms=1500) == 0
    assert s.exists(["k"], 1.0) == [True]
    s.tick(1.6)
    assert s.exists(["k"], 1.6) == [False]


def test_dead_server_drops_its_copies_and_keeps_the_others() -> None:
    s = make(2, server_ttl=2.0, heartbeat_interval=0.5)
    assert put(s, "two", 10, nrep=2) == 0
    assert put(s, "one", 10) == 0
    seg_one = s.get(["one"], 0.0)[0].stripes[0][0][0]  # type: ignore[union-attr]
    for rec in s.servers.values():
        rec.last_seen = 10.0 if rec.segments[0].name != seg_one else 0.0
    s.tick(10.0)
    assert s.counters["servers_lost"] == 1
    assert s.get(["one"], 10.0) == [None]  # its only copy is gone: a miss
    loc = s.get(["two"], 10.0)[0]
    assert loc is not None and len(loc.stripes[0]) == 1


def test_rebuild_from_reports() -> None:
    s = make(2, stripe_size=64 * 1024)
    assert put(s, "a", 100_000, nrep=2) == 0
    assert put(s, "b", 10) == 0
    # What the servers were told they hold:
    parts: dict[str, list[Part]] = {}
    for rec in s.servers.values():
        parts[rec.client_id] = [p for p in rec.ops if isinstance(p, Part)]
    fresh = MasterState(MasterConfig(port=0), now=0.0)  # a new leader
    for i, (cid, ps) in enumerate(sorted(parts.items())):
        rec = fresh.server(cid, None, 0.0)
        fresh.mount(rec, f"seg{i}", (i + 1) << 32, 1 * MiB, "host", "", 0, True)
        collect(fresh, rec, ps, True, 0.0)
    la, lb = fresh.get(["a", "b"], 0.0)
    assert la is not None and lb is not None
    assert la.stripes == s.get(["a"], 0.0)[0].stripes  # type: ignore[union-attr]
    assert fresh.used() == s.used()
    assert fresh.put_start(9, ["a"], [5], 1, 0, 0, "", 0.0)[0] == [Code.EXISTS]


@pytest.mark.parametrize("n", [1, 3])
def test_remove_all(n: int) -> None:
    s = make(n)
    for i in range(10):
        assert put(s, f"k{i}", 1000, flags=HARD) == 0
    assert s.remove_all(False, 0.0) == 10
    assert not s.objects and s.used() == 0


def test_staging_takes_no_buffer_for_nothing_and_reuses_its_memory() -> None:
    from mooncake_connectors.config import EngineConfig
    from mooncake_connectors.store.staging import SLOT, Staging
    from mooncake_connectors.transfer_core import TransferEngine

    with TransferEngine(EngineConfig(metadata="memory://staging")) as engine:
        st = Staging(engine, 4 * MiB)
        epoch = engine.local.epoch
        with st.stage([]) as none:
            assert none == []
        with st.stage([100]) as (a,), st.stage([SLOT + 1, 0, 10]) as many:
            assert a != many[0] and many[1] - many[0] >= SLOT + 1
        with st.stage([8 * MiB]) as (big,):  # does not fit: a temporary registered buffer
            assert engine.local.find(big, 8 * MiB) is not None
        assert engine.local.find(big, 1) is None
        with st.stage([1 * MiB]):
            pass
        assert engine.local.epoch == epoch + 2  # only the temporary buffer came and went


def test_coalesce_merges_only_exact_neighbours() -> None:
    from mooncake_connectors.store.coalesce import coalesce
    from mooncake_connectors.transfer_core.engine import TransferRequest
    from mooncake_connectors.types import TransferOp

    R = TransferOp.READ
    reqs = [TransferRequest(R, "a", 1000 + 100 * i, 5000 + 100 * i, 100) for i in (2, 0, 1)] + [
        TransferRequest(R, "b", 1300, 5300, 100),  # another segment
        TransferRequest(R, "a", 1400, 5300, 100),  # local side not adjacent to the run
        TransferRequest(R, "a", 1300, 5400, 50),  # remote gap
    ]
    out = coalesce(reqs)
    assert TransferRequest(R, "a", 1000, 5000, 300) in out
    assert len(out) == 4 and sum(r.length for r in out) == sum(r.length for r in reqs)


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from("ab"), st.booleans(), st.integers(0, 6), st.integers(1, 3)),
        min_size=0,
        max_size=12,
    ),
    st.booleans(),
)
def test_coalesce_moves_exactly_the_bytes_asked_for(
    spec: list[tuple[str, bool, int, int]], shuffle: bool
) -> None:
    """Every byte of every request is moved once by the merged requests (and no other byte),
    whether the batch comes in order or not."""
    from mooncake_connectors.store.coalesce import coalesce
    from mooncake_connectors.transfer_core.engine import TransferRequest
    from mooncake_connectors.types import TransferOp

    reqs, seen = [], set()
    for target, write, slot, n in spec:
        if (target, slot) in seen:
            continue  # one request per remote slot: no overlapping requests
        seen.add((target, slot))
        op = TransferOp.WRITE if write else TransferOp.READ
        reqs.append(TransferRequest(op, target, 10_000 + slot * 100, 50_000 + slot * 100, n * 100))
        if n > 1:  # a longer request overlaps the next slots: keep them out
            seen.update((target, slot + k) for k in range(1, n))
    if shuffle:
        random.Random(len(reqs)).shuffle(reqs)

    def moved(rs: list[TransferRequest]) -> set[tuple[object, ...]]:
        return {
            (r.op, r.target, r.local_addr + k, r.remote_addr + k)
            for r in rs
            for k in range(r.length)
        }

    out = coalesce(reqs)
    assert moved(out) == moved(reqs)
    assert sum(r.length for r in out) == sum(r.length for r in reqs)
    assert len(out) <= len(reqs)


def test_a_batch_lands_back_to_back() -> None:
    s = make(2)
    codes, stripes = s.put_start(1, [f"k{i}" for i in range(8)], [4096] * 8, 1, 0, 0, "", 0.0)
    assert codes == [Code.OK] * 8
    addrs = [st[0][0] for st in stripes]
    assert len({seg for seg, _ in addrs}) == 1
    assert [a for _, a in addrs] == [addrs[0][1] + 4096 * i for i in range(8)]


def test_a_batch_placed_as_one_block_frees_key_by_key() -> None:
    s = make(1, seg=1 * MiB)
    sizes = [0, 1, 4096, 100, 64, 65]
    keys = [f"k{i}" for i in range(len(sizes))]
    codes, stripes = s.put_start(1, keys, sizes, 1, 0, 0, "", 0.0)
    assert codes == [Code.OK] * len(keys)
    addrs = [st[0][0][1] for st in stripes]
    assert addrs == [addrs[0] + sum(aligned(n) for n in sizes[:i]) for i in range(len(sizes))]
    assert s.used() == sum(aligned(n) for n in sizes)
    assert s.put_end(1, keys[::2], keys[1::2], 0.0) == [Code.OK] * 3  # the rest revoked
    assert s.used() == sum(aligned(n) for n in sizes[::2])
    assert s.remove(keys[::2], True, 0.0) == [Code.OK] * 3
    alloc = s.segments[1].alloc
    assert alloc is not None and alloc.used == 0 and alloc.free_blocks() == 1


def test_a_batch_that_cannot_be_one_block_is_placed_key_by_key() -> None:
    s = make(2, seg=64 * 1024)
    keys = [f"k{i}" for i in range(24)]  # 24 x 4 KiB: more than one segment holds
    codes, stripes = s.put_start(1, keys, [4096] * 24, 1, 0, 0, "", 0.0)
    assert codes == [Code.OK] * 24 and len({st[0][0][0] for st in stripes}) == 2
    assert s.put_end(1, keys, [], 0.0) == [Code.OK] * 24
    assert all(loc is not None and loc.size == 4096 for loc in s.get(keys, 0.0))
    assert s.remove(keys, True, 0.0) == [Code.OK] * 24
    # a key that exists, one being written, one twice: each answered on its own
    assert put(s, "old", 10) == Code.OK
    assert s.put_start(2, ["w"], [10], 1, 0, 0, "", 0.0)[0] == [Code.OK]
    codes, _ = s.put_start(3, ["old", "a", "w", "b", "a"], [10] * 5, 1, 0, 0, "", 0.0)
    assert codes == [Code.EXISTS, Code.OK, Code.EXISTS, Code.OK, Code.EXISTS]


# -- commits retried across a master fail-over ---------------------------------------------------
def new_leader(**cfg: object) -> MasterState:
    """A fresh leader whose recovery window is over (``settling`` is False at time 0)."""
    return MasterState(MasterConfig(port=0, **cfg), now=-100.0)  # type: ignore[arg-type]


def rereport(fresh: MasterState, old: MasterState, client_id: str, age_ms: int = 0) -> None:
    """``client_id`` mounts at ``fresh`` and re-reports what ``old`` told it it holds, those
    commits ``age_ms`` old by then (a fail-over takes a while)."""
    rec = old.servers[client_id]
    parts = [
        msgspec.structs.replace(p, at_ms=p.at_ms - age_ms) for p in rec.ops if isinstance(p, Part)
    ]
    new = fresh.server(client_id, None, 0.0)
    for seg in rec.segments:
        fresh.mount(new, seg.name, seg.base, seg.size, "host", "", 0, True)
    collect(fresh, new, parts, True, 0.0)


def fail_over(old: MasterState, age_ms: int = 0, **cfg: object) -> MasterState:
    fresh = new_leader(**cfg)
    for cid in sorted(old.servers):
        rereport(fresh, old, cid, age_ms)
    return fresh


def test_a_commit_retried_after_a_slow_fail_over_is_answered_ok() -> None:
    """The CI failure: the fail-over (and re-report) took longer than the put lease, so the new
    leader forgot the old one's last commits; the retried commit was PUT_EXPIRED, the writer put
    again and got EXISTS for its own object."""
    from mooncake_connectors.store.master import Master
    from mooncake_connectors.store.protocol import Codes, Committed, PutEnd, PutReserved

    s = make(2, put_lease_ttl=2.0)
    assert s.put_start(7, ["k"], [100], 2, 0, 0, "", 0.0)[0] == [Code.OK]
    assert s.put_end(7, ["k"], [], 0.0) == [Code.OK]  # ... and the answer is lost
    spare = s.reserve(100, 2, 0.0)
    assert spare is not None
    rid = spare[0]
    assert s.commit_reserved(rid, "r", 100, 0, 0, 0.0) == (Code.OK, 2)  # answer lost too
    m = Master(MasterConfig(port=0, put_lease_ttl=2.0))
    m.state = fail_over(s, age_ms=5000, put_lease_ttl=2.0)
    assert not m.state.settling(0.0)
    end = m._put_end(None, PutEnd(7, ["k"], []), 0.0)  # type: ignore[arg-type]
    assert end == Codes([Code.OK])
    # (a reservation this master never made: it answers without reserving the next one)
    reply = m._put_reserved(None, PutReserved(rid, "r", 100), 0.0)  # type: ignore[arg-type]
    assert reply == Committed(Code.OK, None)
    # a commit this master cannot know stays expired
    other = m._put_end(None, PutEnd(8, ["k"], []), 0.0)  # type: ignore[arg-type]
    assert other == Codes([Code.PUT_EXPIRED])


def test_a_put_retried_under_its_id_is_told_committed_and_others_exists() -> None:
    s = make(2)
    assert s.put_start(7, ["k"], [100], 2, 0, 0, "", 0.0)[0] == [Code.OK]
    assert s.put_end(7, ["k"], [], 0.0) == [Code.OK]
    fresh = fail_over(s)
    codes, stripes = fresh.put_start(7, ["k"], [100], 2, 0, 0, "", 0.0)
    assert codes == [Code.COMMITTED] and stripes == [[]]  # nothing to write again
    assert fresh.put_start(8, ["k"], [100], 2, 0, 0, "", 0.0)[0] == [Code.EXISTS]
    assert not fresh.pending


@pytest.mark.parametrize(("retry_id", "want"), [(7, Code.OK), (8, Code.EXISTS)])
def test_a_retry_allocated_before_the_re_report_commits_as_ok(retry_id: int, want: Code) -> None:
    """Put 7's retry got a new allocation before the server holding the old leader's commit of
    it re-reported: its commit then finds the key taken, by itself (OK). Another writer (put
    8) that raced for the key the same way is still refused."""
    s = make(2)
    assert s.put_start(7, ["k"], [100], 1, 0, 0, "", 0.0)[0] == [Code.OK]
    assert s.put_end(7, ["k"], [], 0.0) == [Code.OK]
    holder = next(c for c, r in s.servers.items() if any(isinstance(p, Part) for p in r.ops))
    other = next(c for c in s.servers if c != holder)
    fresh = new_leader()
    rereport(fresh, s, other)  # the server without "k" is back first
    assert fresh.put_start(retry_id, ["k"], [100], 1, 0, 0, "", 0.0)[0] == [Code.OK]
    used = fresh.used()
    rereport(fresh, s, holder)
    assert fresh.put_end(retry_id, ["k"], [], 0.0) == [want]
    # either way the new allocation is given back: the re-reported copy is the object
    assert fresh.used() == used and not fresh.pending
    loc, was = fresh.get(["k"], 0.0)[0], s.get(["k"], 0.0)[0]
    assert loc is not None and was is not None and loc.stripes == was.stripes


def test_rebuild_keeps_the_newest_commits_of_every_server() -> None:
    s = make(2)
    for i in range(5):
        assert put(s, f"k{i}", 100, nrep=2) == Code.OK
    fresh = new_leader()
    for cid in sorted(s.servers):
        rereport(fresh, s, cid, age_ms=10**9)  # however old
    assert set(fresh.recent) == set(s.recent)
    assert list(fresh.recent.values()) == sorted(fresh.recent.values())  # oldest first


def test_recall_keeps_the_newest_commits_whichever_server_reported_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from mooncake_connectors.store import state as state_mod

    monkeypatch.setattr(state_mod, "RECENT_COMMITS", 4)
    s = new_leader()
    s.recall({(1, "a"): 100, (2, "b"): 400, (3, "c"): 300})  # the first server
    s.recall({(4, "d"): 50, (5, "e"): 200, (6, "f"): 500, (3, "c"): 250})  # the second
    assert list(s.recent) == [(5, "e"), (3, "c"), (2, "b"), (6, "f")]  # oldest first


def test_writer_whose_commit_was_lost_in_a_fail_over_reports_success() -> None:
    """End to end through the writer: the old leader commits, its answer is lost, the new leader
    (not yet re-reported to) says PUT_EXPIRED; the writer's retry under the same put id is told
    COMMITTED once the servers re-reported, and it writes nothing again. Another writer of the
    key still gets ObjectExists."""
    import contextlib
    from collections.abc import Iterator

    from mooncake_connectors.errors import ObjectExists
    from mooncake_connectors.store.master import Master
    from mooncake_connectors.store.protocol import Msg, PutEnd, PutStart
    from mooncake_connectors.store.writer import Writer

    m = Master(MasterConfig(port=0))
    old = m.state = make(2)
    seen: list[Msg] = []

    class Link:  # the master link: this one's PutEnd answer is lost in a fail-over
        def call(self, msg: Msg, deadline: float) -> Msg:
            seen.append(msg)
            if isinstance(msg, PutEnd) and m.state is old:
                m._handle(None, msg, 0)  # type: ignore[arg-type]
                m.state = new_leader()  # the retry reaches it before any re-report
            elif isinstance(msg, PutStart) and m.state is not old and not m.state.servers:
                for cid in sorted(old.servers):
                    rereport(m.state, old, cid)
            reply = m._handle(None, msg, 0)  # type: ignore[arg-type]
            assert reply is not None
            return reply

    class Engine:
        writes = 0

        def transfer(self, reqs: list[object], timeout: float) -> None:
            Engine.writes += len(reqs)

    class Staging:  # the sources are registered memory: nothing is staged
        @contextlib.contextmanager
        def stage(self, sizes: list[int]) -> Iterator[list[int]]:
            assert not sizes
            yield []

    w = Writer(Engine(), Link(), Staging(), 2.0, 5.0)  # type: ignore[arg-type]
    assert w.put(["k"], [(1 << 40, 100, None)]) == [None]
    starts = [x for x in seen if isinstance(x, PutStart)]
    assert len(starts) == 2 and starts[0].put_id == starts[1].put_id
    assert Engine.writes == 1  # written once, by the first attempt
    other = Writer(Engine(), Link(), Staging(), 2.0, 5.0)  # type: ignore[arg-type]
    (r,) = other.put(["k"], [(1 << 40, 100, None)])
    assert isinstance(r, ObjectExists)


# -- a put that cannot fit evicts nothing; one that needs room evicts about that much ---------
def fill(s: MasterState, n: int, size: int) -> None:
    for i in range(n):
        assert put(s, f"f{i}", size) == Code.OK
    assert s.used() == s.capacity()


@pytest.mark.parametrize(
    "n_servers, size, nrep",
    [
        (2, 3 * MiB, 1),  # striped: every stripe fits a segment, the whole does not fit them all
        (2, 3 * MiB // 2, 2),  # two replicas of 1.5 MiB need 3 MiB of 2
        (3, 2 * MiB, 2),  # two copies of each stripe on distinct servers: 4 MiB of 3
        (1, 2 * MiB, 1),  # larger than the only segment
    ],
)
def test_a_put_that_can_never_fit_evicts_nothing(n_servers: int, size: int, nrep: int) -> None:
    s = make(n_servers, seg=1 * MiB, stripe_size=256 * 1024)
    fill(s, 16 * n_servers, 64 * 1024)
    assert put(s, "huge", size, now=1.0, nrep=nrep) == Code.NO_SPACE
    assert s.counters["evictions"] == 0 and len(s.objects) == 16 * n_servers


def test_a_put_that_cannot_fit_past_pinned_objects_evicts_nothing() -> None:
    s = make(1, seg=1 * MiB)
    fill(s, 16, 64 * 1024)
    for i in range(3, 16):
        s.objects[f"f{i}"].meta |= HARD
    assert put(s, "big", 256 * 1024, now=1.0) == Code.NO_SPACE  # 3 x 64 KiB evictable
    assert s.counters["evictions"] == 0 and len(s.objects) == 16
    assert put(s, "fits", 192 * 1024, now=1.0) == Code.OK  # exactly what can be freed
    assert s.counters["evictions"] == 3


@pytest.mark.parametrize("n_servers", [1, 2])
def test_a_put_that_needs_some_room_evicts_about_that_much(n_servers: int) -> None:
    s = make(n_servers, seg=1 * MiB, stripe_size=256 * 1024)
    fill(s, 16 * n_servers, 64 * 1024)
    assert put(s, "new", 128 * 1024, now=1.0) == Code.OK
    # LRU victims land in either segment; a one-segment value needs two neighbours in one
    assert 2 <= s.counters["evictions"] <= 2 * n_servers - 1 + (n_servers == 1)
    assert put(s, "striped", 512 * 1024, now=2.0) == Code.OK  # two 256 KiB stripes
    assert s.counters["evictions"] <= 2 + 8 + 2 * n_servers
    assert len(s.objects) >= 16 * n_servers - 12


# -- a key twice in one put ----------------------------------------------------------------------
def test_a_key_twice_in_one_put_stores_the_first_and_refuses_the_repeat() -> None:
    s = make(1)
    codes, stripes = s.put_start(9, ["d", "e", "d"], [10, 20, 30], 1, 0, 0, "", 0.0)
    assert codes == [Code.OK, Code.OK, Code.EXISTS] and stripes[2] == []
    assert s.put_end(9, ["d", "e"], [], 0.0) == [Code.OK, Code.OK]
    loc = s.get(["d"], 0.0)[0]
    assert loc is not None and loc.size == 10
    # the same request again (a retry) is still recognised as this put's own
    codes, _ = s.put_start(9, ["d", "d"], [10, 10], 1, 0, 0, "", 1.0)
    assert codes == [Code.COMMITTED, Code.EXISTS]
