"""The bench launcher: a server's whole process tree on its CPUs when asked; a server whose
reserved port another process took starts again on a fresh one, a bounded number of times; our
master binds port 0 and reports the port it got."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from mooncake_connectors.bench.launch import (
    FRESH_PORT,
    PORT_ATTEMPTS,
    ProxyServer,
    Server,
    StoreMaster,
    VllmServer,
    http_ok,
    runs_only_our_connectors,
)
from mooncake_connectors.bench.ports import holders
from mooncake_connectors.bench.procs import start_master, stop_all
from mooncake_connectors.cpu_amx import cpu_has_amx

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


OURS_PD = {"kv_connector": "MooncakeConnectorsPD", "kv_role": "kv_consumer"}
NIXL = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}


def _multi(*subs: dict[str, object]) -> dict[str, object]:
    return {"kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors": subs}}


def test_only_a_foreign_connectors_engine_gets_the_amx_request(tmp_path: Path) -> None:
    store = {"kv_connector": "MooncakeConnectorsStore", "kv_role": "kv_both"}
    assert runs_only_our_connectors(None) and runs_only_our_connectors(OURS_PD)
    assert runs_only_our_connectors(_multi(OURS_PD, store))
    assert not runs_only_our_connectors(NIXL)
    assert not runs_only_our_connectors(_multi(OURS_PD, NIXL))
    model = tmp_path / "model"
    ours = VllmServer(tmp_path, model, core=0, kv_transfer_config=OURS_PD)
    # ours must ask by itself (tests/test_cpu_amx.py): nothing on its path helps it
    assert ours.environment().get("PYTHONPATH") == os.environ.get("PYTHONPATH")
    theirs = VllmServer(tmp_path, model, core=0, kv_transfer_config=NIXL, sitecustomize="X = 1\n")
    env = theirs.environment()
    site = Path(env["PYTHONPATH"].split(os.pathsep)[0]) / "sitecustomize.py"
    assert "ARCH_REQ_XCOMP_PERM" in site.read_text() and site.read_text().endswith("X = 1\n")


@pytest.mark.skipif(not cpu_has_amx(), reason="this CPU has no AMX")
def test_a_foreign_connectors_engine_may_use_amx_from_its_start(tmp_path: Path) -> None:
    """What vLLM's CPU attention kernel needs before an engine's first short forward: the
    engine's Python (here a plain one, with the launcher's environment) has AMX tile state
    before it imports anything."""
    env = VllmServer(tmp_path, tmp_path / "m", core=0, kv_transfer_config=NIXL).environment()
    probe = "from mooncake_connectors.cpu_amx import amx_permitted; print(amx_permitted())"
    out = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.stdout.split() == ["True"], out.stderr


class _Http(Server):
    """Python's own HTTP server, serving a directory with a ``health`` file: a real process
    that fails with "Address already in use" when its port is taken."""

    name = "http"

    def __init__(self, log_dir: Path, port: int | None = None) -> None:
        super().__init__(log_dir, port)
        self.root = log_dir / "root"
        self.root.mkdir(exist_ok=True)
        (self.root / "health").write_text("ok")

    def command(self) -> list[str]:
        root = str(self.root)
        return [sys.executable, "-m", "http.server", "-b", "127.0.0.1", "-d", root, str(self.port)]


@pytest.fixture
def taken() -> Iterator[list[socket.socket]]:
    """Listening sockets of this process, closed after the test."""
    socks: list[socket.socket] = []
    yield socks
    for s in socks:
        s.close()


def _occupy(port: int, socks: list[socket.socket]) -> None:
    s = socket.socket()
    socks.append(s)
    s.bind(("127.0.0.1", port))
    s.listen()


def test_a_server_whose_port_was_taken_starts_again_on_a_fresh_one(
    tmp_path: Path, taken: list[socket.socket]
) -> None:
    srv = _Http(tmp_path)
    first = srv.port
    _occupy(first, taken)  # another process took it between the reservation and the bind
    try:
        srv.launch().wait_ready(timeout=60)
        assert srv.port != first and http_ok(srv.url + "/health")
        assert srv.log_path.read_text().lower().count("address already in use") == 1
    finally:
        srv.stop()


def test_past_its_bound_a_taken_port_fails_naming_the_holder(
    tmp_path: Path, taken: list[socket.socket]
) -> None:
    assert PORT_ATTEMPTS > 1
    srv = _Http(tmp_path)
    srv.attempts = 1  # the first start is the last: its clash is final
    _occupy(srv.port, taken)
    try:
        with pytest.raises(RuntimeError, match=rf"port {srv.port}: pid {os.getpid()} \("):
            srv.launch().wait_ready(timeout=60)
    finally:
        srv.stop()
    fixed = _Http(tmp_path, port=srv.port)  # a port the caller fixed never moves: it fails
    try:
        with pytest.raises(RuntimeError, match=r"\(1 start\(s\)\)"):
            fixed.launch().wait_ready(timeout=60)
    finally:
        fixed.stop()


def test_holders_names_the_listening_process(taken: list[socket.socket]) -> None:
    s = socket.socket()
    taken.append(s)
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    assert holders(port) == "no process listens on it now"  # bound, not listening
    s.listen()
    assert holders(port).startswith(f"pid {os.getpid()} (")


def test_fresh_ports_are_reserved_per_start_and_the_proxy_follows(tmp_path: Path) -> None:
    kv = {"kv_connector": "X", "kv_connector_extra_config": {"lookup_rpc_port": FRESH_PORT}}
    engine = VllmServer(tmp_path, tmp_path, core=0, kv_transfer_config=kv, env={"SIDE": FRESH_PORT})
    side = int(engine.environment()["SIDE"])
    assert side == engine.env_port("SIDE")
    cmd = engine.command()
    lookup = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert lookup["kv_connector_extra_config"]["lookup_rpc_port"] not in (FRESH_PORT, side)
    proxy = ProxyServer(tmp_path, [engine], ["http://127.0.0.1:1"])
    before = proxy.command()
    assert before[before.index("--prefill") + 1] == engine.url
    engine.reserve()  # a new start: new numbers, and the proxy names the new URL
    assert int(engine.environment()["SIDE"]) == engine.env_port("SIDE")
    after = proxy.command()
    assert (
        after[after.index("--prefill") + 1] == engine.url != before[before.index("--prefill") + 1]
    )


def test_our_master_binds_port_zero_and_reports_the_port(tmp_path: Path) -> None:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        address = start_master([], procs)
        host, port = address.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
        socket.create_connection((host, int(port)), timeout=5).close()
    finally:
        stop_all(procs)


def test_store_master_reports_its_metrics_port_and_a_taken_control_port_fails_at_once(
    tmp_path: Path, taken: list[socket.socket]
) -> None:
    m = StoreMaster(tmp_path)
    try:
        m.launch().wait_ready(timeout=60)  # --metrics-port 0: the port it reported answers
        assert http_ok(m.url + "/health")
    finally:
        m.stop()
    # Engines name the control port before the master starts, so it cannot move: one start.
    m = StoreMaster(tmp_path)
    _occupy(m.rpc_port, taken)
    try:
        holder = rf"\(1 start\(s\)\): port {m.rpc_port}: pid {os.getpid()} \("
        with pytest.raises(RuntimeError, match=holder):
            m.launch().wait_ready(timeout=60)
    finally:
        m.stop()
