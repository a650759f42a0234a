"""The store on GPU memory: the vLLM store worker saves from and loads into GPU KV blocks laid out
K and V apart (vLLM's GPU backends), through a store client that registers them as ``cuda:0``.

FakeCuda stands in for the CUDA driver at our seam and FakeCudaTensor for vLLM's tensors; the
master, store server, client, engine and transports are the real ones.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from fake_cuda import FakeCuda, FakeCudaTensor, ensure_cuda_ipc_registered, installed
from helpers import pattern
from store_cluster import in_process_store

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")

from mooncake_connectors.adapters.keys import Shard
from mooncake_connectors.adapters.vllm.store_config import StoreConnectorConfig
from mooncake_connectors.adapters.vllm.store_keys import BlockKeys
from mooncake_connectors.adapters.vllm.store_scheduler import BlockSpec
from mooncake_connectors.adapters.vllm.store_worker import StoreWorker
from mooncake_connectors.store import ClientConfig, StoreClient

BS, NUM_BLOCKS, HEADS, HEAD = 16, 32, 2, 64
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
HASHES = [f"{i:032x}" for i in range(1, 6)]
ensure_cuda_ipc_registered()


@pytest.fixture
def fake() -> Iterator[FakeCuda]:
    with installed() as f:
        yield f


@pytest.fixture
def master(fake: FakeCuda) -> Iterator[str]:
    with in_process_store() as (address, _):
        yield address


def _worker(master: str, kv: dict[str, FakeCudaTensor]) -> StoreWorker:
    keys = BlockKeys("test", "tiny", "bfloat16.b16.h2x64", Shard(False, 0, 1))
    w = StoreWorker(StoreConnectorConfig(master=master, timeout=10.0), keys, LAYERS, NUM_BLOCKS)
    w.register_kv_caches(kv, 0)  # type: ignore[arg-type]
    assert w.store is not None and w.store.wait_connected(10)
    return w


def _kv(fake: FakeCuda, seed: int | None) -> dict[str, FakeCudaTensor]:
    out = {}
    for i, name in enumerate(LAYERS):
        t = FakeCudaTensor(fake, (2, NUM_BLOCKS, BS, HEADS, HEAD))
        if seed is not None:
            t.bytes[:] = pattern(seed + i, t.bytes.size)
        out[name] = t
    return out


def test_gpu_blocks_saved_by_one_worker_load_into_another(fake: FakeCuda, master: str) -> None:
    src, dst = _kv(fake, 5), _kv(fake, None)
    saver, loader = _worker(master, src), _worker(master, dst)
    try:
        assert saver.key_names == [LAYERS[0], f"{LAYERS[0]}/v", LAYERS[1], f"{LAYERS[1]}/v"]
        saver._save(BlockSpec("r-1", [7, 8, 9, 10, 11], HASHES))
        loader._load(BlockSpec("r-2", [20, 21, 22, 23, 24], HASHES))
        assert loader.take_load_errors() == set()
        for name in LAYERS:
            got, want = dst[name].elements(), src[name].elements()
            assert np.array_equal(got[:, 20:25], want[:, 7:12])  # K and V planes both
            assert not got[:, :20].any() and not got[:, 25:].any()
        with StoreClient(ClientConfig(master=master)) as c:  # V is an object of its own
            prefix = saver.keys.prefix
            assert c.batch_exists([f"{prefix}/{HASHES[0]}/{LAYERS[0]}/v"]) == [True]
    finally:
        saver.shutdown()
        loader.shutdown()
