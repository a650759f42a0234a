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


def test_host_memory_is_pinned_at_registration_and_connect_not_on_the_first_transfer(
    fake_lib: Path, tmp_path: Path
) -> None:
    out = run_scenario("pinning", tmp_path, MORE)
    assert out["host_gpu"] == [True, True] and out["gpu_host"] == [True, True]
    at_setup, on_transfers = out["registers"]
    assert at_setup == 2  # this process's buffer, the peer's buffer mapped here
    assert on_transfers == 0
    assert out["unknown_copy"] == 0  # every copy touched pinned memory


def test_memory_the_driver_will_not_pin_stays_registered_and_moves_over_tcp(
    fake_lib: Path, tmp_path: Path
) -> None:
    out = run_scenario("pin_refused", tmp_path, MORE)
    assert out["registered"]
    for case in ("host_gpu", "gpu_host", "gpu_host_again"):
        assert out[case] == [True, True], case
    local, peer = out["pin_warnings"]  # one each, however many publishes and transfers
    assert "would not pin" in local and "stays registered" in local
    assert "could not be pinned here" in peer and "tcp" in peer


def test_read_only_and_page_sharing_host_regions_are_pinned(fake_lib: Path, tmp_path: Path) -> None:
    out = run_scenario("host_kinds", tmp_path, MORE)
    assert out["read_only"]  # pinned with CU_MEMHOSTREGISTER_READ_ONLY, else refused
    # the second region: refused as a whole (its first page is the first region's), then
    # its first page skipped as pinned already and the rest pinned
    assert out["shared_page_registers"] == 4
    assert out["shared_page"] == [True, True]
    assert out["unknown_copy"] == 0 and out["warnings"] == []


def test_a_vmm_import_is_usable_from_every_local_device(fake_lib: Path, tmp_path: Path) -> None:
    out = run_scenario("vmm_devices", tmp_path, MORE)
    assert out["dev1"] == [True, True] and out["dev0"] == [True, True]
    assert out["unknown_copy"] == 0


def test_a_vmm_export_this_process_cannot_open_moves_over_tcp(
    fake_lib: Path, tmp_path: Path
) -> None:
    """What `doctor` promises when pidfd_getfd is refused: the engine falls back to tcp."""
    out = run_scenario("vmm_refused", tmp_path, MORE)
    assert out["vmm"] == [True, True]


def test_a_refused_dmabuf_export_and_a_refused_fd_duplication_are_typed_errors(
    fake_lib: Path, tmp_path: Path
) -> None:
    from test_cuda_bindings_fake import run_code

    code = (
        "import os\n"
        "from mooncake_connectors.errors import GpuError\n"
        "from mooncake_connectors.transfer_core import cuda_driver\n"
        "from mooncake_connectors.transfer_core._cuda_bindings import _pidfd_getfd\n"
        "from fake_libcuda import mem\n"
        "mem.init()\n"
        "addr = mem.alloc(0, 1 << 20)\n"
        "for call in (lambda: cuda_driver.driver().dmabuf_export(addr + 100, 5000),\n"
        "             lambda: _pidfd_getfd(os.getpid(), 999_999)):\n"
        "    try:\n"
        "        call()\n"
        "    except GpuError as exc:\n"
        "        print(type(exc).__name__, exc.call, exc.message)\n"
    )
    lines = run_code(f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r})\n" + code, tmp_path)
    dmabuf, dup = lines.splitlines()
    assert dmabuf.startswith("GpuError cuMemGetHandleForAddressRange") and "NOT_SUPPORTED" in dmabuf
    assert dup.startswith("GpuError") and "cannot duplicate fd 999999" in dup
