"""Rehearsal of scripts/gpu/check_transfer.py the way a GPU machine runs it, over the FAKE libcuda.

A GPU machine gets the tracked (and untracked, unignored) files and the dependencies as wheels
unpacked into a folder: no install of this package, so no entry points or egg-info. Here: those
files copied to a temp folder, a bare venv (no site-packages of ours), the dependencies from this
interpreter's site-packages linked into one folder without this package's install, and the
script run with the command its docstring gives.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest
from fake_libcuda import build, cuda_python_missing, env

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(
    cuda_python_missing() is not None
    or shutil.which("git") is None
    or not (ROOT / ".git").exists(),
    reason=str(cuda_python_missing() or "not a git checkout: no list of tracked files"),
)


@pytest.fixture(scope="module")
def bare(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(copy of the files, bare interpreter, folder of dependencies)."""
    top = tmp_path_factory.mktemp("gpu-machine")
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT, capture_output=True, check=True, timeout=60,
    ).stdout.decode().split("\0")  # fmt: skip
    copy = top / "repo"
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (copy / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, copy / rel)
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(top / "venv")], check=True, timeout=120
    )
    site = top / "site"
    site.mkdir()
    ours = ("mooncake_connectors", "__editable__", "_mooncake_connectors")
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.startswith(ours) and entry.suffix != ".pth":
            (site / entry.name).symlink_to(entry)
    build()
    return copy, top / "venv" / "bin" / "python", site


def run_check(bare: tuple[Path, Path, Path], out: Path, **switches: str) -> tuple[int, Any]:
    copy, python, site = bare
    out.mkdir()
    e = env(out, **switches)
    e["PYTHONPATH"] = f"{site}{os.pathsep}{copy}"
    proc = subprocess.run(
        [str(python), "scripts/gpu/check_transfer.py", "--quick", "--out", str(out)],
        cwd=copy, env=e, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    path = out / "gpu_check.json"
    assert path.exists(), f"no JSON (rc={proc.returncode}): {proc.stderr[-3000:]}"
    return proc.returncode, json.loads(path.read_text())


def test_the_check_runs_from_a_bare_copy_and_checks_every_case(
    bare: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    rc, result = run_check(bare, tmp_path / "ok")
    assert (rc, result["failures"]) == (0, []), result.get("tracebacks", result)
    assert result["package"].startswith(str(bare[0]))  # the copy's code, not an install
    assert any("FAKE CUDA device 0" in line for line in result["doctor"])
    sweeps = {
        "cuda_ipc": {"gpu_gpu", "gpu_vmm", "vmm_gpu", "host_gpu", "gpu_memfd_host"},
        "tcp": {"gpu_gpu_staged", "host_host"},
    }
    for transport, names in sweeps.items():
        part = result[transport]
        assert set(part) == names | {"ordering", "pd_session", "store"}, transport
        for name in names:
            sizes = part[name]
            assert sizes and all(v["bytes_and_guards_ok"] for v in sizes.values()), name
        # C4: the queued bytes reached the peer through the fence; without it they did not
        # (the fake lands the application's work only when something orders after it)
        assert part["ordering"] == {
            "control_without_fence_saw_the_bytes": False,
            "driver_stream": {"bytes_and_guards_ok": True},
        }, transport
        # C5: the PD session's layer-wise push (each layer's kernel, then save_kv_layer at
        # once) and pull, and the store worker's puts and gets, on KV in vLLM's GPU layout
        pd = part["pd_session"]
        for case in ("push", "pull"):
            assert pd[case]["bytes_and_guards_ok"] and pd[case]["layers_ok"] == 2, (transport, pd)
        assert pd["prefill_guards_ok"]
        assert part["store"]["bytes_and_guards_ok"] and part["store"]["layers_ok"] == 2
    assert result["torch"] is None  # CPU torch: its kernels as producers run on a GPU only
    assert result["tcp_loops"] == "pure Python"  # nothing compiled in a copy of the files


def test_wrong_bytes_fail_the_run_and_the_json_is_still_written(
    bare: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    rc, result = run_check(bare, tmp_path / "corrupt", FAKE_CUDA_CORRUPT_COPIES="1")
    assert rc == 1
    assert any(f.startswith("gpu->gpu") for f in result["failures"])
    rc, result = run_check(bare, tmp_path / "nowait", FAKE_CUDA_IGNORE_WAITS="1")
    assert rc == 1  # copies that do not wait for the producer are caught, per transport
    for transport in ("cuda_ipc", "tcp"):
        assert f"pd session push over {transport}" in " ".join(result["failures"])
    assert sum(f.startswith("ordering: a fenced copy") for f in result["failures"]) == 2
    rc, result = run_check(bare, tmp_path / "noinit", FAKE_CUDA_FAIL_INIT="1")
    assert rc == 1 and any("CUDA_ERROR_NO_DEVICE" in f for f in result["failures"])
