"""The LMCache plugin end to end: LMCache's own StorageManager / RemoteBackend on CPU, our store as
real processes (master + store servers), real MemoryObjs from LMCache's allocator.

Round trips of full and partial chunks in both layouts, LMCache's batched / async / sync paths,
a second LMCache instance in another process sharing the store, LMCache's own ``basic_check``
tool, and the store killed or absent: misses within the deadline, LMCache's event loop free.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lmcache", reason="LMCache is installed only in the LMCache venv (see docs)")

import lmcache_env as env
from helpers import free_port, wait_until
from store_cluster import cluster, start_master, start_server

from mooncake_connectors.adapters.lmcache import Layout, StoreConnector
from mooncake_connectors.adapters.lmcache.connector import cpu_buffer

pytestmark = pytest.mark.lmcache
HERE = Path(__file__).parent
WHERE = f"RemoteBackend-{env.PLUGIN}"


@pytest.fixture(scope="module")
def store() -> Iterator[str]:
    with cluster(2, "64M") as (addr, _, _, _):
        yield addr


@pytest.fixture
def make_sm(store: str) -> Iterator[Any]:
    made: list[Any] = []

    def make(master: str = store, **settings: Any) -> Any:
        sm = env.storage_manager(master, **settings)
        made.append(sm)
        return sm

    yield make
    for sm in made:
        sm.close()


def on_loop(sm: Any, coro: Any, timeout: float = 10.0) -> Any:
    """Run a coroutine on LMCache's own storage event loop, as RemoteBackend does."""
    return asyncio.run_coroutine_threadsafe(coro, sm.loop).result(timeout)


def check_and_release(objs: list[Any], seeds: list[int], tokens: int = env.CHUNK) -> None:
    try:
        bad = [s for o, s in zip(objs, seeds, strict=True) if not env.matches(o, s, tokens)]
        assert not bad, f"chunks {bad} missing or different"
    finally:
        for o in objs:
            if o is not None:
                o.ref_count_down()


def test_lmcache_loads_the_plugin_and_it_registers_lmcache_memory(make_sm: Any) -> None:
    sm = make_sm()
    con = env.connector(sm)
    assert type(con) is StoreConnector and con.layout is Layout.RAW
    assert not env.remote(sm).contains(env.key(1))  # a call: the client is connected now
    buf = cpu_buffer(sm.storage_backends["LocalCPUBackend"])
    assert buf is not None and con.registered == buf
    obj = env.chunk(sm, 1)
    try:
        assert buf[0] <= obj.data_ptr and obj.data_ptr + obj.get_size() <= buf[0] + buf[1]
    finally:
        obj.ref_count_down()


def test_put_get_contains_round_trip(make_sm: Any) -> None:
    sm = make_sm()
    backend, con = env.remote(sm), env.connector(sm)
    seeds = list(range(100, 108))
    keys = [env.key(s) for s in seeds]
    objs = [env.chunk(sm, s) for s in seeds]
    for o in objs:
        o.ref_count_up()  # ours, to watch LMCache's and the connector's references go
    sm.batched_put(keys, objs)
    env.wait_stored(sm, seeds)
    # every reference LMCache and the connector took for the put is given back
    wait_until(lambda: all(o.get_ref_count() == 1 for o in objs), 10, "put references released")
    for o in objs:
        o.ref_count_down()

    check_and_release(sm.batched_get(keys, location=WHERE), seeds)
    check_and_release([backend.get_blocking(keys[3])], [seeds[3]])

    missing = env.key(999)
    assert not backend.contains(missing) and backend.contains(keys[0])
    assert con.exists_sync(keys[1]) and not con.exists_sync(missing)
    hits, where = sm.batched_contains([*keys[:3], missing, *keys[3:]])
    assert hits == 3 and list(where) == [WHERE]
    assert on_loop(sm, backend.batched_async_contains("l1", [*keys, missing])) == len(keys)
    got = on_loop(sm, backend.batched_get_non_blocking("l2", [*keys[:2], missing, keys[2]]))
    check_and_release(got, seeds[:2])  # the leading run of hits only

    assert sorted(on_loop(sm, con.list())) == sorted(k.to_string() for k in keys)
    assert on_loop(sm, con.ping()) == 0
    assert backend.remove(keys[0]) and not backend.contains(keys[0])
    assert con.guard.counters["failed"] == 0


