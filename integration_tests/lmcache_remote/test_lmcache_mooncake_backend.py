"""LMCache's own Mooncake backend, unmodified, on our store through the ``mooncake`` alias.

LMCache 0.5.6's ``mooncakestore`` remote connector (``MooncakestoreConnector``, loaded from
``remote_storage_plugins: ["mooncakestore"]``) does ``from mooncake.store import
MooncakeDistributedStore, ReplicateConfig`` when LMCache builds it; with the alias on that is our
facade, talking to our master and store servers (processes). Driven through LMCache's own
StorageManager / RemoteBackend on CPU with real MemoryObjs, in both of its modes: zero-copy
(``save_chunk_meta: false``: ``batch_put_from`` / ``batch_get_into`` on LMCache's memory) and
with metadata (``put_parts`` of LMCache's header and the KV bytes, ``batch_get_buffer``). The
values in our store are checked byte for byte against what LMCache handed over, and a second
LMCache in another process (alias on from the environment) reads them back.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("lmcache", reason="LMCache is installed only in the LMCache venv (see docs)")

import lmcache_env as env
from lmcache.v1.protocol import RemoteMetadata
from store_cluster import cluster
from test_lmcache_connector import Instance, check_and_release, on_loop

from mooncake_connectors.compat_alias import installed, uninstall_mooncake_alias
from mooncake_connectors.config import ALIAS_ENV

pytestmark = pytest.mark.lmcache
WHERE = f"RemoteBackend-{env.MOONCAKESTORE}"


@pytest.fixture(scope="module")
def store() -> Iterator[tuple[str, Any]]:
    with cluster(1, "64M") as (addr, _, client, _):
        yield addr, client


@pytest.fixture
def alias(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    from mooncake_connectors.compat import install_as_mooncake

    monkeypatch.setenv(ALIAS_ENV, "1")
    install_as_mooncake()  # before LMCache's connector imports mooncake.store
    yield
    uninstall_mooncake_alias()


@pytest.fixture
def make_sm(store: tuple[str, Any], alias: None) -> Iterator[Any]:
    made: list[Any] = []

    def make(save_chunk_meta: bool) -> Any:
        sm = env.storage_manager(store[0], env.MOONCAKESTORE, save_chunk_meta=save_chunk_meta)
        made.append(sm)
        return sm

    yield make
    for sm in made:
        sm.close()


def connector(sm: Any) -> Any:
    return env.remote(sm, env.MOONCAKESTORE).connection.getWrappedConnector()


@pytest.mark.parametrize("save_chunk_meta", [False, True], ids=["zero-copy", "metadata"])
def test_lmcache_mooncake_backend_runs_on_our_store(
    make_sm: Any, store: tuple[str, Any], save_chunk_meta: bool
) -> None:
    from lmcache.v1.storage_backend.connector.mooncakestore_connector import (
        MooncakestoreConnector,
    )

    from mooncake_connectors.compat_store import MooncakeDistributedStore

    sm = make_sm(save_chunk_meta)
    con = connector(sm)
    assert installed() and type(con) is MooncakestoreConnector  # LMCache's class, unmodified
    assert type(con.store) is MooncakeDistributedStore  # ... on our facade
    assert con.save_chunk_meta is save_chunk_meta
    backend = env.remote(sm, env.MOONCAKESTORE)
    base = 1000 if save_chunk_meta else 2000
    cases = [(base, env.CHUNK), (base + 1, env.CHUNK), (base + 2, 5), (base + 3, 1)]
    for seed, tokens in cases:
        env.put(sm, [seed], tokens)
    seeds = [s for s, _ in cases]
    env.wait_stored(sm, seeds, plugin=env.MOONCAKESTORE)

    # what our store holds is what LMCache handed over, byte for byte
    client = store[1]
    header = con.remote_metadata_bytes if save_chunk_meta else 0
    for seed, tokens in cases:
        value = client.get(env.key(seed).to_string())
        assert value is not None and value[header:] == env.pattern(seed, tokens), seed
        if save_chunk_meta:
            meta = RemoteMetadata.deserialize(memoryview(value)[:header])
            assert meta.length == tokens * env.TOKEN_BYTES

    # and LMCache reads it back through its batched path (partial chunks reshaped; this
    # connector has no single-key get: LMCache's RemoteBackend.get_blocking answers None)
    objs = sm.batched_get([env.key(s) for s in seeds], location=WHERE)
    for obj, (seed, tokens) in zip(objs, cases, strict=True):
        check_and_release([obj], [seed], tokens)

    missing = env.key(base + 999)
    assert backend.contains(env.key(base)) and not backend.contains(missing)
    assert con.exists_sync(env.key(base + 1)) and not con.exists_sync(missing)
    keys = [env.key(s) for s in seeds]
    assert on_loop(sm, backend.batched_async_contains("l1", [*keys[:2], missing, *keys])) == 2
    assert sm.batched_get([missing], location=WHERE) == [None]


def test_another_process_reads_lmcache_mooncake_values(
    make_sm: Any, store: tuple[str, Any]
) -> None:
    sm = make_sm(False)
    other = Instance(store[0], env.MOONCAKESTORE, {ALIAS_ENV: "1"})
    try:
        env.put(sm, [3000, 3001])
        env.put(sm, [3002], tokens=7)
        env.wait_stored(sm, [3000, 3001, 3002], plugin=env.MOONCAKESTORE)
        assert other.call("get", seeds=[3000, 3001]) == {"match": [True, True]}
        assert other.call("get", seeds=[3002], tokens=7) == {"match": [True]}
        assert other.call("contains", seeds=[3000, 3001, 3999, 3002]) == {"prefix": 2}
        assert other.call("put", seeds=[3010, 3011]) == {"ok": True}
        check_and_release(sm.batched_get([env.key(3010), env.key(3011)], WHERE), [3010, 3011])
    finally:
        other.close()
