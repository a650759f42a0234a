"""SGLang PD pieces that need no SGLang: the block list of ``bench sglang-pd --pattern`` and our
SGLang plugin switching the ``mooncake`` alias on."""

from __future__ import annotations

import os
import subprocess
import sys

from mooncake_connectors.bench.sglang_pd_pattern import sglang_blocks


def test_blocks_group_runs_of_consecutive_pages_on_both_sides_per_buffer() -> None:
    # (0,3) (1,4) (2,5) run together; (5,9) does not follow; (6,10) follows (5,9); (7,0) breaks.
    src, dst = [0, 1, 2, 5, 6, 7], [3, 4, 5, 9, 10, 0]
    blocks = sglang_blocks(1000, 50000, buffers=2, buf_bytes=100, item=10, src=src, dst=dst)
    per_buffer = [(0, 3, 3), (5, 9, 2), (7, 0, 1)]
    expected = [
        (1000 + b * 100 + s * 10, 50000 + b * 100 + d * 10, n * 10)
        for b in range(2)
        for s, d, n in per_buffer
    ]
    assert blocks == expected


def test_sglang_plugin_switches_the_alias_on_from_the_environment() -> None:
    code = (
        "import sys\n"
        "from mooncake_connectors.adapters.sglang.plugin import register\n"
        "register()\n"
        "from mooncake.engine import TransferEngine\n"
        "print(TransferEngine.__module__)\n"
    )
    env = dict(os.environ, MOONCAKE_CONNECTORS_AS_MOONCAKE="1")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "mooncake_connectors.compat"
    env.pop("MOONCAKE_CONNECTORS_AS_MOONCAKE")
    off = subprocess.run(
        [
            sys.executable,
            "-c",
            "from mooncake_connectors.adapters.sglang.plugin import register\n"
            "register()\nimport sys\nprint('mooncake' in sys.modules)",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert off.returncode == 0, off.stderr
    assert off.stdout.strip() == "False"  # off: nothing imported, nothing shadowed
