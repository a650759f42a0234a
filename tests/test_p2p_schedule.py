"""The swarm's pure policies: rarest-first picking, per-holder limits, egress and per-peer caps."""

from __future__ import annotations

import random

from mooncake_connectors.p2p.records import bitmap, count, has, merge, set_bit
from mooncake_connectors.p2p.schedule import PeerView, ServeLedger, TokenBucket, pick


def bits(n: int, held: list[int]) -> bytes:
    b = bitmap(n)
    for i in held:
        set_bit(b, i)
    return bytes(b)


def peer(name: str, n: int, held: list[int], **kw: object) -> PeerView:
    return PeerView(name, f"{name}:1", name, bits(n, held), **kw)  # type: ignore[arg-type]


def test_bitmaps() -> None:
    b = bitmap(10)
    assert len(b) == 2 and count(b) == 0
    set_bit(b, 9)
    assert has(b, 9) and not has(b, 8) and not has(b, 80)
    assert count(merge(bytes(b), bits(16, [0, 15]))) == 3


def test_rarest_chunk_goes_first() -> None:
    peers = {
        "a": peer("a", 4, [0, 1, 2, 3]),
        "b": peer("b", 4, [0, 1, 2]),
        "c": peer("c", 4, [0, 1]),
    }
    got = pick([0, 1, 2, 3], peers, k=1, limit=1, rng=random.Random(1))
    assert got == [(3, "a")]  # only a has chunk 3
    got = pick([0, 1, 2], peers, k=1, limit=1, rng=random.Random(1))
    assert got[0][0] == 2  # held twice, the others three times


def test_ties_are_broken_at_random() -> None:
    peers = {"a": peer("a", 8, list(range(8)))}
    firsts = {pick(range(8), peers, k=1, limit=1, rng=random.Random(s))[0][0] for s in range(40)}
    assert len(firsts) > 3  # not always the lowest index


def test_at_most_k_in_flight_per_holder() -> None:
    peers = {"a": peer("a", 8, list(range(8))), "b": peer("b", 8, list(range(8)), inflight=1)}
    got = pick(range(8), peers, k=2, limit=10, rng=random.Random(0))
    per = {h: sum(1 for _, x in got if x == h) for h in "ab"}
    assert per == {"a": 2, "b": 1}
    assert len({c for c, _ in got}) == len(got)  # never the same chunk twice


def test_unusable_holders_are_skipped() -> None:
    now = 100.0
    peers = {
        "dead": peer("dead", 2, [0, 1], dead_until=now + 5),
        "busy": peer("busy", 2, [0, 1], busy_until=now + 5),
        "capped": peer("capped", 2, [0, 1], capped=True),
        "bad": peer("bad", 2, [0, 1], bad={0}),
    }
    got = pick([0, 1], peers, k=4, limit=4, rng=random.Random(0), now=now)
    assert got == [(1, "bad")]  # chunk 0 failed its hash from "bad": nobody usable offers it


def test_token_bucket_paces_grants() -> None:
    t = [0.0]
    b = TokenBucket(rate=100.0, burst=10.0, clock=lambda: t[0])
    assert b.take(50) == 0.0  # the first grant overdraws: 10 - 50 = -40
    wait = b.take(50)
    assert 0.4 <= wait <= 0.41  # 40 bytes of debt at 100 B/s
    t[0] = 0.41
    assert b.take(50) == 0.0
    t[0] = 100.0
    b.take(1)
    assert b.tokens <= 10.0  # credit never saves up past the burst


def test_serve_ledger_caps_each_peer() -> None:
    led = ServeLedger(cap=100)
    assert led.room("x", 60)
    led.charge("x", 60)
    assert not led.room("x", 60) and led.room("y", 60)
    assert ServeLedger(None).room("x", 1 << 60)
