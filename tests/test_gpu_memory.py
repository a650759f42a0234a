"""GPU memory: registration checks, cuda_ipc handle lifetimes, host ends, tcp staging.

The CUDA driver is FakeCuda (tests/fake_cuda.py) in this process and in the peer process, put in
at our driver seam only; the engine, transports, staging pipe and wire protocol are the real ones.
"""

from __future__ import annotations

import hashlib
import signal
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from fake_cuda import FakeCuda, ensure_cuda_ipc_registered, installed
from helpers import Peer, pattern

from mooncake_connectors.config import EngineConfig
from mooncake_connectors.errors import (
    ConfigError,
    GpuUnavailable,
    NoPathAvailable,
    TransferTimeout,
)
from mooncake_connectors.transfer_core import TransferEngine, cuda_driver
from mooncake_connectors.transfer_core.metadata.http import MetadataHTTPServer
from mooncake_connectors.transfer_core.transports.staging import Staging

MIB = 1 << 20
STAGING = {"staging_chunk": 64 * 1024, "staging_buffers": 3}
ensure_cuda_ipc_registered()


def sha(a: Any) -> str:
    return hashlib.sha256(bytes(a)).hexdigest()


@pytest.fixture
def fake() -> Iterator[FakeCuda]:
    with installed() as f:
        yield f


@pytest.fixture
def engine(fake: FakeCuda) -> Iterator[TransferEngine]:
    e = TransferEngine(EngineConfig(metadata="memory", transports=("cuda_ipc", "tcp"))).start()
    yield e
    e.close()


# -- registration ---------------------------------------------------------------------------
def test_device_memory_registers_and_publishes_its_export(
    fake: FakeCuda, engine: TransferEngine
) -> None:
    addr = fake.device_alloc(MIB)
    region = engine.register_raw(addr + 4096, 8192, location="cuda:0")
    assert (region.kind.value, region.device) == ("cuda", 0)
    with pytest.raises(Exception, match="GPU memory"):
        _ = region.mv  # never a memoryview over a device address
    assert engine.metadata is not None
    (desc,) = engine.metadata.lookup_segment(engine.segment_name).regions
    (export,) = desc.cuda_exports
    assert (desc.cuda_device, export.kind, export.alloc_offset) == (0, "ipc", 4096)
    assert (export.alloc_size, export.length, export.device_uuid) == (MIB, 8192, "fake-uuid-0")


def test_a_vmm_allocation_is_exported_as_an_fd(fake: FakeCuda, engine: TransferEngine) -> None:
    addr = fake.device_alloc(MIB, vmm=True)
    engine.register_raw(addr, MIB, location="cuda:0")
    assert engine.metadata is not None
    (desc,) = engine.metadata.lookup_segment(engine.segment_name).regions
    assert desc.cuda_exports[0].kind == "fd"


def test_the_driver_not_the_caller_says_what_memory_is(
    fake: FakeCuda, engine: TransferEngine
) -> None:
    host = np.zeros(4096, dtype=np.uint8)
    with pytest.raises(ConfigError, match=r"host .*memory to the CUDA driver"):
        engine.register_raw(int(host.ctypes.data), 4096, location="cuda:0")
    with pytest.raises(ConfigError, match=r"host .*memory to the CUDA driver"):
        engine.register(host, location="cuda:0")
    on_one = fake.device_alloc(4096, device=1)
    with pytest.raises(ConfigError, match="memory of cuda:1"):
        engine.register_raw(on_one, 4096, location="cuda:0")
    dev = fake.device_alloc(4096)
    with pytest.raises(ConfigError, match="is GPU memory of cuda:0"):
        engine.register_raw(dev, 4096)  # claimed to be host memory
    with pytest.raises(ConfigError, match=r"CUDA driver|memory of"):
        engine.register_raw(dev, 8192, location="cuda:0")  # runs off the allocation
    assert engine.local.regions() == []  # nothing refused was registered


def test_without_a_driver_a_gpu_registration_is_one_typed_error() -> None:
    prev = cuda_driver.install(None)  # the real loader; this CI host has no GPU driver
    try:
        e = TransferEngine(EngineConfig(metadata="memory", transports=("tcp",))).start()
        try:
            with pytest.raises(GpuUnavailable) as info:
                e.register_raw(1 << 40, 4096, location="cuda:0")
            assert "cuda-python" in info.value.message or "driver" in info.value.message
            assert e.local.regions() == []
        finally:
            e.close()
    finally:
        cuda_driver.install(prev)