def test_partial_chunks(make_sm: Any) -> None:
    sm = make_sm()
    cases = [(200, env.CHUNK), (201, 1), (202, 5), (203, env.CHUNK - 1)]
    for seed, tokens in cases:
        env.put(sm, [seed], tokens)
    env.wait_stored(sm, [s for s, _ in cases])
    objs = sm.batched_get([env.key(s) for s, _ in cases], location=WHERE)
    for obj, (seed, tokens) in zip(objs, cases, strict=True):
        check_and_release([obj], [seed], tokens)


def test_framed_layout_round_trip_and_separate_namespace(make_sm: Any) -> None:
    framed = make_sm(layout="framed")
    assert env.connector(framed).layout is Layout.FRAMED
    cases = [(300, env.CHUNK), (301, 3)]
    for seed, tokens in cases:
        env.put(framed, [seed], tokens)
    env.wait_stored(framed, [s for s, _ in cases])
    objs = framed.batched_get([env.key(s) for s, _ in cases], location=WHERE)
    for obj, (seed, tokens) in zip(objs, cases, strict=True):
        check_and_release([obj], [seed], tokens)
    # a raw-layout instance does not read framed values as raw bytes: they are a miss to it
    raw = make_sm()
    assert not env.remote(raw).contains(env.key(300))
    assert raw.batched_get([env.key(300)], location=WHERE) == [None]


