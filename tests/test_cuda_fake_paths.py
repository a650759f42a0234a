"""The GPU data path's waits, host pinning and VMM access through our real BindingsDriver and
the real cuda-python, over the FAKE libcuda.so.1 (tests/fake_libcuda/; scenarios in
tests/fake_libcuda/scenario_more.py, each in a fresh process with a peer process of its own)."""

from __future__ import annotations

from pathlib import Path

import pytest
from fake_libcuda import build, cuda_python_missing
from test_cuda_bindings_fake import ROOT, run_scenario

pytestmark = pytest.mark.skipif(
    cuda_python_missing() is not None, reason=str(cuda_python_missing())
)
MORE = ROOT / "tests" / "fake_libcuda" / "scenario_more.py"


@pytest.fixture(scope="session")
def fake_lib() -> Path:
    return build()


def test_a_completion_wait_spins_before_it_sleeps_and_keeps_its_deadline(
    fake_lib: Path, tmp_path: Path
) -> None:
    out = run_scenario("waits", tmp_path, MORE)
    done, not_ready, sleeps = out["short"]
    # 20 NOT_READY answers were waited through by querying alone: the thread never gave up
    # its core (no voluntary context switch; each sleep would be one)
    assert done and not_ready == 20 and sleeps == 0
    done, waited, threads = out["never"]
    # an event that never completes: False at the deadline (0.3 s), no helper thread started
    assert not done and 0.3 <= waited < 5 and threads == 1
    assert out["transfer"] == "TransferTimeout" and out["transfer_s"] < 20
    assert not [t for t in out["threads_after"] if "cuda" in t]  # the waiter ended on close
