"""Striped synchronous tcp transfers: a transfer of ``stripe_min`` bytes or more is cut into
portions moved on several connections at once. The bytes, the errors and the deadlines must be
those of the same transfer unstriped. The target is another process."""

from __future__ import annotations

import hashlib
import signal
import time
from collections.abc import Iterator

import numpy as np
import pytest
from helpers import Peer, pattern, wait_until

from mooncake_connectors.config import EngineConfig
from mooncake_connectors.errors import AccessViolation, ConfigError, TransferTimeout
from mooncake_connectors.transfer_core import TransferEngine
from mooncake_connectors.transfer_core.engine import TransferRequest
from mooncake_connectors.transfer_core.metadata.http import MetadataHTTPServer
from mooncake_connectors.transfer_core.transports.tcp import TcpTransport
from mooncake_connectors.types import TransferOp

KiB, MiB = 1 << 10, 1 << 20
SIZE = 4 * MiB  # the peer's region, filled with pattern(1, SIZE)
STRIPES = 3


@pytest.fixture
def meta(meta_server: MetadataHTTPServer) -> MetadataHTTPServer:
    return meta_server


@pytest.fixture
def peer(meta: MetadataHTTPServer) -> Iterator[tuple[Peer, int]]:
    p = Peer(metadata=meta.url, transports=["tcp"])
    try:
        yield p, p.call("alloc", kind="numpy", size=SIZE, seed=1)["addr"]
    finally:
        if p.stopped():
            p.signal(signal.SIGCONT)
        p.close()


def striped(meta: MetadataHTTPServer, stripes: int = STRIPES, **kw: object) -> TransferEngine:
    settings = {"tcp": {"stripes": stripes, "stripe_min": 64 * KiB}}
    cfg = EngineConfig(metadata=meta.url, transports=("tcp",), transport_settings=settings)
    return TransferEngine(cfg.replace(**kw)).start()


def tcp_of(e: TransferEngine) -> TcpTransport:
    t = e.transports[0]
    assert isinstance(t, TcpTransport)
    return t


def sha(data: object) -> str:
    return hashlib.sha256(bytes(data)).hexdigest()  # type: ignore[call-overload]


@pytest.mark.parametrize("slice_size", [8 * MiB, 192 * KiB], ids=["one-slice", "many-slices"])
def test_striped_reads_and_writes_move_the_right_bytes(
    meta: MetadataHTTPServer, peer: tuple[Peer, int], slice_size: int
) -> None:
    p, remote = peer
    want = pattern(1, SIZE)
    n = 3 * MiB + 123  # portions cut mid-slice, off page boundaries at both ends
    with striped(meta, slice_size=slice_size) as e:
        buf = e.allocate_buffer(SIZE)
        e.read(p.segment, buf.addr + 1, remote + 7, n)
        assert np.array_equal(buf.array[1 : 1 + n], want[7 : 7 + n])
        # one connection per portion: the target saw STRIPES of them
        assert p.call("connections")["tcp"] >= STRIPES
        data = pattern(2, n)
        buf.array[3 : 3 + n] = data
        e.write(p.segment, buf.addr + 3, remote + 5, n)
        assert p.call("digest", addr=remote + 5, length=n)["sha"] == sha(data)
        want[5 : 5 + n] = data
        # several requests in one call, spread over the portions in order
        buf.array[:] = 0
        sizes = [600 * KiB - 1, 64 * KiB + 3, 1 * MiB, 5, 900 * KiB]
        reqs, off = [], 0
        for k in sizes:
            reqs.append(
                TransferRequest(TransferOp.READ, p.segment, buf.addr + off, remote + off, k)
            )
            off += k + 11
        e.transfer(reqs)
        for r in reqs:
            o = r.local_addr - buf.addr
            assert np.array_equal(buf.array[o : o + r.length], want[o : o + r.length])


def test_a_portion_the_target_refuses_fails_its_request_only(
    meta: MetadataHTTPServer, peer: tuple[Peer, int]
) -> None:
    """Two requests, one per portion; the second's region goes away after the initiator
    cached the descriptor: the call raises the target's refusal, the first request's bytes
    landed in full."""
    p, remote = peer
    other = p.call("alloc", kind="numpy", size=1 * MiB, seed=3)["addr"]
    with striped(meta, stripes=2) as e:
        buf = e.allocate_buffer(2 * MiB)
        e.peer(p.segment)  # both regions are in the cached descriptor
        p.call("unregister", addr=other)
        reqs = [
            TransferRequest(TransferOp.READ, p.segment, buf.addr, remote, 1 * MiB),
            TransferRequest(TransferOp.READ, p.segment, buf.addr + 1 * MiB, other, 1 * MiB),
        ]
        with pytest.raises(AccessViolation):
            e.transfer(reqs, timeout=10)
        assert np.array_equal(buf.array[: 1 * MiB], pattern(1, SIZE)[: 1 * MiB])
        # the connections that carried the refusal stay usable
        e.read(p.segment, buf.addr, remote + 1 * MiB, 2 * MiB, timeout=10)
        assert np.array_equal(buf.array[: 2 * MiB], pattern(1, SIZE)[1 * MiB : 3 * MiB])