class Instance:
    """lmcache_instance.py: another LMCache in another process."""

    def __init__(
        self, master: str, plugin: str = env.PLUGIN, extra_env: dict[str, str] | None = None
    ) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "lmcache_instance.py"), master, plugin],
            env={**os.environ, **(extra_env or {})},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert self.read(120)["ready"]

    def read(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise AssertionError(f"the LMCache instance did not answer within {timeout}s")
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"the LMCache instance exited (rc={self.proc.poll()})")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def call(self, cmd: str, timeout: float = 60, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"cmd": cmd, **args}) + "\n")
        self.proc.stdin.flush()
        return self.read(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(AssertionError, OSError, ValueError):
                self.call("quit", timeout=5)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def test_two_lmcache_instances_share_one_store(make_sm: Any, store: str) -> None:
    other = Instance(store)
    try:
        sm = make_sm()
        theirs = [400, 401, 402]
        assert other.call("put", seeds=theirs) == {"ok": True}
        check_and_release(sm.batched_get([env.key(s) for s in theirs], WHERE), theirs)
        env.put(sm, [410, 411])
        env.put(sm, [412], tokens=7)
        env.wait_stored(sm, [410, 411, 412])
        assert other.call("get", seeds=[410, 411]) == {"match": [True, True]}
        assert other.call("get", seeds=[412], tokens=7) == {"match": [True]}
        assert other.call("contains", seeds=[400, 410, 499, 411]) == {"prefix": 2}
    finally:
        other.close()


def test_lmcache_basic_check_tool_passes(store: str) -> None:
    """LMCache's own ``basic_check --mode test_remote`` (RemoteBackend on CPU) with our plugin
    as its remote URL."""
    p = env.PLUGIN
    config = f"""chunk_size: 256
local_cpu: false
max_local_cpu_size: 0.1
remote_url: "plugin://{p}"
remote_serde: naive
remote_storage_plugins: ["{p}"]
extra_config:
  remote_storage_plugin.{p}.module_path: mooncake_connectors.adapters.lmcache
  remote_storage_plugin.{p}.class_name: StoreConnector
  remote_storage_plugin.{p}.master: "{store}"
  remote_storage_plugin.{p}.key_prefix: "basic-check/"
"""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as fh:
        fh.write(config)
    try:
        run = subprocess.run(
            [sys.executable, "-m", "lmcache.v1.basic_check", "--mode", "test_remote"],
            env={**os.environ, "LMCACHE_CONFIG_FILE": fh.name},
            capture_output=True,
            text=True,
            timeout=150,
        )
    finally:
        os.unlink(fh.name)
    out = run.stdout
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Test Failed" not in out, out
    assert out.count("Validation: 5/5 passed") == 3, out
    assert "Validation (content correct): 5/5 passed" in out, out


def test_store_killed_answers_misses_without_stalling(make_sm: Any) -> None:
    # Long enough that a stalled loop (it would wait the whole deadline) cannot pass for a busy
    # machine's scheduling delay in the checks below.
    timeout = 3.0
    with cluster(1, "32M") as (addr, servers, _, master):
        sm = make_sm(addr, timeout=timeout, cooldown=60)
        backend, con = env.remote(sm), env.connector(sm)
        seeds = [500, 501, 502]
        keys = [env.key(s) for s in seeds]
        env.put(sm, seeds)
        env.wait_stored(sm, seeds)
        master.kill()
        for s in servers:
            s.kill()

        # The first call finds the store gone: a miss within the deadline, and LMCache's event
        # loop keeps serving other work while that call waits on a store thread.
        result: dict[str, Any] = {}

        def get() -> None:
            t0 = time.monotonic()
            result["objs"] = backend.batched_get_blocking(keys)
            result["took"] = time.monotonic() - t0

        calls = con.guard.counters["calls"]
        worker = threading.Thread(target=get)
        worker.start()
        wait_until(lambda: con.guard.counters["calls"] > calls, 5, "the get to reach the store")
        assert on_loop(sm, asyncio.sleep(0, result="free"), timeout=1.0) == "free"
        assert worker.is_alive()  # the get was still waiting on the store meanwhile
        worker.join(timeout + 5)
        assert not worker.is_alive()
        assert result["objs"] == [None] * 3
        assert result["took"] < timeout + 2.0

        # Then, during the cool-down, every path answers at once without calling the store.
        skipped = con.guard.counters["skipped"]
        t0 = time.monotonic()
        assert not backend.contains(keys[0])
        assert sm.batched_contains(keys) == (0, {})
        assert backend.get_blocking(keys[0]) is None
        assert on_loop(sm, backend.batched_async_contains("l", keys)) == 0
        assert on_loop(sm, backend.batched_get_non_blocking("l", keys)) == []
        assert on_loop(sm, con.ping()) == 1
        objs = [env.chunk(sm, s) for s in (510, 511)]
        for o in objs:
            o.ref_count_up()
        sm.batched_put([env.key(510), env.key(511)], objs)  # dropped, not raised
        wait_until(lambda: all(o.get_ref_count() == 1 for o in objs), 5, "put refs released")
        for o in objs:
            o.ref_count_down()
        assert time.monotonic() - t0 < 2.0  # one store call would have taken 3 s
        assert con.guard.counters["skipped"] >= skipped + 7


def test_store_absent_at_start_then_found(make_sm: Any) -> None:
    """LMCache starts while no store runs (misses, no wait); once it runs the plugin uses it."""
    port = free_port()
    addr = f"127.0.0.1:{port}"
    t0 = time.monotonic()
    sm = make_sm(addr, timeout=1.0, cooldown=0.3)
    assert time.monotonic() - t0 < 5.0  # LMCache's own set-up; the store is not waited for
    backend = env.remote(sm)
    assert not backend.contains(env.key(600))
    assert sm.batched_get([env.key(600)], location=WHERE) == [None]
    m, _ = start_master(port=port)
    srv = start_server(addr, "32M")
    try:

        def round_trip() -> bool:
            env.put(sm, [600])
            if not backend.contains(env.key(600)):
                return False
            check_and_release(sm.batched_get([env.key(600)], location=WHERE), [600])
            return True

        wait_until(round_trip, 30, "a round trip once the store runs", interval=0.3)
    finally:
        srv.close()
        m.close()


def test_bad_settings_leave_lmcache_running_without_the_remote_backend(make_sm: Any) -> None:
    """A ConfigError from the plugin is LMCache's to log; LMCache runs on without the store."""
    sm = make_sm(timeout="soon")
    backend = env.remote(sm)
    assert backend.connection is None
    assert not backend.contains(env.key(1)) and backend.get_blocking(env.key(1)) is None
