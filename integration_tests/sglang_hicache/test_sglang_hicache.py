"""Our HiCache backend inside SGLang's own classes: a real master and store server (processes),
backends made by SGLang's ``StorageBackendFactory`` ("dynamic"), real host pools on CPU."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("sglang", reason="SGLang is not installed (it lives in its own venv)")
pytestmark = pytest.mark.sglang

import torch  # noqa: E402
from hicache_helpers import (  # noqa: E402
    alloc_pages,
    fill_random,
    make_backend,
    make_pool,
    page_bytes,
    page_keys,
)
from store_cluster import FAST, cluster  # noqa: E402

from mooncake_connectors.errors import ConfigError  # noqa: E402

LAYOUTS = ["page_first", "layer_first", "page_first_direct"]


@pytest.fixture(scope="module")
def store() -> Iterator[str]:
    with cluster(1, "64M", tuple(FAST)) as (addr, _, _, _):
        yield addr


def _pages(pool: object, idx: torch.Tensor) -> list[bytes]:
    return [page_bytes(pool, int(i)) for i in idx[::4].tolist()]


def _raw(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().view(torch.uint8).numpy().tobytes())  # random bf16 has NaNs


@pytest.mark.parametrize(
    ("kind", "layout"),
    [(k, lay) for k in ("mha", "mla") for lay in LAYOUTS] + [("mha", "page_head")],
)
def test_two_servers_share_pages_through_the_store(store: str, kind: str, layout: str) -> None:
    mla = kind == "mla"
    src_pool, dst_pool = make_pool(kind, layout), make_pool(kind, layout)
    fill_random(src_pool, 1)
    a = make_backend(store, src_pool, mla=mla)
    b = make_backend(store, dst_pool, mla=mla)
    try:
        keys = page_keys(6)
        src = alloc_pages(src_pool, 6)
        dst = alloc_pages(dst_pool, 6, skip=3)  # other slots in the other pool
        assert b.batch_exists(keys) == 0
        assert a.batch_set_v1(keys, src) == [True] * 6
        assert b.batch_exists(keys) == 6
        assert b.batch_get_v1(keys, dst) == [True] * 6
        assert _pages(dst_pool, dst) == _pages(src_pool, src)
        # Setting pages already in the store succeeds without writing them again.
        assert b.batch_set_v1(keys, dst) == [True] * 6
    finally:
        a.close()
        b.close()


def test_partial_hits_count_only_the_leading_pages(store: str) -> None:
    src_pool, dst_pool = make_pool("mha", "page_first"), make_pool("mha", "page_first")
    fill_random(src_pool, 2)
    a, b = make_backend(store, src_pool), make_backend(store, dst_pool)
    try:
        keys = page_keys(6)
        src = alloc_pages(src_pool, 6)
        stored = [0, 1, 2, 4]
        sel = torch.cat([src[i * 4 : (i + 1) * 4] for i in stored])
        assert a.batch_set_v1([keys[i] for i in stored], sel) == [True] * 4
        assert b.batch_exists(keys) == 3
        assert b.batch_exists(keys[3:]) == 0
        assert b.exists(keys[4]) and not b.exists(keys[5])
        dst = alloc_pages(dst_pool, 6)
        assert b.batch_get_v1(keys, dst) == [True, True, True, False, True, False]
        got, want = _pages(dst_pool, dst), _pages(src_pool, src)
        assert [got[i] == want[i] for i in stored] == [True] * 4
    finally:
        a.close()
        b.close()


def test_tp_ranks_models_and_k_v_are_kept_apart(store: str) -> None:
    pools = [make_pool("mha", "page_first") for _ in range(4)]
    fill_random(pools[0], 3)
    rank0 = make_backend(store, pools[0], tp_rank=0, tp_size=2)
    rank1 = make_backend(store, pools[1], tp_rank=1, tp_size=2)
    other_model = make_backend(store, pools[2], tp_rank=0, tp_size=2, model="org/other")
    rank0_again = make_backend(store, pools[3], tp_rank=0, tp_size=2)
    try:
        keys = page_keys(3)
        src = alloc_pages(pools[0], 3)
        assert rank0.batch_set_v1(keys, src) == [True] * 3
        assert rank1.batch_exists(keys) == 0
        assert other_model.batch_exists(keys) == 0
        assert rank0_again.batch_exists(keys) == 3
        # One K and one V object per page, each holding exactly that half of the page.
        objects = rank0.keys.objects(keys)
        assert [o.rsplit("/", 1)[1] for o in objects] == ["k", "v"] * 3
        assert "/tp0-2.pp0-1/" in objects[0] and "org%2Ftiny-model" in objects[0]
        first = int(src[0])
        k_page = pools[0].kv_buffer[0, first : first + 4].contiguous().view(torch.uint8)
        v_page = pools[0].kv_buffer[1, first : first + 4].contiguous().view(torch.uint8)
        raw = rank0.store.guard.client()
        assert raw is not None
        assert raw.get(objects[0]) == k_page.numpy().tobytes()
        assert raw.get(objects[1]) == v_page.numpy().tobytes()
    finally:
        for backend in (rank0, rank1, other_model, rank0_again):
            backend.close()


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_mla_page_is_written_once_by_the_writer_and_read_by_every_rank(
    store: str, layout: str
) -> None:
    pools = [make_pool("mla", layout) for _ in range(2)]
    fill_random(pools[0], 4)
    fill_random(pools[1], 5)
    writer = make_backend(store, pools[0], mla=True, tp_rank=0, tp_size=2)
    reader = make_backend(store, pools[1], mla=True, tp_rank=1, tp_size=2)
    try:
        assert writer.storage_config.is_storage_writer
        assert not reader.storage_config.is_storage_writer
        # A non-writer rank reports success and stores nothing.
        skipped = page_keys(2)
        assert reader.batch_set_v1(skipped, alloc_pages(pools[1], 2)) == [True, True]
        assert writer.batch_exists(skipped) == 0
        keys = page_keys(4)
        src = alloc_pages(pools[0], 4)
        assert writer.batch_set_v1(keys, src) == [True] * 4
        assert [o.rsplit("/", 1)[1] for o in writer.keys.objects(keys)] == ["kv"] * 4
        assert writer.keys.objects(keys) == reader.keys.objects(keys)  # shared, rank-free
        assert reader.batch_exists(keys) == 4
        dst = alloc_pages(pools[1], 4)
        assert reader.batch_get_v1(keys, dst) == [True] * 4
        assert _pages(pools[1], dst) == _pages(pools[0], src)
    finally:
        writer.close()
        reader.close()


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_layer_first_pages_read_back_into_a_page_first_direct_pool(store: str, kind: str) -> None:
    """Both layouts hold a page layer-major, so they share objects (gathered on one side)."""
    lf, pfd = make_pool(kind, "layer_first"), make_pool(kind, "page_first_direct")
    fill_random(lf, 6)
    a = make_backend(store, lf, mla=kind == "mla")
    b = make_backend(store, pfd, mla=kind == "mla")
    try:
        keys = page_keys(5)
        src, dst = alloc_pages(lf, 5), alloc_pages(pfd, 5, skip=1)
        assert a.batch_set_v1(keys, src) == [True] * 5
        assert b.batch_get_v1(keys, dst) == [True] * 5
        assert _pages(pfd, dst) == _pages(lf, src)
        # page_first orders a page token-major: another format, other objects.
        pf = make_pool(kind, "page_first")
        c = make_backend(store, pf, mla=kind == "mla")
        try:
            assert c.batch_exists(keys) == 0
        finally:
            c.close()
    finally:
        a.close()
        b.close()


def test_whole_page_calls_without_interface_v1(store: str) -> None:
    """SGLang's non-zero-copy path: batch_set of flat pages, batch_get into dummy pages."""
    src_pool, dst_pool = make_pool("mha", "layer_first"), make_pool("mha", "layer_first")
    fill_random(src_pool, 7)
    a = make_backend(store, src_pool, extra={"interface_v1": 0})
    b = make_backend(store, dst_pool, extra={"interface_v1": 0})
    try:
        keys = page_keys(3)
        src = alloc_pages(src_pool, 3)
        pages = [src_pool.get_data_page(int(i), flat=True).contiguous() for i in src[::4]]
        assert a.batch_set(keys[:2], pages[:2]) is True
        assert b.batch_exists(keys) == 2
        dummies = [dst_pool.get_dummy_flat_data_page() for _ in keys]
        got = b.batch_get(keys, dummies)
        assert got[2] is None
        assert [_raw(g) for g in got[:2]] == [_raw(p) for p in pages[:2]]
        assert a.set(keys[2], pages[2]) and b.exists(keys[2])
        fetched = b.get(keys[2])
        assert fetched is not None
        assert _raw(fetched) == _raw(pages[2])
        assert b.get(page_keys(1)[0]) is None
    finally:
        a.close()
        b.close()