def test_a_portion_no_worker_took_is_run_by_the_caller(
    meta: MetadataHTTPServer, peer: tuple[Peer, int]
) -> None:
    p, remote = peer
    with striped(meta) as e:
        runner = tcp_of(e)._direct
        runner._workers = STRIPES  # as if its workers existed, all busy: none will come
        buf = e.allocate_buffer(SIZE)
        t0 = time.monotonic()
        e.read(p.segment, buf.addr, remote, SIZE, timeout=20)
        assert time.monotonic() - t0 < 10  # it did not wait for a worker's grace period
        assert np.array_equal(buf.array, pattern(1, SIZE))
        assert not runner.threads


def test_a_striped_transfer_to_a_stopped_peer_keeps_its_deadline(
    meta: MetadataHTTPServer, peer: tuple[Peer, int]
) -> None:
    """Every portion's connection is pooled and connected; the peer then stops. The call fails
    by its deadline (each portion's socket waits no longer), and once the peer runs again the
    next call is served on fresh connections, never on one with an answer still in flight."""
    p, remote = peer
    with striped(meta) as e:
        buf = e.allocate_buffer(SIZE)
        e.read(p.segment, buf.addr, remote, SIZE, timeout=20)
        p.signal(signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(TransferTimeout):
            e.read(p.segment, buf.addr, remote, SIZE, timeout=1.5)
        assert time.monotonic() - t0 < 1.5 + 1.5  # (a margin for a loaded machine)
        p.signal(signal.SIGCONT)
        buf.array[:] = 0
        e.read(p.segment, buf.addr, remote, SIZE, timeout=20)
        assert np.array_equal(buf.array, pattern(1, SIZE))


def test_closing_the_engine_ends_the_stripe_workers(
    meta: MetadataHTTPServer, peer: tuple[Peer, int]
) -> None:
    p, remote = peer
    e = striped(meta)
    buf = e.allocate_buffer(SIZE)
    e.read(p.segment, buf.addr, remote, SIZE, timeout=20)
    threads = tcp_of(e)._direct.threads
    assert len(threads) == STRIPES - 1
    e.close()
    wait_until(lambda: not any(t.is_alive() for t in threads), 10, "stripe workers to end")


@pytest.mark.parametrize("bad", [{"stripes": 0}, {"stripes": 17}, {"stripe_min": 4096}])
def test_bad_stripe_settings_are_refused(bad: dict[str, int]) -> None:
    cfg = EngineConfig(metadata="memory://stripes", transports=("tcp",))
    with pytest.raises(ConfigError, match="stripe"):
        TransferEngine(cfg.replace(transport_settings={"tcp": bad})).start()


def test_prepare_readies_a_striped_transfer_before_it_comes(
    meta: MetadataHTTPServer, peer: tuple[Peer, int]
) -> None:
    """``engine.prepare``: the connections and stripe workers of a striped transfer exist
    before the first one, which then connects nothing and starts no thread."""
    p, remote = peer
    with striped(meta) as e:
        runner = tcp_of(e)._direct
        e.prepare(p.segment)
        assert len(runner.threads) == STRIPES - 1
        assert p.call("connections")["tcp"] >= STRIPES  # the target accepted them already
        e.prepare(p.segment)  # again: nothing more
        assert len(runner.threads) == STRIPES - 1
        assert sum(len(pool) for pool in runner._idle.values()) == STRIPES
        buf = e.allocate_buffer(SIZE)
        e.read(p.segment, buf.addr, remote, SIZE, timeout=20)
        assert np.array_equal(buf.array, pattern(1, SIZE))
        assert runner.connects == 0 and len(runner.threads) == STRIPES - 1


def test_prepare_of_a_peer_gone_is_no_error(
    meta: MetadataHTTPServer, peer: tuple[Peer, int]
) -> None:
    p, _ = peer
    with striped(meta, connect_timeout=1.0) as e:
        e.peer(p.segment)  # its descriptor is cached
        p.signal(signal.SIGSTOP)  # its kernel still accepts; no handshake comes
        t0 = time.monotonic()
        e.prepare(p.segment, timeout=0.5)
        assert time.monotonic() - t0 < 5
        assert not any(tcp_of(e)._direct._idle.values())  # nothing half-made is pooled
        e.prepare("no-such-segment", timeout=0.5)  # unknown: nothing to do, no raise


def test_prepare_leaves_tcp_alone_where_another_transport_carries_the_bytes(
    meta: MetadataHTTPServer,
) -> None:
    """Same host with shm first: transfers take shm, so tcp opens nothing for them."""
    p = Peer(metadata=meta.url, transports=["shm", "tcp"])
    try:
        remote = p.call("alloc", kind="numpy", size=SIZE, seed=1)["addr"]
        settings = {"tcp": {"stripes": STRIPES, "stripe_min": 64 * KiB}}
        cfg = EngineConfig(
            metadata=meta.url, transports=("shm", "tcp"), transport_settings=settings
        )
        with TransferEngine(cfg).start() as e:
            buf = e.allocate_buffer(SIZE)
            e.prepare(p.segment)
            runner = e.transports[1]._direct  # type: ignore[attr-defined]
            assert not runner.threads and not any(runner._idle.values())
            e.read(p.segment, buf.addr, remote, SIZE, timeout=20)  # over shm
            assert np.array_equal(buf.array, pattern(1, SIZE))
    finally:
        p.close()
