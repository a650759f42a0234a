"""The transfer engine's per-request metrics (bytes moved, requests by status, latency) are noted
on the data path and added up in bulk: a collection must still see every request finished before
it, from every thread, whether or not a bulk flush happened in between."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest
from prometheus_client import REGISTRY

from mooncake_connectors.config import EngineConfig
from mooncake_connectors.errors import AccessViolation
from mooncake_connectors.transfer_core import TransferEngine
from mooncake_connectors.transfer_core.metadata.http import MetadataHTTPServer
from mooncake_connectors.transfer_core.metrics import LATENCY_BUCKETS

SIZE = 4096
THREADS = 4
PER_THREAD = 300  # 1200 requests in all: more than one bulk flush, and a remainder


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def snapshot() -> dict[str, float]:
    return {
        "bytes_read": sample(
            "mooncake_connectors_transfer_bytes_total", transport="tcp", op="READ"
        ),
        "bytes_written": sample(
            "mooncake_connectors_transfer_bytes_total", transport="tcp", op="WRITE"
        ),
        "reads_ok": sample(
            "mooncake_connectors_transfer_requests_total", op="READ", status="COMPLETED"
        ),
        "reads_failed": sample(
            "mooncake_connectors_transfer_requests_total", op="READ", status="FAILED"
        ),
        "read_latency_count": sample(
            "mooncake_connectors_transfer_latency_seconds_count", op="READ"
        ),
    }


@pytest.fixture
def pair(meta_server: MetadataHTTPServer) -> Iterator[tuple[TransferEngine, TransferEngine]]:
    cfg = EngineConfig(metadata=meta_server.url, transports=("tcp",))
    a, b = TransferEngine(cfg).start(), TransferEngine(cfg).start()
    yield a, b
    a.close()
    b.close()


def test_every_request_is_counted_once(pair: tuple[TransferEngine, TransferEngine]) -> None:
    a, b = pair
    remote = np.arange(SIZE * THREADS, dtype=np.uint32).view(np.uint8)[: SIZE * THREADS]
    b.register(remote)
    local = a.allocate_buffer(SIZE * THREADS)
    before = snapshot()
    errors: list[BaseException] = []

    def reader(k: int) -> None:
        try:
            for _ in range(PER_THREAD):
                a.read(b.segment_name, local.addr + k * SIZE, remote.ctypes.data + k * SIZE, SIZE)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    a.write(b.segment_name, local.addr, remote.ctypes.data, 100)
    with pytest.raises(AccessViolation):  # a request refused by the target counts as FAILED
        a.read(b.segment_name, local.addr, remote.ctypes.data + SIZE * THREADS, SIZE)
    after = snapshot()
    n = THREADS * PER_THREAD
    assert after["bytes_read"] - before["bytes_read"] == n * SIZE
    assert after["bytes_written"] - before["bytes_written"] == 100
    assert after["reads_ok"] - before["reads_ok"] == n
    assert after["reads_failed"] - before["reads_failed"] == 1
    assert after["read_latency_count"] - before["read_latency_count"] == n + 1


def test_latency_buckets_are_cumulative(pair: tuple[TransferEngine, TransferEngine]) -> None:
    a, b = pair
    remote = np.zeros(SIZE, dtype=np.uint8)
    b.register(remote)
    local = a.allocate_buffer(SIZE)
    for _ in range(10):
        a.read(b.segment_name, local.addr, remote.ctypes.data, SIZE)
    name = "mooncake_connectors_transfer_latency_seconds"
    counts = [sample(f"{name}_bucket", op="READ", le=repr(float(le))) for le in LATENCY_BUCKETS]
    total = sample(f"{name}_bucket", op="READ", le="+Inf")
    assert counts == sorted(counts)
    assert counts[-1] <= total == sample(f"{name}_count", op="READ") >= 10
    assert 0 < sample(f"{name}_sum", op="READ") < total * LATENCY_BUCKETS[-1]
