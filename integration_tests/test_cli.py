"""The command line, run as users run it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from helpers import free_port, http_ok, wait_until
from typer.testing import CliRunner

from mooncake_connectors.bench import tcp_ceiling
from mooncake_connectors.cli import app
from mooncake_connectors.errors import MetadataError
from mooncake_connectors.tls import TlsConfig
from mooncake_connectors.transfer_core.metadata import open_metadata
from mooncake_connectors.transfer_core.metadata.http import HttpMetadata

CLI = [sys.executable, "-m", "mooncake_connectors"]


def test_version_and_plugins() -> None:
    r = CliRunner().invoke(app, ["plugins"])
    assert r.exit_code == 0, r.output
    found = json.loads(r.output)
    assert {"tcp", "shm"} <= set(found["transports"])
    assert CliRunner().invoke(app, ["version"]).output.strip()


def test_the_cli_reaches_the_harness_only_inside_its_commands() -> None:
    # Engines import the package, never the command line; the CLI itself loads bench modules
    # only when a bench or demo command runs, so its start-up stays light too.
    code = (
        "import sys, mooncake_connectors.cli, mooncake_connectors.adapters, "
        "mooncake_connectors.store, mooncake_connectors.transfer_core, mooncake_connectors.compat; "
        "print(sorted(m for m in sys.modules if m.startswith('mooncake_connectors.bench')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout


def test_metadata_server_command() -> None:
    port = free_port()
    proc = subprocess.Popen(
        [*CLI, "metadata-server", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        health = f"http://127.0.0.1:{port}/health"
        wait_until(lambda: http_ok(health), 20, "metadata-server to answer /health")
        m = open_metadata(f"http://127.0.0.1:{port}/metadata")
        m.put("a", b"b")
        assert m.get("a") == b"b"
        m.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def cli_json(*args: str, timeout: float = 300) -> Any:
    """Run the command line; its stdout parsed as JSON (a failed run fails the test)."""
    out = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, check=True)
    return json.loads(out.stdout)


def test_bench_transfer_emits_json() -> None:
    result = cli_json(
        "bench",
        "transfer",
        "--rounds",
        "1",
        "--sizes",
        "64K,1M",
        "--batch",
        "8x64K",
        "--no-mooncake",
        "--transports",
        "tcp,shm",
        "--tls",
    )
    assert result["benchmark"] == "transfer"
    row = result["results"]["READ 1M"]
    assert set(row) >= {"ours_tcp", "ours_shm", "raw_socket"}
    assert all(v > 0 for v in row.values())
    assert result["results"]["COPY 1M"]["memcpy"] > 0
    assert "WRITE batch 8x64K" in result["results"]
    assert "tcp_vs_raw_socket" in result["ratios"]["READ 1M"]
    assert row["ours_tcp_tls"] > 0 and "tcp_tls_vs_tcp" in result["ratios"]["READ 1M"]
    # the tcp transport with striping off, beside it
    assert row["ours_tcp_one_stream"] > 0 and "tcp_vs_tcp_one_stream" in result["ratios"]["READ 1M"]
    # the kernel's loopback TCP ceiling (iperf3), when installed (.ci/run installs it)
    if tcp_ceiling.available():
        stream = result["results"]["STREAM"]
        assert stream["iperf3_1_stream"] > 0 and stream["iperf3_2_streams"] > 0
        assert result["ratios"]["READ 1M"]["tcp_vs_iperf3_best"] > 0
    else:
        assert any("iperf3 not installed" in n for n in result["notes"])


def test_bench_store_legs_emits_json() -> None:
    result = cli_json("bench", "store-legs", "--calls", "20", "--rounds", "1", "--no-mooncake")
    assert result["benchmark"] == "store-legs"
    legs = result["results"]
    assert set(legs) == {"master_round_trip", "data_round_trip", "get", "client_work"}
    assert all(legs[k] > 0 for k in ("master_round_trip", "data_round_trip", "get"))


def test_certs_init_and_a_metadata_server_over_mutual_tls(tmp_path: Path) -> None:
    files = cli_json("certs", "init", str(tmp_path), "--nodes", "meta,engine", timeout=60)
    port = free_port()
    proc = subprocess.Popen(
        [
            *CLI,
            "metadata-server",
            "--port",
            str(port),
            *("--tls-cert", files["meta"], "--tls-key", files["meta-key"]),
            *("--tls-ca", files["ca"]),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        url = f"https://127.0.0.1:{port}/metadata"
        mine = TlsConfig(files["engine"], files["engine-key"], files["ca"])
        m = HttpMetadata(url, timeout=2, tls=mine)

        def answers() -> bool:
            try:
                return m.get("nothing") is None
            except MetadataError:
                return False

        wait_until(answers, 20, "metadata-server to answer over TLS")
        m.put("a", b"b")
        assert m.get("a") == b"b"
        m.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
