"""SGLang's own Mooncake HiCache backend (``--hicache-storage-backend mooncake``), unmodified,
on our store through the opt-in ``mooncake`` alias: a real master and store server (processes),
the backend made by SGLang's ``StorageBackendFactory`` ("mooncake"), real host pools on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang", reason="SGLang is not installed (it lives in its own venv)")
pytestmark = pytest.mark.sglang

import torch  # noqa: E402
from hicache_helpers import (  # noqa: E402
    alloc_pages,
    fill_random,
    make_pool,
    page_bytes,
    page_keys,
    storage_config,
)
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402
from store_cluster import FAST, cluster  # noqa: E402

from mooncake_connectors.compat_alias import (  # noqa: E402
    MARK,
    install_as_mooncake,
    uninstall_mooncake_alias,
)

SGLANG_MODULE = "sglang.srt.mem_cache.storage.mooncake_store.mooncake_store"


@pytest.fixture(scope="module")
def store() -> Iterator[str]:
    with cluster(1, "64M", tuple(FAST)) as (addr, _, _, _):
        yield addr


@pytest.fixture(scope="module", autouse=True)
def alias() -> Iterator[None]:
    install_as_mooncake()  # a ConfigError if anything had imported the real wheel already
    yield
    uninstall_mooncake_alias()


def extra(master: str, **more: Any) -> dict[str, Any]:
    """SGLang's ``--hicache-storage-backend-extra-config`` for Mooncake, pointed at our master."""
    return {
        "master_server_address": master,
        "protocol": "tcp",
        "metadata_server": "P2PHANDSHAKE",
        "global_segment_size": 16 << 20,
        "check_server": False,
        **more,
    }


def sglang_backend(master: str, pool: Any, *, mla: bool = False, **more: Any) -> Any:
    """SGLang's MooncakeStore as its cache controller makes it: factory, then the host pool."""
    cfg = storage_config(extra(master, **more), mla=mla, layout=pool.layout)
    backend = StorageBackendFactory.create_backend("mooncake", cfg, pool)
    backend.register_mem_pool_host(pool)
    return backend


def stored_key(backend: Any, page: str, mla: bool = False) -> str:
    suffix = backend.mla_suffix if mla else backend.mha_suffix
    return f"{backend.config_prefix}_{page}_{suffix}_k"


def _pages(pool: Any, idx: torch.Tensor) -> list[bytes]:
    return [page_bytes(pool, int(i)) for i in idx[:: pool.page_size].tolist()]


def test_the_backend_is_sglangs_class_over_our_facade(store: str) -> None:
    pool = make_pool("mha", "page_first")
    backend = sglang_backend(store, pool)
    try:
        assert type(backend).__module__ == SGLANG_MODULE
        assert type(backend).__name__ == "MooncakeStore"
        assert type(backend.store).__module__ == "mooncake_connectors.compat_store"
        assert getattr(sys.modules["mooncake.store"], MARK)
    finally:
        backend.clear()
        backend.close()


@pytest.mark.parametrize(
    ("kind", "layout"),
    [
        ("mha", "page_first"),
        ("mha", "page_first_direct"),
        ("mla", "page_first"),
        ("mla", "layer_first"),
    ],
)
def test_two_servers_share_pages(store: str, kind: str, layout: str) -> None:
    mla = kind == "mla"
    src_pool, dst_pool = make_pool(kind, layout), make_pool(kind, layout)
    fill_random(src_pool, 7)
    fill_random(dst_pool, 8)
    a = sglang_backend(store, src_pool, mla=mla)
    b = sglang_backend(store, dst_pool, mla=mla)
    try:
        keys = page_keys(5)
        src = alloc_pages(src_pool, 5)
        dst = alloc_pages(dst_pool, 5, skip=2)
        # MLA layer_first: one buffer a layer per key, so SGLang takes the multi-buffer calls.
        multi = b._uses_multi_buffer(b._batch_preprocess(keys, dst)[1])
        assert multi == (layout == "layer_first")
        assert b.batch_exists(keys) == 0
        assert a.batch_set_v1(keys, src) == [True] * 5
        assert b.batch_exists(keys) == 5
        # The store key SGLang makes: model-name prefix, page hash, rank suffix, K/V.
        assert b.exists(stored_key(b, keys[0], mla))
        assert b.batch_get_v1(keys, dst) == [True] * 5
        assert _pages(dst_pool, dst) == _pages(src_pool, src)
        # Pages already stored: SGLang asks batch_is_exist and writes nothing again.
        assert b.batch_set_v1(keys, dst) == [True] * 5
    finally:
        a.close()
        b.close()