def test_clear_stats_and_counters(store: str) -> None:
    pool = make_pool("mha", "page_first")
    fill_random(pool, 8)
    backend = make_backend(store, pool, metrics=True)
    try:
        keys = page_keys(4)
        idx = alloc_pages(pool, 4)
        assert backend.batch_set_v1(keys, idx) == [True] * 4
        assert backend.batch_get_v1(keys, idx) == [True] * 4
        stats = backend.get_stats()
        assert stats.backup_pgs == [4] and stats.prefetch_pgs == [4]
        assert len(stats.backup_bandwidth) == 1 and stats.backup_bandwidth[0] > 0
        assert backend.get_stats().backup_pgs == []  # drained on read, as SGLang expects
        c = backend.counters()
        assert c.objects_put == 8 and c.objects_read == 8 and c.errors == 0
        backend.clear()
        assert backend.batch_exists(keys) == 0
    finally:
        backend.close()


def test_concurrent_backup_and_prefetch_threads_get_whole_pages(store: str) -> None:
    """SGLang sets from its backup thread while its prefetch threads read (staged layout)."""
    import threading

    src_pool, dst_pool = make_pool("mha", "layer_first"), make_pool("mha", "layer_first")
    fill_random(src_pool, 9)
    a = make_backend(store, src_pool, extra={"staging_size": "64K"})
    b = make_backend(store, dst_pool, extra={"staging_size": "64K"})
    rounds = [(page_keys(8), alloc_pages(src_pool, 8)) for _ in range(4)]
    for keys, idx in rounds[:2]:
        assert a.batch_set_v1(keys, idx) == [True] * 8
    dst = [alloc_pages(dst_pool, 8) for _ in range(2)]
    errors: list[str] = []

    def writer() -> None:
        for keys, idx in rounds[2:]:
            if a.batch_set_v1(keys, idx) != [True] * 8:
                errors.append("set")

    def reader(r: int) -> None:
        keys = rounds[r][0]
        for _ in range(3):
            if b.batch_get_v1(keys, dst[r]) != [True] * 8:
                errors.append(f"get {r}")

    threads = [threading.Thread(target=writer)] + [
        threading.Thread(target=reader, args=(r,)) for r in range(2)
    ]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
        assert not errors
        for r in range(2):
            assert _pages(dst_pool, dst[r]) == _pages(src_pool, rounds[r][1])
        assert b.batch_exists([k for keys, _ in rounds for k in keys]) == 32
    finally:
        a.close()
        b.close()


def test_extra_config_is_validated_and_mooncake_names_are_honoured(
    store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hicache_helpers import MODULE, storage_config
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    def create(extra: dict[str, object]) -> object:
        return StorageBackendFactory.create_backend("dynamic", storage_config(extra), None)

    monkeypatch.delenv("MOONCAKE_MASTER", raising=False)
    with pytest.raises(ValueError, match=r"unknown extra-config key.*'mastr'"):
        create({**MODULE, "mastr": store})
    with pytest.raises(ValueError, match="no store master"):
        create(dict(MODULE))
    with pytest.raises(ConfigError, match="timeout"):
        create({**MODULE, "master": store, "timeout": "soon"})
    # SGLang's Mooncake backend names: its key for the master, its env variables.
    b = create({**MODULE, "master_server_address": store, "protocol": "tcp"})
    try:
        assert b.config.master == store and b.store.connected
    finally:
        b.close()
    monkeypatch.setenv("MOONCAKE_MASTER", store)
    monkeypatch.setenv("MOONCAKE_TENANT_ID", "team-a")
    b = create(dict(MODULE))
    try:
        assert b.config.master == store and b.store.connected
        assert b.keys.prefix.startswith("sglang.team-a/")
    finally:
        b.close()
