"""One contract, run unchanged over every registered transport.

The target is another process (helpers.Peer); the initiator is an engine in this process that
has only the transport under test enabled. Both kinds of target memory are covered: memfd-backed
buffers and plain numpy arrays (for shm: mapping vs process_vm). ``tcp+tls`` is tcp over mutual
TLS, both sides holding certificates from ``certs init``.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from fake_cuda import FakeCuda, ensure_cuda_ipc_registered
from helpers import Peer, pattern

from mooncake_connectors import certs
from mooncake_connectors.config import EngineConfig
from mooncake_connectors.errors import AccessViolation, SegmentNotFound
from mooncake_connectors.transfer_core import TransferEngine, TransferRequest, cuda_driver
from mooncake_connectors.transfer_core.metadata.http import MetadataHTTPServer
from mooncake_connectors.transfer_core.transport import TRANSPORTS
from mooncake_connectors.types import TransferOp, TransferStatus

SLICE = 64 * 1024  # small slices so moderate sizes exercise slicing
SPAN = 8 * 1024 * 1024
# rdma runs on the test-only fake of the pyverbs objects (tests/fake_verbs.py): no RDMA device here
SETTINGS: dict[str, dict[str, Any]] = {"rdma": {"verbs": "fake_verbs"}}
GPU_KINDS = {"memfd": "cuda", "numpy": "cuda_vmm", "readonly": "cuda_readonly"}
ensure_cuda_ipc_registered()


class DeviceBuffer:
    """SPAN bytes of (fake) GPU memory, registered as cuda:0, with an array view for checks."""

    def __init__(self, fake: FakeCuda, engine: TransferEngine) -> None:
        self.addr = fake.device_alloc(SPAN)
        self.array: Any = fake.array(self.addr, SPAN)
        engine.register_raw(self.addr, SPAN, location="cuda:0")


class Link:
    def __init__(
        self, engine: TransferEngine, peer: Peer, remote: dict[str, int], local: Any
    ) -> None:
        self.engine = engine
        self.peer = peer
        self.remote = remote  # kind -> address of a SPAN-byte peer buffer
        self.local = local

    def digest(self, addr: int, n: int) -> str:
        return self.peer.call("digest", addr=addr, length=n)["sha"]


@pytest.fixture(scope="module", params=[*TRANSPORTS.names(), "tcp+tls"])
def link(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Link]:
    name = request.param
    tls: dict[str, str] = {}
    if name == "tcp+tls":
        name = "tcp"
        p = certs.init(tmp_path_factory.mktemp("certs"), ("target", "initiator"))
        tls = {"tls_ca": str(p["ca"])}
    mine = {"tls_cert": str(p["initiator"]), "tls_key": str(p["initiator-key"])} if tls else {}
    theirs = {"tls_cert": str(p["target"]), "tls_key": str(p["target-key"])} if tls else {}
    settings = {name: SETTINGS[name]} if name in SETTINGS else {}
    # cuda_ipc runs on the fake driver, both here and in the peer, over GPU memory on both ends:
    # "memfd" is then a plain device allocation (IPC handle) and "numpy" a VMM one (fd export).
    gpu = name == "cuda_ipc"
    kinds = GPU_KINDS if gpu else {k: k for k in GPU_KINDS}
    fake = FakeCuda() if gpu else None
    prev = cuda_driver.install(fake) if gpu else None
    srv = MetadataHTTPServer("127.0.0.1", 0).start()
    peer = Peer(
        metadata=srv.url,
        transports=[name],
        transport_settings=settings,
        **({"fake_cuda": True} if gpu else {}),
        **tls,
        **theirs,
    )
    engine = TransferEngine(
        EngineConfig(
            metadata=srv.url,
            transports=(name,),
            transport_settings=settings,
            slice_size=SLICE,
            timeout=20,
            **tls,
            **mine,
        )
    ).start()
    remote = {
        k: peer.call("alloc", kind=kinds[k], size=SPAN, seed=i)["addr"]
        for i, k in enumerate(("memfd", "numpy"))
    }
    remote["readonly"] = peer.call("alloc", kind=kinds["readonly"], size=4096, seed=9)["addr"]
    local = DeviceBuffer(fake, engine) if fake is not None else engine.allocate_buffer(SPAN)
    yield Link(engine, peer, remote, local)
    engine.close()
    peer.close()
    srv.stop()
    if gpu:
        cuda_driver.install(prev)
        assert fake is not None
        fake.close()


def sha(a: Any) -> str:
    return hashlib.sha256(bytes(a)).hexdigest()


SIZES = [0, 1, 7, 4095, 4096, 65537, (1 << 20) + 3, 3 * SLICE + 5]


@pytest.mark.parametrize("kind", ["memfd", "numpy"])
@pytest.mark.parametrize("size", SIZES)
def test_write_then_read_back(link: Link, kind: str, size: int) -> None:
    e, seg, remote = link.engine, link.peer.segment, link.remote[kind]
    src = pattern(size + 11, size)
    link.local.array[5 : 5 + size] = src
    # unaligned on both sides
    e.write(seg, link.local.addr + 5, remote + 3, size)
    assert link.digest(remote + 3, size) == sha(src)
    link.local.array[:] = 0
    e.read(seg, link.local.addr + 1, remote + 3, size)
    assert sha(link.local.array[1 : 1 + size]) == sha(src)


def test_batch_of_mixed_requests(link: Link) -> None:
    e, seg = link.engine, link.peer.segment
    rng = np.random.default_rng(1)
    base = link.remote["numpy"]
    expected = pattern(1, SPAN)
    link.local.array[:] = expected
    e.write(seg, link.local.addr, base, SPAN)  # known remote contents, whatever ran before
    link.local.array[:] = 0
    reqs, spots = [], []
    off = 0
    for _ in range(100):
        n = int(rng.integers(1, 30000))
        reqs.append(TransferRequest(TransferOp.READ, seg, link.local.addr + off, base + off, n))
        spots.append((off, n))
        off += n + int(rng.integers(0, 100))
    batch = e.submit(reqs)
    assert batch.wait(20)
    assert batch.statuses == [TransferStatus.COMPLETED] * 100
    for o, n in spots:
        assert np.array_equal(link.local.array[o : o + n], expected[o : o + n])


def test_async_submit_many_slices(link: Link) -> None:
    e, seg, remote = link.engine, link.peer.segment, link.remote["memfd"]
    data = pattern(77, 4 * 1024 * 1024)
    link.local.array[: data.size] = data
    batch = e.submit([TransferRequest(TransferOp.WRITE, seg, link.local.addr, remote, data.size)])
    assert batch.wait(20)
    batch.raise_for_status()
    assert link.digest(remote, data.size) == sha(data)


def test_concurrent_threads(link: Link) -> None:
    e, seg, remote = link.engine, link.peer.segment, link.remote["memfd"]
    chunk = 128 * 1024  # 4 threads x 10 ops x 128 KiB = 5 MiB: disjoint, inside SPAN
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            for k in range(10):
                o = (t * 10 + k) * chunk
                link.local.array[o : o + chunk] = (t * 31 + k) % 251
                e.write(seg, link.local.addr + o, remote + o, chunk)
                e.read(seg, link.local.addr + o, remote + o, chunk)
                if not (link.local.array[o : o + chunk] == (t * 31 + k) % 251).all():
                    raise AssertionError(f"thread {t} op {k} read back other bytes")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors


def test_bad_requests_fail_cleanly_and_link_survives(link: Link) -> None:
    e, seg, remote = link.engine, link.peer.segment, link.remote["memfd"]
    with pytest.raises(AccessViolation):
        e.read(seg, link.local.addr, remote + SPAN - 10, 100)  # past the remote region
    with pytest.raises(AccessViolation):
        e.write(seg, link.local.addr, link.remote["readonly"], 16)  # read-only remote
    with pytest.raises(AccessViolation):
        e.read(seg, 4096, remote, 16)  # local memory not registered
    with pytest.raises(SegmentNotFound):
        e.read("127.0.0.1:1", link.local.addr, remote, 16)
    batch = e.submit(
        [
            TransferRequest(TransferOp.READ, seg, link.local.addr, remote, 64),
            TransferRequest(TransferOp.READ, seg, link.local.addr, remote + SPAN, 64),
        ]
    )
    assert batch.wait(10)
    assert batch.statuses == [TransferStatus.COMPLETED, TransferStatus.FAILED]
    assert isinstance(batch.errors[1], AccessViolation)
    e.read(seg, link.local.addr, remote, 4096)  # still serving
    assert sha(link.local.array[:4096]) == link.digest(remote, 4096)


@pytest.mark.parametrize("kind", ["memfd", "numpy"])
def test_run_in_this_thread_reports_each_request(link: Link, kind: str) -> None:
    # engine.run: a batch driven from the caller's thread (shm: one process_vm call for all of
    # a peer's plain memory), each request's outcome on the Batch; one refused request in the
    # middle of READs and WRITEs fails alone and lands nowhere.
    e, seg, base = link.engine, link.peer.segment, link.remote[kind]
    n, count = 3000, 40
    written = pattern(21, n * count)
    link.local.array[: written.size] = written
    writes = [
        TransferRequest(TransferOp.WRITE, seg, link.local.addr + i * n, base + i * n, n)
        for i in range(count)
    ]
    refused = TransferRequest(TransferOp.WRITE, seg, link.local.addr, link.remote["readonly"], 16)
    batch = e.run([*writes[:20], refused, *writes[20:]], timeout=20)
    assert batch.done()
    assert (
        batch.statuses
        == [TransferStatus.COMPLETED] * 20
        + [TransferStatus.FAILED]
        + [TransferStatus.COMPLETED] * 20
    )
    assert isinstance(batch.errors[20], AccessViolation)
    assert link.digest(base, n * count) == sha(written)
    assert link.digest(link.remote["readonly"], 16) != sha(written[:16])
    link.local.array[: written.size] = 0
    reads = [
        TransferRequest(TransferOp.READ, seg, link.local.addr + i * n, base + i * n, n)
        for i in range(count)
    ]
    past_end = TransferRequest(TransferOp.READ, seg, link.local.addr, base + SPAN - 8, 64)
    batch = e.run([past_end, *reads], timeout=20)
    assert batch.statuses == [TransferStatus.FAILED] + [TransferStatus.COMPLETED] * count
    assert isinstance(batch.errors[0], AccessViolation)
    assert sha(link.local.array[: written.size]) == sha(written)
