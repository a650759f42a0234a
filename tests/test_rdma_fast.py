"""The rdma transport's compiled data path (``_rdma_fast``: WRs chained in C, one doorbell per
rail, CQs polled in C) and the pyverbs path (``MOONCAKE_CONNECTORS_PURE_PYTHON=1``), over the
real pyverbs and the emulated NIC (tests/fake_ibverbs): the same contract, the same errors.

The compiled cases are skipped where ``_rdma_fast`` is not built (no C compiler or no
libibverbs-dev at install); scripts/test also runs the other rdma suites with the pure path."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import fake_ibverbs_lib as fib
import pytest
from helpers import Peer

from mooncake_connectors.transfer_core.metadata.http import MetadataHTTPServer

pytest.importorskip("pyverbs.device", reason="pyverbs (python3-pyverbs) does not import here")
if fib.missing():
    pytest.skip(f"cannot build the fake libibverbs: {fib.missing()}", allow_module_level=True)

ROOT = Path(__file__).resolve().parent.parent
DEVS = "mlx5_0:roce:4096,mlx5_1:roce:4096"
PURE = "MOONCAKE_CONNECTORS_PURE_PYTHON"
BLOCK = 32 * 1024


def _built() -> bool:
    try:
        from mooncake_connectors.transfer_core.transports.rdma import _rdma_fast  # noqa: F401
    except ImportError:
        return False
    return True


PATHS = [
    pytest.param(
        "compiled",
        marks=pytest.mark.skipif(not _built(), reason="_rdma_fast is not built here"),
    ),
    "python",
]


def _pure_env(path: str) -> dict[str, str]:
    return {PURE: "1" if path == "python" else "0"}


@pytest.fixture(scope="module")
def lib() -> Path:
    return fib.build()


def _child(lib: Path, path: str, code: str) -> str:
    fabric = fib.new_fabric()
    try:
        out = subprocess.run(
            [sys.executable, "-c", code],
            env={**fib.env(lib, DEVS, fabric, 1), "PYTHONPATH": str(ROOT), **_pure_env(path)},
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        fib.drop_fabric(fabric)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


NIC_CODE = """
import ctypes
from mooncake_connectors.errors import TransportBroken
from mooncake_connectors.transfer_core.transports.rdma.verbs import QpAddr, Verbs
v = Verbs("pyverbs")
a, b = v.open("mlx5_0", 1, 3), v.open("mlx5_1", 1, 3)
print("compiled", a.compiled)
n = 1 << 20
src = ctypes.create_string_buffer((bytes(range(251)) * (n // 251 + 1))[:n], n)
dst = ctypes.create_string_buffer(n)
S, D = ctypes.addressof(src), ctypes.addressof(dst)
ma, mb = a.reg_mr(S, n, v.REMOTE_ACCESS), b.reg_mr(D, n, v.REMOTE_ACCESS)
keep = []  # pyverbs destroys a QP it no longer holds: the peer's must live on
def pair(depth):
    qa, qb = a.create_qp(depth), b.create_qp(depth)
    keep.append(qb)
    a.connect(qa, QpAddr(qb.qp_num, 7, b.gid, b.lid), 5)
    b.connect(qb, QpAddr(qa.qp_num, 5, a.gid, a.lid), 7)
    return qa
def polled(k):
    got = []
    for _ in range(1000):
        got += a.poll(16)
        if len(got) >= k:
            break
    return [(c.wr_id, c.status) for c in got]
qa = pair(64)
# two runs of 64 KiB WRs (8 + 7.5), one chain: bytes land, one completion per signalled run
half = n // 2
runs = [(1, S, ma.lkey, D, mb.rkey, half, 65536, True),
        (2, S + half, ma.lkey, D + half, mb.rkey, half - 32768, 65536, True)]
print("posted", a.post_runs(qa, True, runs))
print("wc", polled(2))
print("bytes", dst.raw[: n - 32768] == src.raw[: n - 32768], dst.raw[n - 32768:] == bytes(32768))
ctypes.memset(S, 0, n)
print("read", a.post_runs(qa, False, [(3, S, ma.lkey, D, mb.rkey, half, 65536, True)]),
      polled(1), src.raw[:half] == dst.raw[:half])
# a bad rkey, then past the peer MR's end: REM_ACCESS_ERR (10), the QP in ERR flushes (5)
a.post_runs(qa, True, [(4, S, ma.lkey, D, mb.rkey ^ 0x100, 4096, 4096, True)])
print("badkey", polled(1))
a.post_runs(qa, True, [(5, S, ma.lkey, D, mb.rkey, 4096, 4096, True)])
print("flushed", polled(1))
qa = pair(64)
a.post_runs(qa, True, [(6, S, ma.lkey, D + n - 4096, mb.rkey, 8192, 8192, True)])
print("past", polled(1))
# a bad lkey: LOC_PROT_ERR (4)
qa = pair(64)
a.post_runs(qa, True, [(7, S, ma.lkey ^ 0x100, D, mb.rkey, 4096, 4096, True)])
print("badlkey", polled(1))
# a QP never connected (RESET): the post itself is refused
q = a.create_qp(16)
try:
    a.post_runs(q, True, [(8, S, ma.lkey, D, mb.rkey, 4096, 4096, True)])
except TransportBroken as exc:
    print("reset", str(exc).split(":")[0])
# a send queue of 16 holds 16 WRs until a completion frees them: the 17th is refused
qa = pair(16)
for i in range(16):
    a.post_runs(qa, True, [(100 + i, S, ma.lkey, D, mb.rkey, 4096, 4096, i == 15)])
try:
    a.post_runs(qa, True, [(200, S, ma.lkey, D, mb.rkey, 4096, 4096, True)])
except TransportBroken as exc:
    print("full", str(exc).split(":")[0])
print("drained", polled(1))
print("again", a.post_runs(qa, True, [(201, S, ma.lkey, D, mb.rkey, 4096, 4096, True)]), polled(1))
"""


@pytest.mark.parametrize("path", PATHS)
def test_both_paths_post_chains_and_meet_the_nic_checks_alike(lib: Path, path: str) -> None:
    """Through verbs.Nic (pyverbs) or fastverbs.FastNic (compiled): the same runs, the same
    completions, the same statuses for a bad rkey, a range past the MR, a bad lkey and a QP in
    ERR, the same refusal of a post on an unconnected QP and on a full send queue."""
    out = _child(lib, path, NIC_CODE).splitlines()
    want = [
        f"compiled {path == 'compiled'}",
        "posted 2",
        "wc [(1, 0), (2, 0)]",
        "bytes True True",
        "read 1 [(3, 0)] True",
        "badkey [(4, 10)]",
        "flushed [(5, 5)]",
        "past [(6, 10)]",
        "badlkey [(7, 4)]",
        "reset post_send on mlx5_0 failed",
        "full post_send on mlx5_0 failed",
        "drained [(115, 0)]",
        "again 1 [(201, 0)]",
    ]
    assert out == want, out


class _Pair:
    def __init__(
        self,
        lib: Path,
        path_a: str,
        path_b: str,
        transports: tuple[str, ...] = ("rdma",),
        retry_scale: float = 0.01,
        engine: dict[str, object] | None = None,
        **rdma: object,
    ) -> None:
        self.fabric = fib.new_fabric()
        self.srv = MetadataHTTPServer("127.0.0.1", 0).start()
        self.peers = [
            Peer(
                env={**fib.env(lib, DEVS, self.fabric, host, retry_scale), **_pure_env(path)},
                metadata=self.srv.url,
                transports=list(transports),
                transport_settings={"rdma": {"gid_index": 3, "rail_timeout": 2.0, **rdma}},
                **{"timeout": 10, **(engine or {})},
            )
            for host, path in ((1, path_a), (2, path_b))
        ]
        self.a, self.b = self.peers
        self.span = 16 << 20
        self.addr_a = self.a.call("alloc", kind="numpy", size=self.span, seed=1)["addr"]
        self.addr_b = self.b.call("alloc", kind="numpy", size=self.span, seed=2)["addr"]

    def sha(self, p: Peer, addr: int, n: int) -> str:
        return str(p.call("digest", addr=addr, length=n)["sha"])

    def close(self) -> None:
        for p in self.peers:
            p.close()
        self.srv.stop()
        fib.drop_fabric(self.fabric)


@pytest.fixture
def made() -> Iterator[list[_Pair]]:
    pairs: list[_Pair] = []
    yield pairs
    for p in pairs:
        p.close()


@pytest.mark.parametrize("path", PATHS)
def test_kv_block_scatter_adjacent_and_shuffled(lib: Path, made: list[_Pair], path: str) -> None:
    """A vLLM-shaped batch: 4 (layer, K/V) spans of 48 blocks of 32 KiB, adjacent on both sides
    (coalesced into runs) and then shuffled on the remote side (no two adjacent); every byte
    lands where its block says, both ways, and the rails carried them."""
    p = _Pair(lib, path, path)
    made.append(p)
    compiled = p.a.call("rdma_compiled")["compiled"]
    assert set(compiled.values()) == {path == "compiled"}, compiled
    spans, per = 4, 48
    order = list(range(per))
    shuffled = order[7:] + order[:7]
    shuffled[::2] = shuffled[::2][::-1]
    for remote_order in (order, shuffled):
        blocks = [
            (p.addr_a + (s * per + i) * BLOCK, p.addr_b + (s * per + j) * BLOCK, BLOCK)
            for s in range(spans)
            for i, j in zip(order, remote_order, strict=True)
        ]
        p.a.call("batch", op="write", peer=p.b.segment, blocks=blocks)
        for lo, ro, n in blocks[:: len(blocks) // 12]:
            assert p.sha(p.a, lo, n) == p.sha(p.b, ro, n)
        # and back: the peer's blocks read into a fresh local range
        back = [(lo + spans * per * BLOCK, ro, n) for lo, ro, n in blocks]
        p.a.call("batch", op="read", peer=p.b.segment, blocks=back)
        for lo, ro, n in back[:: len(back) // 12]:
            assert p.sha(p.a, lo, n) == p.sha(p.b, ro, n)
    stats = p.a.call("rail_stats", peer=p.b.segment)["stats"]
    assert sum(v["carried"] for v in stats.values()) > 0, stats


@pytest.mark.parametrize(("path_a", "path_b"), [("compiled", "python"), ("python", "compiled")])
def test_a_compiled_end_and_a_pyverbs_end_interoperate(
    lib: Path, made: list[_Pair], path_a: str, path_b: str
) -> None:
    if not _built():
        pytest.skip("_rdma_fast is not built here")
    p = _Pair(lib, path_a, path_b)
    made.append(p)
    for size in (1, 65537, 3 << 20):
        p.a.call("transfer", op="write", peer=p.b.segment, local=p.addr_a, remote=p.addr_b,
                 length=size)  # fmt: skip
        assert p.sha(p.a, p.addr_a, size) == p.sha(p.b, p.addr_b, size)
    p.b.call("transfer", op="read", peer=p.a.segment, local=p.addr_b + (4 << 20),
             remote=p.addr_a, length=3 << 20)  # fmt: skip
    assert p.sha(p.b, p.addr_b + (4 << 20), 3 << 20) == p.sha(p.a, p.addr_a, 3 << 20)


@pytest.mark.parametrize("path", PATHS)
def test_out_of_bounds_is_the_same_clear_error_on_both_paths(
    lib: Path, made: list[_Pair], path: str
) -> None:
    """A remote range past the peer's region is refused before any WR (AccessViolation), and
    the rails stay usable for the next request."""
    p = _Pair(lib, path, path)
    made.append(p)
    with pytest.raises(
        AssertionError, match=r"AccessViolation: .* is not inside a registered region"
    ):
        p.a.call("transfer", op="write", peer=p.b.segment, local=p.addr_a,
                 remote=p.addr_b + p.span - 4096, length=8192)  # fmt: skip
    p.a.call("transfer", op="write", peer=p.b.segment, local=p.addr_a, remote=p.addr_b,
             length=1 << 20)  # fmt: skip
    assert p.sha(p.a, p.addr_a, 1 << 20) == p.sha(p.b, p.addr_b, 1 << 20)
