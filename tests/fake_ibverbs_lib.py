"""Builds the FAKE libibverbs.so.1 (tests/fake_ibverbs/*.c, an emulated RDMA NIC below the real
pyverbs) with gcc, and the environment that makes a child process load it.

The library is built once per source digest under build/fake-ibverbs/ (ignored by git). A child
started with ``env(...)`` finds it first on LD_LIBRARY_PATH, so Debian's pyverbs, and the
transport's verbs.py above it, run over the emulation unchanged. This process is never switched:
the dynamic loader reads LD_LIBRARY_PATH only at start.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import uuid
from pathlib import Path

SRC = Path(__file__).parent / "fake_ibverbs"
FILES = ("fake_libibverbs.c", "fake_libibverbs_stubs.c", "fake_libibverbs.map")
OUT = Path(__file__).resolve().parent.parent / "build" / "fake-ibverbs"


def missing() -> str | None:
    """Why the library cannot be built here (None: it can)."""
    if shutil.which("gcc") is None:
        return "gcc is not installed"
    if not Path("/usr/include/infiniband/verbs.h").exists():
        return "infiniband/verbs.h is missing (apt-get install libibverbs-dev)"
    return None


def build() -> Path:
    """The directory holding the built libibverbs.so.1."""
    digest = hashlib.sha256(b"".join((SRC / f).read_bytes() for f in FILES)).hexdigest()[:16]
    out = OUT / digest
    lib = out / "libibverbs.so.1"
    if lib.exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".libibverbs.{os.getpid()}.so"
    subprocess.run(
        [
            "gcc", "-O2", "-g", "-Wall", "-fPIC", "-shared",
            f"-Wl,--version-script={SRC / 'fake_libibverbs.map'}",
            "-Wl,-soname,libibverbs.so.1",
            "-o", str(tmp),
            str(SRC / "fake_libibverbs.c"), str(SRC / "fake_libibverbs_stubs.c"),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )  # fmt: skip
    os.replace(tmp, lib)  # concurrent builders each publish a whole file
    return out


def new_fabric() -> str:
    """A fresh fabric name: processes given the same one see each other's NICs."""
    return f"t{os.getpid()}-{uuid.uuid4().hex[:8]}"


def drop_fabric(fabric: str) -> None:
    Path(f"/dev/shm/fake-ibverbs-{fabric}").unlink(missing_ok=True)
    for pattern in ("down", "gids"):
        for f in Path("/dev/shm").glob(f"fake-ibverbs-{fabric}.*.{pattern}"):
            f.unlink(missing_ok=True)


def port_down_file(fabric: str, host: int, nic: str) -> Path:
    """While this file exists, port 1 of ``nic`` of host ``host`` is DOWN (the cable pulled)."""
    return Path(f"/dev/shm/fake-ibverbs-{fabric}.{host}.{nic}.down")


def set_gids(fabric: str, host: int, nic: str, entries: dict[int, tuple[str, str] | None]) -> None:
    """Change the GID table of ``nic`` of host ``host`` now, as the kernel does when an address
    is added to or removed from its netdev: index -> (GID, "v1"|"v2"), or None to empty it."""
    lines = [f"{i} -" if e is None else f"{i} {e[0]} {e[1]}" for i, e in sorted(entries.items())]
    path = Path(f"/dev/shm/fake-ibverbs-{fabric}.{host}.{nic}.gids")
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)  # the library never reads half a table


def env(
    libdir: Path, devices: str, fabric: str, host: int, retry_scale: float = 0.01
) -> dict[str, str]:
    """The environment of a child whose NICs are ``devices`` ("name:roce|ib:mtu[:routed]",
    comma-separated) on ``fabric``, as host number ``host``; a failed retry is reported after
    ``retry_scale`` times the time a NIC would take."""
    old = os.environ.get("LD_LIBRARY_PATH")
    return {
        **os.environ,
        "LD_LIBRARY_PATH": f"{libdir}:{old}" if old else str(libdir),
        "FAKE_IBV_DEVICES": devices,
        "FAKE_IBV_FABRIC": fabric,
        "FAKE_IBV_HOST": str(host),
        "FAKE_IBV_RETRY_SCALE": str(retry_scale),
    }
