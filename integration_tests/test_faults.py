"""Faults with real processes: dead and frozen peers, broken connections, failover, etcd down."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import signal
import time
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest
from helpers import EtcdServer, Peer, free_port, pattern

from mooncake_connectors.config import EngineConfig
from mooncake_connectors.errors import TransferError, TransferTimeout, TransportBroken
from mooncake_connectors.transfer_core import TransferEngine, TransferRequest, metrics
from mooncake_connectors.transfer_core.metadata.http import MetadataHTTPServer
from mooncake_connectors.types import TransferOp, TransferStatus

MiB = 1 << 20


@pytest.fixture
def meta() -> Iterator[MetadataHTTPServer]:
    srv = MetadataHTTPServer("127.0.0.1", 0).start()
    yield srv
    srv.stop()


def retries(transport: str) -> float:
    return float(metrics.RETRIES.labels(transport)._value.get())


def engine(meta_url: str, **kw: object) -> TransferEngine:
    cfg = EngineConfig(metadata=meta_url, **kw)  # type: ignore[arg-type]
    return TransferEngine(cfg).start()


def test_killed_peer_fails_within_deadline(meta: MetadataHTTPServer) -> None:
    peer = Peer(metadata=meta.url, transports=["tcp"])
    e = engine(meta.url, transports=("tcp",), timeout=3.0, backoff_initial=0.05)
    try:
        remote = peer.call("alloc", kind="numpy", size=64 * MiB)["addr"]
        buf = e.allocate_buffer(64 * MiB)
        e.read(peer.segment, buf.addr, remote, MiB)  # connected and working
        reqs = [
            TransferRequest(
                TransferOp.READ, peer.segment, buf.addr + i * MiB, remote + i * MiB, MiB
            )
            for i in range(64)
        ]
        batch = e.submit(reqs)
        peer.kill()
        t0 = time.monotonic()
        assert batch.wait(10), "batch did not finish after the peer died"
        assert time.monotonic() - t0 < 5
        # requests that ran before the kill may have completed; none may hang
        assert TransferStatus.PENDING not in batch.statuses
        t0 = time.monotonic()
        with pytest.raises(TransferError) as info:
            e.read(peer.segment, buf.addr, remote, MiB, timeout=2.0)
        assert time.monotonic() - t0 < 4
        assert info.value.peer == peer.segment  # the error names the peer...
        assert "tcp" in str(info.value)  # ...and the path
    finally:
        e.close()
        peer.close()


def test_frozen_peer_times_out_over_tcp_but_shm_is_one_sided(meta: MetadataHTTPServer) -> None:
    peer = Peer(metadata=meta.url, transports=["shm", "tcp"])
    tcp = engine(meta.url, transports=("tcp",), timeout=30)
    shm = engine(meta.url, transports=("shm",), timeout=30)
    try:
        remote = peer.call("alloc", kind="numpy", size=4 * MiB, seed=5)["addr"]
        b1, b2 = tcp.allocate_buffer(4 * MiB), shm.allocate_buffer(4 * MiB)
        tcp.read(peer.segment, b1.addr, remote, MiB)
        shm.read(peer.segment, b2.addr, remote, MiB)
        peer.signal(signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(TransferTimeout):
            tcp.read(peer.segment, b1.addr, remote, 4 * MiB, timeout=1.0)
        assert time.monotonic() - t0 < 3.5  # 1 s deadline + watchdog period + a loaded machine
        # async path too: the watchdog fails it and tears the lane down
        batch = tcp.submit(
            [TransferRequest(TransferOp.READ, peer.segment, b1.addr, remote, 4 * MiB)], timeout=1.0
        )
        assert batch.wait(3.0)
        assert batch.statuses == [TransferStatus.TIMEOUT]
        # shm needs nothing from the target's CPU: a stopped process is still readable
        shm.read(peer.segment, b2.addr, remote, 4 * MiB, timeout=5)
        assert np.array_equal(b2.array[: 4 * MiB], pattern(5, 4 * MiB))
        peer.signal(signal.SIGCONT)
        tcp.read(peer.segment, b1.addr, remote, 4 * MiB, timeout=10)  # recovers
        assert np.array_equal(b1.array[: 4 * MiB], pattern(5, 4 * MiB))
    finally:
        tcp.close()
        shm.close()
        peer.close()


def test_broken_connections_fail_over_to_other_lanes(meta: MetadataHTTPServer) -> None:
    peer = Peer(metadata=meta.url, transports=["tcp"])
    e = engine(
        meta.url, transports=("tcp",), timeout=30, slice_size=256 * 1024, backoff_initial=0.01
    )
    try:
        remote = peer.call("alloc", kind="memfd", size=128 * MiB)["addr"]
        buf = e.allocate_buffer(128 * MiB)
        exercised = 0
        for attempt in range(6):
            buf.array[:] = pattern(attempt, 128 * MiB)
            before = retries("tcp")
            batch = e.submit(
                [TransferRequest(TransferOp.WRITE, peer.segment, buf.addr, remote, 128 * MiB)]
            )
            peer.call("drop_connections")  # cut every connection while slices are in flight
            assert batch.wait(30)
            batch.raise_for_status()
            sha = peer.call("digest", addr=remote, length=128 * MiB)["sha"]
            assert sha == hashlib.sha256(buf.array.tobytes()).hexdigest()
            exercised += retries("tcp") > before
            if exercised >= 2:
                break
        assert exercised >= 1, "connections were never cut mid-transfer"
    finally:
        e.close()
        peer.close()


def test_a_sync_read_on_a_dropped_pooled_connection_is_retried(meta: MetadataHTTPServer) -> None:
    """A caller's own read runs on a pooled connection from its thread; when the peer dropped
    that connection meanwhile, the failed attempt moves to another path and the read succeeds."""
    peer = Peer(metadata=meta.url, transports=["tcp"])
    e = engine(meta.url, transports=("tcp",), timeout=10, backoff_initial=0.01)
    try:
        remote = peer.call("alloc", kind="numpy", size=MiB, seed=5)["addr"]
        buf = e.allocate_buffer(MiB)
        for attempt in range(3):
            e.read(peer.segment, buf.addr, remote, MiB)  # leaves its connection in the pool
            assert np.array_equal(buf.array, pattern(5, MiB))
            peer.call("drop_connections")
            buf.array[:] = 0
            before = retries("tcp")
            e.read(peer.segment, buf.addr, remote, MiB)
            assert np.array_equal(buf.array, pattern(5, MiB)), attempt
            assert retries("tcp") > before
    finally:
        e.close()
        peer.close()


def test_shm_path_failure_falls_back_to_tcp(meta: MetadataHTTPServer) -> None:
    peer = Peer(metadata=meta.url, transports=["shm", "tcp"])
    e = engine(meta.url, transports=("shm", "tcp"), timeout=10)
    try:
        remote = peer.call("alloc", kind="numpy", size=MiB, seed=3)["addr"]
        buf = e.allocate_buffer(MiB)
        e.read(peer.segment, buf.addr, remote, MiB)
        assert np.array_equal(buf.array, pattern(3, MiB))
        peer.call("close_transport", name="shm")  # its epoch page goes: the shm path breaks
        buf.array[:] = 0
        before = retries("tcp")
        e.read(peer.segment, buf.addr, remote, MiB)
        assert np.array_equal(buf.array, pattern(3, MiB))
        assert retries("tcp") > before
    finally:
        e.close()
        peer.close()


def test_etcd_metadata_across_processes_and_etcd_outage(etcd: EtcdServer) -> None:
    url = etcd.url + "/faults"
    peer = Peer(metadata=url, transports=["tcp"])
    e = engine(url, transports=("tcp",), timeout=5, connect_timeout=1.0)
    try:
        remote = peer.call("alloc", kind="numpy", size=MiB, seed=8)["addr"]
        buf = e.allocate_buffer(MiB)
        e.read(peer.segment, buf.addr, remote, MiB)
        assert np.array_equal(buf.array, pattern(8, MiB))
        etcd.stop()
        # the data path does not need metadata for a peer already known
        e.read(peer.segment, buf.addr, remote, MiB)
        t0 = time.monotonic()
        with pytest.raises(TransportBroken, match="etcd unreachable"):
            e.read("127.0.0.1:9", buf.addr, remote, 16)
        assert time.monotonic() - t0 < 5
        etcd.start()
        e.refresh_peer(peer.segment)  # metadata reachable again
        e.read(peer.segment, buf.addr, remote, MiB)
    finally:
        if etcd.proc is None:
            etcd.start()
        e.close()
        peer.close()


def test_metrics_are_served(meta: MetadataHTTPServer) -> None:
    port = free_port()
    a = engine(meta.url, transports=("tcp",), metrics_port=port)
    b = engine(meta.url, transports=("tcp",))
    try:
        src = np.ones(MiB, dtype=np.uint8)
        b.register(src)
        dst = a.allocate_buffer(MiB)
        a.read(b.segment_name, dst.addr, src.ctypes.data, MiB)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
        assert 'mooncake_connectors_transfer_bytes_total{op="READ",transport="tcp"}' in text
        assert "mooncake_connectors_transfer_latency_seconds_bucket" in text
    finally:
        a.close()
        b.close()


def test_shm_lets_go_of_peer_processes_that_exited(meta: MetadataHTTPServer) -> None:
    """A long-lived engine whose peers restart (store servers, say) must not keep a pidfd and
    the memfd mappings of every process it ever reached: the next new peer reaps them."""
    e = engine(meta.url, transports=("shm",), timeout=10)
    shm = next(t for t in e.transports if t.name == "shm")
    buf = e.allocate_buffer(MiB)
    peers: list[Peer] = []
    try:

        def pidfds_and_maps() -> tuple[int, int]:
            links = []
            for f in os.listdir("/proc/self/fd"):
                with contextlib.suppress(FileNotFoundError):  # listdir's own descriptor
                    links.append(os.readlink(f"/proc/self/fd/{f}"))
            with open("/proc/self/maps") as fh:
                maps = sum("/memfd:mooncake-connectors" in line for line in fh)
            return sum("pidfd" in link for link in links), maps

        def held(pid: int) -> bool:
            return pid in shm._pidfds or any(k[0] == pid for k in shm._maps)  # type: ignore[attr-defined]

        counts = []
        for i in range(4):
            p = Peer(metadata=meta.url, transports=["shm"])
            peers.append(p)
            remote = p.call("alloc", kind="memfd", size=MiB, seed=i)["addr"]
            e.read(p.segment, buf.addr, remote, MiB)  # mapped: its pidfd, epoch page, buffer
            assert np.array_equal(buf.array, pattern(i, MiB))
            assert held(p.pid)
            counts.append(pidfds_and_maps())
            p.kill()  # gone without a word: the engine only learns it at its next contact
        assert not any(held(p.pid) for p in peers[:-1]), "exited peers are still held"
        assert counts[-1] == counts[0], counts  # flat, not a pidfd and 2 mappings per dead peer
        # The last one is reaped at the next contact with it, which fails as the peer did.
        with pytest.raises(TransferError):
            e.read(peers[-1].segment, buf.addr, remote, MiB, timeout=2)
        assert not held(peers[-1].pid)
    finally:
        e.close()
        for p in peers:
            p.close()


def test_a_copy_running_while_its_peer_is_released_keeps_the_mapping(
    meta: MetadataHTTPServer,
) -> None:
    """_forget may run in one thread while another copies from the released peer's memory: the
    copy's view keeps the mapping until it ends (unmapping under it would crash the process)."""
    from mooncake_connectors.transfer_core.memory import SharedBuffer
    from mooncake_connectors.transfer_core.transports.shm import _Mapping

    e = engine(meta.url, transports=("shm",))
    shm = next(t for t in e.transports if t.name == "shm")
    src = SharedBuffer(MiB, name="mc-test-released-peer")
    try:
        src.array[:] = pattern(7, MiB)
        pid = os.getpid()
        m = _Mapping(pid, src.fd, os.fstat(src.fd).st_ino)
        shm._maps[(pid, src.fd, 0)] = m  # type: ignore[attr-defined]
        view = memoryview(m.mm)  # what _copy holds during its memmove
        shm._forget(pid)  # type: ignore[attr-defined]
        assert (pid, src.fd, 0) not in shm._maps  # type: ignore[attr-defined]
        out = np.empty(MiB, dtype=np.uint8)
        ctypes.memmove(out.ctypes.data, m.base, MiB)  # still mapped: no crash, right bytes
        assert np.array_equal(out, pattern(7, MiB))
        view.release()
        del view, m
        with open("/proc/self/maps") as fh:
            mapped = sum("mc-test-released-peer" in line for line in fh)
        assert mapped == 1, "the released mapping outlived its last view"  # src's own only
    finally:
        src.close()
        e.close()
