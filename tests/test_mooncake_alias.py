"""The opt-in ``mooncake`` alias, each case in a fresh interpreter (imports are process state)."""

from __future__ import annotations

import importlib.machinery
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mooncake_connectors.config import ALIAS_ENV, alias_from_env
from mooncake_connectors.errors import ConfigError

ROOT = str(Path(__file__).resolve().parents[1])
REAL = importlib.machinery.PathFinder.find_spec("mooncake")  # Mooncake's wheel, if installed


def run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k != ALIAS_ENV}
    base["PYTHONPATH"] = os.pathsep.join([ROOT, base.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def ok(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


WHAT = """
import importlib.util, sys
from mooncake_connectors import compat_alias
on = compat_alias.install_from_env()
spec = importlib.util.find_spec("mooncake")
print(on, None if spec is None else getattr(spec.loader, "__class__").__name__)
"""


def test_off_by_default() -> None:
    out = ok(run(WHAT)).split()
    assert out[0] == "False"
    assert out[1] != "_Loader"  # the installed Mooncake, or None where there is none


def test_env_var_on_gives_our_facades() -> None:
    proc = run(
        """
        from mooncake_connectors.compat_alias import install_from_env
        assert install_from_env()
        from mooncake.engine import TransferEngine
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig
        from mooncake_connectors import compat, compat_store
        assert TransferEngine is compat.TransferEngine
        assert MooncakeDistributedStore is compat_store.MooncakeDistributedStore
        assert ReplicateConfig is compat_store.ReplicateConfig
        install_from_env()  # again: a no-op, no second log line
        print("ok")
        """,
        **{ALIAS_ENV: "1"},
    )
    assert ok(proc).strip() == "ok"
    lines = [ln for ln in proc.stderr.splitlines() if "mooncake alias on" in ln]
    assert len(lines) == 1, proc.stderr
    # An installed Mooncake is shadowed only because the alias was switched on, and said so.
    assert ("shadowing the Mooncake installed at" in lines[0]) == (REAL is not None)


def test_function_switches_children_on_through_the_environment() -> None:
    out = ok(
        run(
            f"""
            import subprocess, sys
            from mooncake_connectors.compat import install_as_mooncake
            install_as_mooncake()
            import mooncake.store
            child = subprocess.run([sys.executable, "-c", {WHAT!r}], capture_output=True,
                                   text=True, timeout=120)
            print(mooncake.store.__mooncake_connectors_alias__, child.stdout.strip())
            """
        )
    )
    assert out.split() == ["True", "True", "_Loader"]


def test_real_mooncake_imported_first_is_refused_not_mixed() -> None:
    if REAL is None:
        pytest.skip("Mooncake's wheel is not installed here")
    proc = run(
        """
        import mooncake.store
        from mooncake_connectors.compat import install_as_mooncake
        from mooncake_connectors.errors import ConfigError
        try:
            install_as_mooncake()
        except ConfigError as exc:
            print("refused:", exc)
        assert not hasattr(mooncake.store, "__mooncake_connectors_alias__")
        """
    )
    assert "refused: the mooncake alias cannot take effect" in ok(proc)


def test_other_mooncake_modules_are_a_clear_import_error() -> None:
    out = ok(
        run(
            """
            from mooncake_connectors.compat import install_as_mooncake
            install_as_mooncake()
            try:
                from mooncake.allocator import NVLinkAllocator
            except ImportError as exc:  # what vLLM catches
                print(type(exc).__name__, exc)
            """
        )
    )
    assert out.startswith("ModuleNotFoundError No module named 'mooncake.allocator'")
    assert "provides mooncake.engine, mooncake.store only" in out


def test_alias_env_values() -> None:
    assert alias_from_env({}) is False
    assert alias_from_env({ALIAS_ENV: "0"}) is False
    assert alias_from_env({ALIAS_ENV: " On "}) is True
    with pytest.raises(ConfigError, match=ALIAS_ENV):
        alias_from_env({ALIAS_ENV: "maybe"})


def test_vllm_plugin_loader_switches_it_on_in_every_vllm_process() -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed (its own venv)")
    code = """
        from vllm.plugins import load_general_plugins
        load_general_plugins()  # what vLLM runs in its API server, engine core and workers
        import mooncake.store
        print(getattr(mooncake.store, "__mooncake_connectors_alias__", False))
        """
    assert ok(run(code, **{ALIAS_ENV: "1"})).split()[-1] == "True"
    assert ok(run(code)).split()[-1] == "False"  # off by default, plugin loaded or not


@pytest.mark.parametrize("transports", ["tcp", "shm,tcp"])
def test_vllm_ec_connector_transfer_runs_on_our_engine(transports: str) -> None:
    """vLLM's EC connector data plane (its MooncakeTransfer class, unmodified) on our engine."""
    pytest.importorskip("vllm", reason="vLLM is not installed (its own venv)")
    code = """
        import torch
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        from vllm.distributed.ec_transfer.ec_connector.mooncake.transfer import (
            MooncakeTransfer, ensure_mooncake_available)
        import mooncake.engine
        assert mooncake.engine.__mooncake_connectors_alias__
        ensure_mooncake_available()
        src, dst = MooncakeTransfer("127.0.0.1", "tcp"), MooncakeTransfer("127.0.0.1", "tcp")
        g = torch.Generator().manual_seed(5)
        a = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=g)
        b = torch.zeros_like(a)
        assert dst.register_memory(b) == 0
        sources = src.acquire_sources([a[: 1 << 10], a[1 << 10 :]])  # sibling views
        base = b.data_ptr()
        src.write(dst.local_session(), sources, [base, base + (1 << 10)],
                  [1 << 10, (1 << 20) - (1 << 10)])
        assert torch.equal(a, b)
        try:
            src.write(dst.local_session(), sources[:1], [base + (1 << 20)], [1 << 10])
        except RuntimeError as exc:  # outside what the peer registered: refused, not written
            print("refused:", exc)
        assert src.release_sources(sources) and dst.unregister_memory(b)
        src.close()
        dst.close()
        print("ok")
        """
    out = ok(run(code, **{ALIAS_ENV: "1", "MOONCAKE_CONNECTORS_TRANSPORTS": transports}))
    assert out.split()[-1] == "ok"
    assert "refused: Mooncake EC push to 127.0.0.1:" in out


def test_vllm_embedding_store_client_runs_on_our_store(tmp_path: Path) -> None:
    """vLLM's EC embedding store client (unmodified; it calls batch_put_from_multi_buffers with
    a header and a tensor, then batch_get_into) round-trips a tensor through our store."""
    pytest.importorskip("vllm", reason="vLLM is not installed (its own venv)")
    import json

    from mooncake_connectors.store import Master, MasterConfig

    with Master(MasterConfig(port=0)) as master:
        config = tmp_path / "mooncake.json"
        config.write_text(
            json.dumps(
                {
                    "metadata_server": "P2PHANDSHAKE",
                    "master_server_address": master.address,
                    "protocol": "tcp",
                    "global_segment_size": "64MB",
                    "local_buffer_size": "16MB",
                }
            )
        )
        code = """
            import torch
            from vllm.plugins import load_general_plugins
            load_general_plugins()
            from vllm.distributed.ec_transfer.ec_connector.mooncake_store_embedding import (
                store_client)
            from vllm.distributed.ec_transfer.ec_connector.mooncake_store_embedding.data import (
                TensorSpec)
            c = store_client.create_mooncake_embedding_store_client(read_buffer_bytes=8 << 20)
            t = torch.randn(37, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
            c.put_tensor("emb-1", t)
            print(c.batch_exists(["emb-1", "emb-2"]))
            spec = TensorSpec(shape=tuple(t.shape), dtype=str(t.dtype), nbytes=t.nbytes)
            got = c.load_tensors({"emb-1": spec, "emb-2": spec}, "cpu")
            print(sorted(got), torch.equal(got["emb-1"], t))
            c.close()
            """
        env = {ALIAS_ENV: "1", "MOONCAKE_CONFIG_PATH": str(config), "VLLM_HOST_IP": "127.0.0.1"}
        out = ok(run(code, **env)).splitlines()
    assert out[-2:] == ["[True, False]", "['emb-1'] True"]
