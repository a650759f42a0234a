"""The vLLM connectors ask Linux for AMX tile state before vLLM's CPU attention kernel runs.

A fresh process may not execute AMX instructions until it asks; a decode worker whose first
forward is a one-token step over transferred KV died with SIGILL on AMX hosts before this.
"""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

from mooncake_connectors.cpu_amx import cpu_has_amx

SCRIPT = """
from mooncake_connectors.cpu_amx import amx_permitted, enable_amx_tiles
before = amx_permitted()
print(before, enable_amx_tiles(), amx_permitted())
"""


@pytest.mark.skipif(
    platform.machine() != "x86_64" or not cpu_has_amx(), reason="this CPU has no AMX"
)
def test_a_fresh_process_gets_amx_tile_state() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, check=True
    ).stdout.split()
    assert out == ["False", "True", "True"]


def test_cpu_flags_are_read_from_the_flags_line(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor : 0\nflags : fpu sse2 avx512f amx_bf16 amx_tile\n")
    assert cpu_has_amx(info)
    info.write_text("processor : 0\nflags : fpu sse2 avx512f\nbugs : amx_tile\n")
    assert not cpu_has_amx(info)
    assert not cpu_has_amx(tmp_path / "missing")