def test_no_transport_moves_gpu_memory_shm_only(fake: FakeCuda) -> None:
    e = TransferEngine(EngineConfig(metadata="memory", transports=("shm",))).start()
    try:
        addr = fake.device_alloc(4096)
        e.register_raw(addr, 4096, location="cuda:0")
        buf = e.allocate_buffer(4096)
        with pytest.raises(NoPathAvailable, match="cuda memory here"):
            e.read(e.segment_name, addr, buf.addr, 16)
    finally:
        e.close()


# -- cuda_ipc between processes -------------------------------------------------------------
class Pair:
    def __init__(self, fake: FakeCuda, transports: tuple[str, ...]) -> None:
        self.fake = fake
        self.srv = MetadataHTTPServer("127.0.0.1", 0).start()
        settings = {"tcp": STAGING} if "tcp" in transports else {}
        self.peer = Peer(
            metadata=self.srv.url,
            transports=list(transports),
            transport_settings=settings,
            fake_cuda=True,
        )
        self.engine = TransferEngine(
            EngineConfig(
                metadata=self.srv.url,
                transports=transports,
                transport_settings=settings,
                timeout=20,
            )
        ).start()
        self.seg = self.peer.segment

    def alloc(self, kind: str, size: int, seed: int) -> int:
        return int(self.peer.call("alloc", kind=kind, size=size, seed=seed)["addr"])

    def digest(self, addr: int, n: int) -> str:
        return str(self.peer.call("digest", addr=addr, length=n)["sha"])

    def local_gpu(self, size: int) -> tuple[int, Any]:
        addr = self.fake.device_alloc(size)
        self.engine.register_raw(addr, size, location="cuda:0")
        return addr, self.fake.array(addr, size)

    def close(self) -> None:
        self.engine.close()
        self.peer.close()
        self.srv.stop()


@pytest.fixture
def ipc(fake: FakeCuda) -> Iterator[Pair]:
    p = Pair(fake, ("cuda_ipc",))
    yield p
    p.close()


def test_host_memory_to_and_from_a_peers_gpu(ipc: Pair, fake: FakeCuda) -> None:
    remote = ipc.alloc("cuda", MIB, seed=3)
    buf = ipc.engine.allocate_buffer(MIB)  # host memory here, GPU memory there
    ipc.engine.read(ipc.seg, buf.addr, remote + 5, MIB - 5)
    assert sha(buf.array[: MIB - 5]) == ipc.digest(remote + 5, MIB - 5)
    buf.array[:] = pattern(8, MIB)
    ipc.engine.write(ipc.seg, buf.addr, remote, MIB)
    assert ipc.digest(remote, MIB) == sha(buf.array)
    assert fake.calls.count("cuMemHostRegister") == 1  # pinned once, on first use


def test_gpu_memory_to_and_from_a_peers_host_memory(ipc: Pair, fake: FakeCuda) -> None:
    remote = ipc.alloc("memfd", MIB, seed=4)  # a memfd-backed host buffer there
    addr, arr = ipc.local_gpu(MIB)
    ipc.engine.read(ipc.seg, addr, remote, MIB)
    assert sha(arr) == ipc.digest(remote, MIB)
    arr[:] = pattern(9, MIB)
    ipc.engine.write(ipc.seg, addr + 1, remote + 2, 1000)
    assert ipc.digest(remote + 2, 1000) == sha(arr[1:1001])
    assert fake.calls.count("cuMemHostRegister") == 1  # the peer's pages, mapped and pinned


def test_exports_open_once_and_close_when_the_owner_unregisters(ipc: Pair, fake: FakeCuda) -> None:
    a = ipc.alloc("cuda", 64 * 1024, seed=1)
    b = ipc.alloc("cuda_vmm", 64 * 1024, seed=2)
    addr, arr = ipc.local_gpu(64 * 1024)
    for _ in range(3):
        ipc.engine.read(ipc.seg, addr, a, 4096)
        ipc.engine.read(ipc.seg, addr, b, 4096)
    assert sha(arr[:4096]) == ipc.digest(b, 4096)
    assert fake.calls.count("open_export") == 2 and fake.open_imports() == 2
    ipc.peer.call("unregister", addr=b)  # a new epoch: the peer's descriptor no longer lists b
    ipc.engine.read(ipc.seg, addr, a, 4096)
    assert fake.calls.count("close_export") == 1 and fake.open_imports() == 1
    ipc.engine.close()
    assert fake.open_imports() == 0  # closing the engine closes every handle it opened


# -- GPU memory over tcp, staged --------------------------------------------------------------
@pytest.fixture
def tcp(fake: FakeCuda) -> Iterator[Pair]:
    p = Pair(fake, ("tcp",))
    yield p
    p.close()


