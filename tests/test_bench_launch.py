"""The bench launcher confines a server's whole process tree to its CPUs when asked."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from mooncake_connectors.bench.launch import Server, VllmServer

CHILD = (
    "import os, subprocess, sys; print('parent', sorted(os.sched_getaffinity(0)), flush=True); "
    "subprocess.run([sys.executable, '-c', "
    "'import os; print(\"child\", sorted(os.sched_getaffinity(0)), flush=True)'])"
)


class _Probe(Server):
    name = "probe"

    def __init__(self, log_dir: Path, cpus: set[int] | None) -> None:
        super().__init__(log_dir)
        self._cpus = cpus

    def command(self) -> list[str]:
        return [sys.executable, "-c", CHILD]

    def cpus(self) -> set[int] | None:
        return self._cpus


def _run(probe: _Probe) -> str:
    probe.launch()
    assert probe.proc is not None
    probe.proc.wait(timeout=60)
    return probe.log_path.read_text()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux CPU affinity")
def test_pinned_server_and_its_children_run_on_its_cpu(tmp_path: Path) -> None:
    cpu = min(os.sched_getaffinity(0))
    text = _run(_Probe(tmp_path, {cpu}))
    assert f"parent [{cpu}]" in text and f"child [{cpu}]" in text
    free = sorted(os.sched_getaffinity(0))
    assert f"child {free}" in _run(_Probe(tmp_path, None))


def test_vllm_server_pins_only_when_asked(tmp_path: Path) -> None:
    model = tmp_path / "model"
    assert VllmServer(tmp_path, model, core=1).cpus() is None
    pinned = VllmServer(tmp_path, model, core=1, pin_all=True, dtype="float32")
    assert pinned.cpus() == {1}
    cmd = pinned.command()
    assert cmd[cmd.index("--dtype") + 1] == "float32"
