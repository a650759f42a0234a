"""The P2P store against hostile input: manifests that name paths a fetch cannot (or must not)
create, forged holder records renewed in the future, and messages over the grant server's size
cap. Real nodes in one process on one metadata service; the oversized sender is a subprocess."""

# ruff: noqa: F811 - the fixtures cfg and nodes are test_p2p_store's, imported by name

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from test_p2p_store import CHUNK, cfg, node, nodes, same, tree  # noqa: F401 - fixtures

from mooncake_connectors.config import EngineConfig
from mooncake_connectors.p2p import P2PError, P2PStore
from mooncake_connectors.p2p.manifest import build_manifest, encode_manifest
from mooncake_connectors.p2p.records import ROOT, Catalog, HolderRecord
from mooncake_connectors.p2p.serve import Grant, GrantClient

# -- L1: manifest paths -------------------------------------------------------------------------

BAD_PATHS = {
    "long component": ["a" * 300],
    "dot": ["."],
    "dot component": ["./a.bin"],
    "trailing slash": ["dir/"],
    "empty component": ["a//b"],
    "the fetch's marker": [".mooncake-p2p.json"],
    "our prefix below": ["sub/.mooncake-p2p.lock"],
    "duplicate": ["a.bin", "a.bin"],
    "file and directory": ["a", "a/b"],
}


def _forge(n: P2PStore, name: str, paths: list[str]) -> None:
    """Write a manifest naming ``paths`` straight into the metadata service, as a peer could."""
    data = memoryview(b"x" * 10)
    m = build_manifest(name, 1, [(p, data, "", []) for p in paths], CHUNK)
    md = n.engine.metadata
    assert md is not None
    md.put(f"{ROOT}objects/{name}/v/1", encode_manifest(m))
    md.put(f"{ROOT}objects/{name}/current", b"1")


@pytest.mark.parametrize("case", sorted(BAD_PATHS))
def test_a_manifest_with_a_bad_path_is_refused_at_fetch_and_publish(
    case: str, tmp_path: Path, cfg: EngineConfig, nodes: list[P2PStore]
) -> None:
    paths = BAD_PATHS[case]
    n = node(nodes, cfg)
    _forge(n, "bad", paths)
    with pytest.raises(P2PError, match="manifest path") as got:
        n.fetch("bad", tmp_path / "d")
    assert repr(paths[-1]) in str(got.value)
    assert not (tmp_path / "d").exists()  # refused before anything was created
    # publishing the same names as a state_dict is refused before anything is registered
    if len(set(paths)) == len(paths):
        with pytest.raises(P2PError, match="manifest path"):
            n.publish("bad2", {p: np.zeros(4, dtype=np.uint8) for p in paths})


def test_a_fetch_that_cannot_create_a_file_raises_p2p_error(
    tmp_path: Path, cfg: EngineConfig, nodes: list[P2PStore]
) -> None:
    pub = node(nodes, cfg)
    pub.publish("o", tree(tmp_path / "src"), chunk_size=CHUNK)
    dest = tmp_path / "d"
    (dest / "a.bin").mkdir(parents=True)  # a directory where a file goes
    with pytest.raises(P2PError, match="cannot create"):
        node(nodes, cfg).fetch("o", dest)


# -- L2: holder records renewed in the future ---------------------------------------------------


def test_forged_future_holder_records_are_not_live_and_do_not_stall_a_fetch(
    tmp_path: Path, cfg: EngineConfig, nodes: list[P2PStore]
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(np.random.default_rng(3).bytes(3 << 20))
    pub = node(nodes, cfg)
    pub.publish("f", src, chunk_size=1 << 20)
    cat = Catalog(pub.engine.metadata)  # type: ignore[arg-type]
    now = time.time()
    for i in range(100):  # endpoints nobody answers, "renewed" 10^6 s from now
        cat.put_holder(
            "f", 1, HolderRecord(f"ghost-{i}", "127.0.0.1:9", "seg", b"\xff", now + 1e6, 10.0)
        )
    live = [r.holder for r in cat.holders("f", 1)]
    assert not any(h.startswith("ghost") for h in live) and len(live) == 1
    t0 = time.monotonic()
    stats = node(nodes, cfg).fetch("f", tmp_path / "d", timeout=60)
    assert time.monotonic() - t0 < 20, "ghost holders stalled the fetch"  # was 62.6 s
    assert same(src, tmp_path / "d") and stats.refusals == 0


def test_holders_that_never_answer_cost_one_grant_timeout_in_all(
    tmp_path: Path, cfg: EngineConfig, nodes: list[P2PStore]
) -> None:
    """Records that look alive (renewed now) but name nobody: they are asked all at once, and
    only holders that answered get chunk requests."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(np.random.default_rng(4).bytes(8 << 20))
    pub = node(nodes, cfg, lease=30.0)
    pub.publish("h", src, chunk_size=256 << 10)  # 32 chunks
    cat = Catalog(pub.engine.metadata)  # type: ignore[arg-type]
    for i in range(100):
        rec = HolderRecord(f"ghost-{i}", "127.0.0.1:9", "seg", b"\xff" * 4, time.time(), 30.0)
        cat.put_holder("h", 1, rec)
    t0 = time.monotonic()
    stats = node(nodes, cfg).fetch("h", tmp_path / "d", timeout=120)
    took = time.monotonic() - t0
    assert same(src, tmp_path / "d")
    # 100 ghosts x 2 s grant timeout / 8 workers = 25 s if each were tried in turn
    assert took < 20, f"{took:.1f} s, {stats.refusals} refusals"


# -- M3: the grant server's message-size cap ----------------------------------------------------

_SENDER = """
import sys, time, zmq
sock = zmq.Context.instance().socket(zmq.DEALER)
sock.setsockopt(zmq.LINGER, 0)
sock.connect(sys.argv[1])
sock.send_multipart([b"", b"", b"x" * (200 << 20)])
time.sleep(3)  # the whole message leaves (or the server hangs up) before we go
sock.close()
"""


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * 4096


def test_a_message_over_the_cap_does_not_reach_the_grant_server(
    tmp_path: Path, cfg: EngineConfig, nodes: list[P2PStore]
) -> None:
    pub = node(nodes, cfg)
    pub.publish("g", tree(tmp_path / "src"), chunk_size=CHUNK)
    ep = pub.holder.endpoint
    base = _rss()
    peak = [base]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.005):
            peak[0] = max(peak[0], _rss())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        sender = subprocess.run(
            [sys.executable, "-c", _SENDER, f"tcp://{ep}"], timeout=60, capture_output=True
        )
        assert sender.returncode == 0, sender.stderr
        ok = GrantClient(None, 5.0)
        try:
            got = ok.ask(ep, Grant("g", 1, 0, "x"))  # the server keeps granting
            assert got is not None and got.status == "ok"
        finally:
            ok.close()
    finally:
        stop.set()
        sampler.join(5)
    grown = peak[0] - base
    assert grown < 32 << 20, f"the publisher grew {grown >> 20} MiB for a 200 MiB message"
