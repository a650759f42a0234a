"""The rdma transport's direct QPs (transports/rdma/direct.py): a request or a batch goes on
per-rail QPs with CQs of their own, posted and waited for in one compiled call (by the caller,
or by the transport's direct thread for an asynchronous batch).
Over the real pyverbs and the emulated NIC (tests/fake_ibverbs), in .venv-rdma; the compiled
cases skip where ``_rdma_fast`` is not built, and on the pyverbs path there are none."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import fake_ibverbs_lib as fib
import pytest
from helpers import wait_until
from test_rdma_fast import PATHS, _built, _child, lib, made
from test_rdma_fast import _Pair as _FastPair

__all__ = ["lib", "made"]  # fixtures, used by name
WR = 64 << 10
compiled_only = pytest.mark.skipif(not _built(), reason="_rdma_fast is not built here")


class _Pair(_FastPair):
    def __init__(
        self, lib: Path, path: str, transports: list[str], retry_scale: float = 0.01, **rdma: Any
    ) -> None:
        # a rail that failed stays cool for the rest of the test
        engine = {"timeout": 20, "backoff_initial": 30.0, "backoff_max": 60.0}
        super().__init__(lib, path, path, tuple(transports), retry_scale, engine, **rdma)

    def write(self, n: int, off: int = 0, op: str = "write") -> None:
        self.a.call("transfer", op=op, peer=self.b.segment, local=self.addr_a + off,
                    remote=self.addr_b + off, length=n)  # fmt: skip

    def same(self, n: int, off: int = 0) -> bool:
        sha = [p.call("digest", addr=addr + off, length=n)["sha"]
               for p, addr in ((self.a, self.addr_a), (self.b, self.addr_b))]  # fmt: skip
        return bool(sha[0] == sha[1])

    def stats(self) -> dict[str, dict[str, float]]:
        got: dict[str, dict[str, float]] = self.a.call("rail_stats", peer=self.b.segment)["stats"]
        return got

    def wait_direct(self, timeout: float = 20.0) -> dict[str, dict[str, float]]:
        """Requests until every rail's direct QP is connected (each is connected in the
        background on first need); the stats then."""

        def connected() -> bool:
            self.write(4096)
            return all(v["direct"] for v in self.stats().values())

        wait_until(connected, timeout, "every direct QP to connect", interval=0.05)
        return self.stats()


def _up(a: int, b: int) -> int:
    return -(-a // b)


def _carried(stats: dict[str, dict[str, float]]) -> tuple[float, float]:
    """(WRs on the rails' own QPs, WRs on direct QPs)"""
    direct = sum(v["direct_carried"] for v in stats.values())
    return sum(v["carried"] for v in stats.values()) - direct, direct


@pytest.mark.parametrize("path", PATHS)
def test_a_waited_for_request_goes_on_direct_qps(lib: Path, made: list[_Pair], path: str) -> None:
    """Compiled: once the direct QPs are connected, ``transfer`` of one request (1 byte to the
    engine's 8 MiB slice) goes on them: every byte lands, both ways, the WRs are counted on
    direct QPs (a request spread over the rails, one chain of 64 KiB WRs per direct QP) and
    none on the rails' own QPs. The pyverbs path has no direct QPs: the rails carry all."""
    p = _Pair(lib, path, ["rdma"])
    made.append(p)
    p.write(4096)  # the first request to a peer goes the general way
    if path == "python":
        for _ in range(3):
            p.write(1 << 20)
        assert p.same(1 << 20)
        stats = p.stats()
        assert not any(v["direct"] or v["direct_carried"] for v in stats.values()), stats
        return
    rails, direct = _carried(p.wait_direct())
    wrs = 0
    for n, off in ((1, 0), (4097, 12345), (WR, 0), ((1 << 20) + 1, 4096), (4 << 20, 0),
                   (8 << 20, 8 << 20)):  # fmt: skip
        for op in ("write", "read"):
            if op == "read":  # fresh bytes on b first, so the read has something to prove
                p.b.call("fill", addr=p.addr_b + off, length=n, seed=n)
            p.write(n, off, op)
            assert p.same(n, off), (n, off, op)
            # spread as the rails spread it: a share of whole WRs per direct QP (4 here)
            share = max(WR, _up(_up(n, 4), WR) * WR)
            wrs += sum(_up(min(share, n - o), WR) for o in range(0, n, share))
    rails2, direct2 = _carried(p.stats())
    assert rails2 == rails, "a waited-for request went on the rails' own QPs"
    assert direct2 - direct == wrs


@compiled_only
@pytest.mark.parametrize("layout", ["adjacent", "shuffled"])
def test_a_waited_for_batch_of_kv_blocks_goes_on_direct_qps(
    lib: Path, made: list[_Pair], layout: str
) -> None:
    """``engine.transfer`` of many requests (what a PD decode's load does, through
    ``engine.run``): 4 (layer, K/V) spans of 48 blocks of 32 KiB, the remote blocks in the local
    order (coalesced into 64 KiB WRs) or shuffled (a WR each), go on the direct QPs in one
    compiled call: every block lands where it says, both ways, and the rails' own QPs carry
    nothing."""
    p = _Pair(lib, "compiled", ["rdma"])
    made.append(p)
    p.write(4096)
    rails, direct = _carried(p.wait_direct())
    block, spans, per = 32 << 10, 4, 48
    order = list(range(per))
    remote = order if layout == "adjacent" else order[7:] + order[:7]
    if layout == "shuffled":
        remote[::2] = remote[::2][::-1]
    blocks = [
        (p.addr_a + (s * per + i) * block, p.addr_b + (s * per + j) * block, block)
        for s in range(spans)
        for i, j in zip(order, remote, strict=True)
    ]
    p.a.call("batch", op="write", peer=p.b.segment, blocks=blocks)
    back = [(lo + spans * per * block, ro, n) for lo, ro, n in blocks]
    p.a.call("batch", op="read", peer=p.b.segment, blocks=back)
    for lo, ro, n in blocks + back:
        assert p.a.call("digest", addr=lo, length=n) == p.b.call("digest", addr=ro, length=n)
    rails2, direct2 = _carried(p.stats())
    assert rails2 == rails, "a waited-for batch went on the rails' own QPs"
    # adjacent: 4 spans of 1.5 MiB, 24 WRs of 64 KiB each; shuffled: a WR per block
    assert direct2 - direct == 2 * (spans * 24 if layout == "adjacent" else spans * per)


@compiled_only
def test_an_access_error_on_a_direct_qp_is_final_and_cools_no_rail(
    lib: Path, made: list[_Pair]
) -> None:
    """b unregisters a region a still has the rkey of: the direct QP's READ is refused by b's
    NIC (REM_ACCESS_ERR), an AccessViolation, not retried, and no rail cools down. The direct
    QP it ran on is taken down (its QP is in ERR) and connected again on a later request."""
    p = _Pair(lib, "compiled", ["rdma"])
    made.append(p)
    other = p.b.call("alloc", kind="numpy", size=1 << 20, seed=4)["addr"]
    p.write(4096)
    p.wait_direct()
    p.a.call("transfer", op="read", peer=p.b.segment, local=p.addr_a, remote=other, length=4096)
    before = _carried(p.stats())[1]
    p.b.call("unregister", addr=other)
    with pytest.raises(AssertionError, match="AccessViolation: the peer's NIC refused access"):
        p.a.call("transfer", op="read", peer=p.b.segment, local=p.addr_a, remote=other,
                 length=4096)  # fmt: skip
    stats = p.stats()
    assert not any(v["cooling"] for v in stats.values()), stats
    assert sum(not v["direct"] for v in stats.values()) == 1, stats  # the one it ran on
    assert _carried(stats)[1] == before
    p.wait_direct()  # and it comes back
    p.write(1 << 20)
    assert p.same(1 << 20)


@compiled_only
def test_a_direct_qp_owing_a_completion_fails_over_within_the_deadline(
    lib: Path, made: list[_Pair]
) -> None:
    """b's ports go down after the direct QPs connected, and a's NIC would report the lost WRs
    only after retrying for minutes (retry scale 100): the direct QP's wait ends at
    ``rail_timeout`` (1 s), its rail cools down, and the request completes within its deadline
    on the next rails and then tcp; the direct QP it ran on is taken down."""
    p = _Pair(lib, "compiled", ["rdma", "tcp"], retry_scale=100.0, rail_timeout=1.0)
    made.append(p)
    p.write(4096)
    p.wait_direct()
    downs = [fib.port_down_file(p.fabric, 2, nic) for nic in ("mlx5_0", "mlx5_1")]
    try:
        for f in downs:
            f.touch()
        p.b.call("fill", addr=p.addr_b, length=4096, seed=9)
        t0 = time.monotonic()
        p.write(4096)
        took = time.monotonic() - t0
    finally:
        for f in downs:
            f.unlink(missing_ok=True)
    assert p.same(4096)
    assert took < 15, took
    stats = p.stats()
    assert any(v["cooling"] and not v["direct"] for v in stats.values()), stats


THREADS = """
import random, threading, time
import numpy as np
from mooncake_connectors.config import EngineConfig
from mooncake_connectors.transfer_core.engine import TransferEngine, TransferRequest
from mooncake_connectors.types import TransferOp
cfg = EngineConfig(metadata="memory", transports=("rdma",),
                   transport_settings={"rdma": {"gid_index": 3}}, timeout=20)
with TransferEngine(cfg) as eng:
    rdma = next(t for t in eng.transports if t.name == "rdma")
    span = 32 << 20
    buf = eng.allocate_buffer(2 * span)
    mem = buf.array
    seg = eng.segment_name
    eng.write(seg, buf.addr, buf.addr + span, 4096)
    end = time.monotonic() + 20
    while not all(r.direct is not None and r.direct.state == 2 for r in rdma._peers[seg].rails):
        assert time.monotonic() < end, "direct QPs not connected"
        eng.write(seg, buf.addr, buf.addr + span, 4096)
        time.sleep(0.02)
    bad = []
    def worker(k):
        rnd = random.Random(k)
        base = k * (span // 4)
        for i in range(60):
            n = rnd.choice([1, 4096, 65537, 1 << 20, 3 << 20])
            off = base + rnd.randrange(0, span // 4 - n)
            mem[off:off + n] = rnd.randrange(256)
            op = rnd.choice([TransferOp.WRITE, TransferOp.READ])
            if op is TransferOp.READ:
                mem[span + off:span + off + n] = rnd.randrange(256)
            eng.transfer([TransferRequest(op, seg, buf.addr + off, buf.addr + span + off, n)])
            if not np.array_equal(mem[off:off + n], mem[span + off:span + off + n]):
                bad.append((k, i, n))
    ts = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in ts: t.start()
    for t in ts: t.join(120)
    rails = rdma._peers[seg].rails
    print("bad", bad)
    print("direct", sum(r.direct_carried for r in rails) > 0)
"""


@compiled_only
def test_threads_share_direct_qps_and_every_byte_lands(lib: Path) -> None:
    """Four threads of one engine write and read at once: a direct QP is one caller's at a
    time, the others take another one or the rails; every request's bytes are right."""
    out = _child(lib, "compiled", THREADS).splitlines()
    assert out == ["bad []", "direct True"], out


ASYNC = """
import random, time
from mooncake_connectors.config import EngineConfig
from mooncake_connectors.transfer_core.engine import TransferEngine, TransferRequest
from mooncake_connectors.types import TransferOp
cfg = EngineConfig(metadata="memory", transports=("rdma",),
                   transport_settings={"rdma": {"gid_index": 3}}, timeout=20)
with TransferEngine(cfg) as eng:
    rdma = next(t for t in eng.transports if t.name == "rdma")
    span, block, n = 16 << 20, 32 << 10, 256
    buf = eng.allocate_buffer(2 * span)
    mem = buf.array
    seg = eng.segment_name
    end = time.monotonic() + 20
    eng.write(seg, buf.addr, buf.addr + span, 4096)
    while not all(r.direct is not None and r.direct.state == 2 for r in rdma._peers[seg].rails):
        assert time.monotonic() < end, "direct QPs not connected"
        eng.write(seg, buf.addr, buf.addr + span, 4096)
        time.sleep(0.02)
    rails = rdma._peers[seg].rails
    def batch(seed, base):
        rnd = random.Random(seed)
        remote = list(range(n))
        rnd.shuffle(remote)
        for i in range(n):
            mem[base + i * block:base + (i + 1) * block] = rnd.randrange(256)
        return [TransferRequest(TransferOp.WRITE, seg, buf.addr + base + i * block,
                                buf.addr + span + base + j * block, block)
                for i, j in enumerate(remote)], remote
    def check(base, remote):
        return all((mem[base + i * block:base + (i + 1) * block] ==
                    mem[span + base + j * block:span + base + (j + 1) * block]).all()
                   for i, j in enumerate(remote))
    before = sum(r.direct_carried for r in rails)
    reqs, remote = batch(1, 0)
    b = eng.submit(reqs)
    b.wait(20)
    b.raise_for_status()
    wrs = n - sum(remote[i + 1] == remote[i] + 1 for i in range(n - 1))  # (adjacent: coalesced)
    print("one", check(0, remote), sum(r.direct_carried for r in rails) - before == wrs)
    # two at once: the direct thread takes one, the rails the other (or both, in turn)
    (r1, m1), (r2, m2) = batch(2, 0), batch(3, 8 << 20)
    b1, b2 = eng.submit(r1), eng.submit(r2)
    for b in (b1, b2):
        b.wait(20)
        b.raise_for_status()
    print("two", check(0, m1), check(8 << 20, m2))
"""


@compiled_only
def test_an_asynchronous_batch_goes_on_direct_qps_from_their_thread(lib: Path) -> None:
    """``engine.submit`` of 256 shuffled blocks returns at once; the transport's direct thread
    posts them on the direct QPs and reports them (a WR each, two adjacent ones one WR), every
    block where it says; two
    batches at once both complete right, the second on the rails while the thread is busy."""
    out = _child(lib, "compiled", ASYNC).splitlines()
    assert out == ["one True True", "two True True"], out
