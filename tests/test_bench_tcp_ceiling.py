"""The iperf3 loopback ceiling beside ``bench transfer``: bounded runs, clear failures."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from mooncake_connectors.bench import tcp_ceiling


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="1048576 bytes"):
        tcp_ceiling.loopback_gb_s(1, length=4 << 20)
    with pytest.raises(ValueError, match="streams"):
        tcp_ceiling.loopback_gb_s(0)
    with pytest.raises(ValueError, match="whole seconds"):
        tcp_ceiling.loopback_gb_s(1, seconds=0)


def test_a_missing_binary_is_an_error_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tcp_ceiling, "IPERF3", "/nonexistent/iperf3")
    assert not tcp_ceiling.available()
    with pytest.raises(RuntimeError, match="could not start"):
        tcp_ceiling.loopback_gb_s(1, seconds=1)


def test_a_failing_client_is_reported_and_its_server_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A stand-in whose server mode waits forever and whose client mode fails: the call must
    # come back with the client's message and leave no server behind.
    script = tmp_path / "iperf3"
    pidfile = tmp_path / "server.pid"
    script.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = "-s" ]; then echo $$ > {pidfile}; exec sleep 30; fi\n'
        # the client fails only once the server is up (pid written), so the stop is tested
        f"i=0; while [ ! -s {pidfile} ] && [ $i -lt 100 ]; do sleep 0.05; i=$((i+1)); done\n"
        "echo 'boom: no such test' >&2\nexit 1\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr(tcp_ceiling, "IPERF3", str(script))
    with pytest.raises(RuntimeError, match="boom"):
        tcp_ceiling.loopback_gb_s(1, seconds=1)
    pid = int(pidfile.read_text())
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()


@pytest.mark.skipif(not tcp_ceiling.available(), reason="iperf3 not installed")
def test_iperf3_measures_loopback() -> None:
    assert tcp_ceiling.loopback_gb_s(1, seconds=1) > 0.01
