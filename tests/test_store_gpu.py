"""The store client on GPU memory: registered as ``cuda:0``, put from and read into directly.

FakeCuda stands in for the CUDA driver at our seam; the master, store server, client, engine and
transports are the real ones.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from fake_cuda import FakeCuda, installed
from helpers import pattern
from store_cluster import in_process_store

from mooncake_connectors.store import ClientConfig, StoreClient


@pytest.fixture
def fake() -> Iterator[FakeCuda]:
    with installed() as f:
        yield f


@pytest.fixture
def master(fake: FakeCuda) -> Iterator[str]:
    with in_process_store() as (address, _):
        yield address


def test_store_client_moves_registered_gpu_memory_directly(fake: FakeCuda, master: str) -> None:
    src = fake.device_alloc(1 << 20)
    dst = fake.device_alloc(1 << 20)
    fake.array(src, 1 << 20)[:] = pattern(3, 1 << 20)
    with StoreClient(ClientConfig(master=master, transports=("tcp",))) as c:
        c.register_buffer(src, 1 << 20, location="cuda:0")
        c.register_buffer(dst, 1 << 20, location="cuda:0")
        keys = [f"gpu/{i}" for i in range(4)]
        offs = [0, 4096, 300_000, 700_001]
        sizes = [4096, 100_000, 65_536, 300_000]
        assert c.batch_put_from(keys, [src + o for o in offs], sizes) == [None] * 4
        got = c.batch_get_into(keys, [dst + o for o in offs], sizes)
        assert got == sizes
        a, b = fake.array(src, 1 << 20), fake.array(dst, 1 << 20)
        for o, n in zip(offs, sizes, strict=True):
            assert np.array_equal(a[o : o + n], b[o : o + n])
