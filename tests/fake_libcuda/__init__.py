"""Build and use the FAKE libcuda.so.1 (fake_libcuda.c): the CUDA driver API over host memory.

The real cuda-python finds the driver by ``dlopen("libcuda.so.1")`` (cuda.pathfinder's system
search), so a process started with :func:`env` on ``LD_LIBRARY_PATH`` loads the fake and our real
``BindingsDriver`` runs on the real bindings. The dynamic loader reads ``LD_LIBRARY_PATH`` once at
start, hence always a fresh subprocess. The library is built once per source version with the
system ``gcc`` into a cache folder under the temp dir.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("fake_libcuda.c")
COUNTERS = (
    "ctx_mismatch",
    "unknown_copy",
    "not_ready",
    "ipc_open",
    "ipc_close",
    "copies",
    "no_ctx",
    "stale",
    "waits",
    "host_register",
)


def cuda_python_missing() -> str | None:
    """Why the real cuda-python cannot be used here, or None."""
    try:
        import cuda.bindings.driver  # noqa: F401
    except ImportError as exc:
        return f"cuda-python (cuda.bindings) is not installed: {exc}"
    if shutil.which("gcc") is None:
        return "no gcc to build the fake libcuda"
    return None


def build() -> Path:
    """The folder holding the built fake ``libcuda.so.1`` (built on first use)."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    folder = Path(tempfile.gettempdir()) / f"mooncake-fake-libcuda-{digest}"
    lib = folder / "libcuda.so.1"
    if lib.exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".libcuda.{os.getpid()}.so"
    subprocess.run(
        ["gcc", "-std=gnu11", "-O1", "-g", "-Wall", "-Werror", "-shared", "-fPIC",
         "-Wl,-soname,libcuda.so.1", "-o", str(tmp), str(SOURCE), "-lpthread"],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    os.replace(tmp, lib)  # atomic: a concurrent build never sees half a library
    return folder


def env(shm_dir: Path, **switches: str) -> dict[str, str]:
    """Environment for a subprocess that loads the fake: its device files live in ``shm_dir``;
    ``switches`` are FAKE_CUDA_* settings (e.g. FAKE_CUDA_FAIL_EXPORT="1")."""
    out = dict(os.environ)
    prev = out.get("LD_LIBRARY_PATH")
    out["LD_LIBRARY_PATH"] = str(build()) + (os.pathsep + prev if prev else "")
    out["FAKE_CUDA_DIR"] = str(shm_dir)
    out.update(switches)
    return out


def counters() -> dict[str, int]:
    """The fake's counters in this process (call only where the fake is the loaded libcuda)."""
    lib = ctypes.CDLL("libcuda.so.1")
    arr = (ctypes.c_long * len(COUNTERS))()
    n = lib.fake_cuda_counters(arr, len(COUNTERS))
    return {name: int(arr[i]) for i, name in enumerate(COUNTERS[:n])}


def current_device() -> int:
    """The device of this thread's current context in the fake, -1 without one."""
    return int(ctypes.CDLL("libcuda.so.1").fake_cuda_current_device())