@pytest.mark.parametrize("size", [1, 65536, 65537, 5 * 65536 + 3, 3 * MIB + 7])
@pytest.mark.parametrize("remote_kind", ["cuda", "memfd"])
def test_gpu_memory_over_tcp_round_trips(
    tcp: Pair, fake: FakeCuda, size: int, remote_kind: str
) -> None:
    remote = tcp.alloc(remote_kind, 4 * MIB, seed=size % 251)
    addr, arr = tcp.local_gpu(4 * MIB)
    tcp.engine.read(tcp.seg, addr + 3, remote + 1, size)
    assert sha(arr[3 : 3 + size]) == tcp.digest(remote + 1, size)
    arr[:] = pattern(size % 13, 4 * MIB)
    tcp.engine.write(tcp.seg, addr, remote + 5, size)
    assert tcp.digest(remote + 5, size) == sha(arr[:size])


def test_host_memory_to_a_gpu_over_tcp_is_staged_by_the_target(tcp: Pair) -> None:
    remote = tcp.alloc("cuda", MIB, seed=6)
    buf = tcp.engine.allocate_buffer(MIB)
    tcp.engine.read(tcp.seg, buf.addr, remote, MIB)
    assert sha(buf.array) == tcp.digest(remote, MIB)
    buf.array[:] = pattern(2, MIB)
    tcp.engine.write(tcp.seg, buf.addr, remote, MIB)
    assert tcp.digest(remote, MIB) == sha(buf.array)
    calls = tcp.peer.call("fake_calls")["calls"]
    assert calls.get("cuMemHostAlloc") == STAGING["staging_buffers"]  # the pool, once


def test_staging_pool_is_allocated_once_for_many_requests(tcp: Pair, fake: FakeCuda) -> None:
    remote = tcp.alloc("memfd", MIB, seed=7)
    addr, arr = tcp.local_gpu(MIB)
    for k in range(20):
        tcp.engine.write(tcp.seg, addr + k, remote, 200_000)
    assert tcp.digest(remote, 200_000) == sha(arr[19 : 19 + 200_000])
    assert fake.calls.count("cuMemHostAlloc") == STAGING["staging_buffers"]


# -- the pipeline itself ----------------------------------------------------------------------
def test_device_to_host_copies_run_ahead_of_the_send(fake: FakeCuda) -> None:
    st = Staging(4096, 3)
    src = fake.device_alloc(10 * 4096)
    fake.array(src, 10 * 4096)[:] = pattern(1, 10 * 4096)
    sent: list[bytes] = []
    queued_at_send: list[int] = []

    def send(chunk: memoryview) -> None:
        queued_at_send.append(fake.calls.count("cuMemcpyAsync"))
        sent.append(bytes(chunk))

    st.pipe(0).to_network(src, 10 * 4096 - 5, send, deadline=_soon())
    assert b"".join(sent) == bytes(fake.array(src, 10 * 4096 - 5))
    # chunk i goes out while the copies of chunks i+1, i+2 are already queued
    assert queued_at_send == [3, 4, 5, 6, 7, 8, 9, 10, 10, 10]
    st.release_thread()
    st.close()


def test_host_to_device_copies_run_behind_the_receive(fake: FakeCuda) -> None:
    st = Staging(4096, 2)
    dst = fake.device_alloc(5 * 4096)
    data = pattern(2, 5 * 4096)
    queued_at_recv: list[int] = []
    chunks = iter(range(5))

    def recv(chunk: memoryview) -> None:
        queued_at_recv.append(fake.calls.count("cuMemcpyAsync"))
        i = next(chunks)
        chunk[:] = data[i * 4096 : i * 4096 + len(chunk)].tobytes()

    st.pipe(0).from_network(dst, 5 * 4096, recv, deadline=_soon())
    assert bytes(fake.array(dst, 5 * 4096)) == data.tobytes()
    assert queued_at_recv == [0, 1, 2, 3, 4]  # chunk i lands while i-1 is still being copied
    assert fake.calls.count("cuMemHostAlloc") == 2
    st.release_thread()
    st.close()


def _soon() -> float:
    import time

    return time.monotonic() + 10


def test_a_stopped_target_times_out_a_staged_gpu_read_and_the_path_recovers(tcp: Pair) -> None:
    remote = tcp.alloc("cuda", MIB, seed=12)
    addr, arr = tcp.local_gpu(MIB)
    tcp.engine.read(tcp.seg, addr, remote, 4096)  # the staging workers are connected
    tcp.peer.signal(signal.SIGSTOP)
    try:
        with pytest.raises(TransferTimeout):
            tcp.engine.read(tcp.seg, addr, remote, MIB, timeout=1.0)
    finally:
        tcp.peer.signal(signal.SIGCONT)
    tcp.engine.read(tcp.seg, addr, remote, MIB)  # the aborted connection was replaced
    assert sha(arr) == tcp.digest(remote, MIB)