def test_missing_and_partial_pages_are_answered_as_sglang_expects(store: str) -> None:
    src_pool, dst_pool = make_pool("mha", "page_first"), make_pool("mha", "page_first")
    fill_random(src_pool, 9)
    a, b = sglang_backend(store, src_pool), sglang_backend(store, dst_pool)
    try:
        keys = page_keys(4)
        src = alloc_pages(src_pool, 4)
        dst = alloc_pages(dst_pool, 4)
        before = _pages(dst_pool, dst)
        stored = [0, 1, 3]
        sel = torch.cat([src[i * 4 : (i + 1) * 4] for i in stored])
        assert a.batch_set_v1([keys[i] for i in stored], sel) == [True] * 3
        assert b.batch_exists(keys) == 2  # the leading run of hits
        assert b.batch_exists(keys[2:3]) == 0
        assert b.exists(stored_key(b, keys[1]))
        assert not b.exists(stored_key(b, keys[2]))
        # A miss reads as a failed page (Mooncake's negative code), the others arrive intact.
        assert b.batch_get_v1(keys, dst) == [True, True, False, True]
        got, want = _pages(dst_pool, dst), _pages(src_pool, src)
        assert [got[i] for i in stored] == [want[i] for i in stored]
        assert got[2] == before[2]  # the missing page's slot is left alone
        assert b.store.get(stored_key(b, keys[2])) == b""  # Mooncake's get of a miss
        assert b.store.is_exist(stored_key(b, keys[2])) == 0
        assert b.store.is_exist(stored_key(b, keys[3])) == 1
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("source", ["env", "file"])
def test_config_from_env_or_file(
    store: str, source: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang's other two config sources: ``MOONCAKE_*`` variables, and the JSON file named
    by ``SGLANG_HICACHE_MOONCAKE_CONFIG_PATH`` (no ``master_server_address`` in extra_config)."""
    if source == "env":
        monkeypatch.setenv("MOONCAKE_MASTER", store)
        monkeypatch.setenv("MOONCAKE_PROTOCOL", "tcp")
        monkeypatch.setenv("MOONCAKE_GLOBAL_SEGMENT_SIZE", str(16 << 20))
    else:
        path = tmp_path / "mooncake.json"
        path.write_text(json.dumps(extra(store)))
        monkeypatch.setenv("SGLANG_HICACHE_MOONCAKE_CONFIG_PATH", str(path))
    src_pool, dst_pool = make_pool("mha", "page_first"), make_pool("mha", "page_first")
    fill_random(src_pool, 11)
    cfg = storage_config({}, layout="page_first")
    a = StorageBackendFactory.create_backend("mooncake", cfg, src_pool)
    b = StorageBackendFactory.create_backend("mooncake", cfg, dst_pool)
    try:
        assert a.config.master_server_address == store
        for backend, pool in ((a, src_pool), (b, dst_pool)):
            backend.register_mem_pool_host(pool)
        keys = page_keys(2)
        src, dst = alloc_pages(src_pool, 2), alloc_pages(dst_pool, 2, skip=1)
        assert a.batch_set_v1(keys, src) == [True, True]
        assert b.batch_get_v1(keys, dst) == [True, True]
        assert _pages(dst_pool, dst) == _pages(src_pool, src)
    finally:
        a.close()
        b.close()


def test_zero_copy_set_get_and_clear(store: str) -> None:
    """SGLang's ``set``/``get``/``batch_set``/``batch_get`` over raw host pointers, then
    ``clear`` (Mooncake's ``remove_all``)."""
    pool = make_pool("mha", "page_first")
    backend = sglang_backend(store, pool)
    src = torch.arange(4096, dtype=torch.uint8).repeat(2)
    dst = torch.zeros_like(src)
    backend.register_buffer(src)
    backend.register_buffer(dst)
    half = src.numel() // 2
    try:
        k1, k2 = page_keys(2)
        assert backend.set(k1, target_location=src.data_ptr(), target_sizes=half)
        assert backend.batch_set(
            [k1, k2],
            target_locations=[src.data_ptr(), src.data_ptr() + half],
            target_sizes=[half, half],
        )
        assert backend.get(k1, target_location=dst.data_ptr(), target_sizes=half)
        assert (
            backend.batch_get(
                [k2, page_keys(1)[0]],
                target_locations=[dst.data_ptr() + half, dst.data_ptr()],
                target_sizes=[half, half],
            )
            == 0
        )  # SGLang counts K and V keys in pairs: one hit of two keys is no page
        assert bytes(dst.numpy()) == bytes(src.numpy())
        backend.clear()
        assert not backend.exists(k1) and not backend.exists(k2)
    finally:
        backend.close()


def test_standalone_storage_is_refused_with_a_clear_error(store: str) -> None:
    """Mooncake's standalone mode (a dummy client beside a ``mooncake_client`` process)
    is not provided: SGLang's allocator import fails naming what the alias provides."""
    from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import (
        MooncakeHostTensorAllocator,
    )

    with pytest.raises(ImportError, match="MooncakeHostMemAllocator"):
        MooncakeHostTensorAllocator()


def test_alias_off_sglang_reports_mooncake_missing_itself(tmp_path: Path) -> None:
    """Alias off, Mooncake not installed: SGLang's own ImportError, not one of ours. The
    environment without Mooncake is this venv's site-packages less its mooncake entries."""
    import site

    site_dir = Path(next(p for p in site.getsitepackages() if p.endswith("site-packages")))
    env_dir = tmp_path / "site-packages"
    env_dir.mkdir()
    for entry in site_dir.iterdir():
        if not entry.name.lower().startswith(("mooncake", "__editable__")):
            (env_dir / entry.name).symlink_to(entry)
    root = Path(__file__).resolve().parents[2]
    script = (
        "import sys\n"
        f"from {SGLANG_MODULE} import MooncakeStore\n"
        "try:\n"
        "    MooncakeStore()\n"
        "except ImportError as e:\n"
        "    print('ERR', type(e).__name__, type(e).__module__, e, '|', e.__cause__)\n"
        "import importlib.util\n"
        "print('FOUND', importlib.util.find_spec('mooncake'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "MOONCAKE_CONNECTORS_AS_MOONCAKE"}
    env["PYTHONPATH"] = f"{env_dir}{os.pathsep}{root}"
    with tempfile.TemporaryDirectory() as cwd:
        out = subprocess.run(
            [sys.executable, "-S", "-c", script],
            env=env,
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert out.returncode == 0, out.stderr[-3000:]
    err = next(line for line in out.stdout.splitlines() if line.startswith("ERR"))
    assert "Please install mooncake" in err  # SGLang's message
    assert "No module named 'mooncake'" in err  # Python's own, not the alias's
    assert "mooncake_connectors" not in err
    assert "FOUND None" in out.stdout
