"""The P2P store with real processes: a publisher and fetchers started through the command line,
a metadata server in the test process. Four fetchers byte-identical; the publisher SIGKILLed once
every chunk has a second holder; a fetcher serving corrupt bytes bypassed; a fetcher SIGKILLed
mid-fetch resumed (held chunks re-verified, not refetched); and the same swarm across network
namespaces, where engines speak tcp between "machines"."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import wait_until
from netns import Hosts, Proc, unavailable

from mooncake_connectors.p2p.records import Catalog, count, has
from mooncake_connectors.transfer_core.metadata.http import HttpMetadata, MetadataHTTPServer

CLI = [sys.executable, "-m", "mooncake_connectors", "p2p"]
CHUNK = "256K"
WAIT = 60.0  # deadline of every wait on a process


def checkpoint(root: Path, mib: int = 8) -> Path:
    rng = np.random.default_rng(7)
    root.mkdir(parents=True)
    (root / "config.json").write_text('{"model_type": "tiny"}')
    for i in range(2):
        (root / f"model-0000{i + 1}-of-00002.safetensors").write_bytes(rng.bytes(mib << 19))
    return root


def identical(a: Path, b: Path) -> bool:
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    return bool(files) and all((a / f).read_bytes() == (b / f).read_bytes() for f in files)


def result(p: Proc) -> dict[str, Any] | None:
    """The JSON line the process printed, once it printed it."""
    with open(p.log.name, errors="replace") as fh:
        for line in fh:
            if line.startswith('{"name"'):
                return dict(json.loads(line))
    return None


def wait_result(p: Proc) -> dict[str, Any]:
    wait_until(lambda: result(p) is not None or not p.alive(), WAIT, f"{p.name} to report")
    got = result(p)
    assert got is not None, p.output()
    return got


class Swarm:
    def __init__(self, url: str, tmp: Path) -> None:
        self.url = url
        self.tmp = tmp
        self.procs: list[Proc] = []
        self.catalog = Catalog(HttpMetadata(url))

    def start(self, name: str, args: list[str], argv: list[str] | None = None) -> Proc:
        p = Proc(argv or [*CLI, *args, "--metadata", self.url, "--json", "--lease", "3"], name)
        self.procs.append(p)
        return p

    def publish(self, src: Path, name: str, *extra: str) -> tuple[Proc, dict[str, Any]]:
        p = self.start(
            "publisher", ["publish", str(src), "--name", name, "--chunk-size", CHUNK, *extra]
        )
        return p, wait_result(p)

    def fetch(self, name: str, who: str, *extra: str) -> Proc:
        return self.start(who, ["fetch", name, str(self.tmp / who), "--seed", *extra])

    def held(self, name: str) -> list[int]:
        recs = self.catalog.holders(name, 1)
        n = self.catalog.manifest(name, 1).chunks
        return [sum(has(r.have, i) for r in recs) for i in range(len(n))]

    def close(self) -> str:
        out = "\n".join(p.output() for p in self.procs)
        for p in self.procs:
            p.close()
        self.catalog.md.close()
        return out


@pytest.fixture
def swarm(meta_server: MetadataHTTPServer, tmp_path: Path) -> Iterator[Swarm]:
    s = Swarm(meta_server.url, tmp_path)
    ok = False
    try:
        yield s
        ok = True
    finally:
        out = s.close()
        if not ok:
            print(out)


def test_four_fetchers_get_identical_bytes(swarm: Swarm, tmp_path: Path) -> None:
    src = checkpoint(tmp_path / "src")
    # A slow publisher (a 16 MiB/s NIC) makes the fetchers take from each other.
    _, info = swarm.publish(src, "four", "--rate", "16M")
    fetchers = [swarm.fetch("four", f"f{i}", "--rate", "16M") for i in range(4)]
    stats = [wait_result(f) for f in fetchers]
    for i, st in enumerate(stats):
        assert st["fetched"] == info["chunks"] and st["corrupt"] == 0
        assert identical(src, tmp_path / f"f{i}")
    from_peers = sum(
        n for st in stats for h, n in st["from_holder"].items() if f"-{info['pid']}-" not in h
    )
    assert from_peers > 0  # the swarm served itself, not only the publisher


def test_publisher_killed_once_every_chunk_has_a_second_holder(
    swarm: Swarm, tmp_path: Path
) -> None:
    src = checkpoint(tmp_path / "src")
    # Slow fetcher uplinks: when every chunk first has a second holder (>= 1 s, one copy out of
    # the publisher), at most 14 of the 24 MiB needed have moved, so the fetches are under way.
    pub, info = swarm.publish(src, "kill", "--rate", "8M")
    fetchers = [swarm.fetch("kill", f"f{i}", "--rate", "2M") for i in range(3)]
    wait_until(lambda: min(swarm.held("kill")) >= 2, WAIT, "a second holder of every chunk")
    recs = swarm.catalog.holders("kill", 1)
    assert not all(r.complete for r in recs)  # the fetches are still under way
    pub.kill()
    for i, f in enumerate(fetchers):
        st = wait_result(f)
        assert st["fetched"] + st["verified"] == info["chunks"]
        assert identical(src, tmp_path / f"f{i}")


def test_corrupt_holder_detected_and_bypassed(swarm: Swarm, tmp_path: Path) -> None:
    src = checkpoint(tmp_path / "src", mib=2)
    _, info = swarm.publish(src, "bad")
    liar = swarm.fetch("bad", "liar")
    wait_result(liar)
    for f in (tmp_path / "liar").glob("*.*"):  # every file: it now serves only wrong bytes
        f.write_bytes(bytes(f.stat().st_size))
    # One request in flight per holder: the first round asks both holders, so the liar is asked.
    good = wait_result(swarm.fetch("bad", "good", "--k", "1", "--parallel", "2"))
    assert good["corrupt"] >= 1
    assert sum(good["from_holder"].values()) == info["total_size"]  # all of it from the publisher
    assert len(good["from_holder"]) == 1
    assert identical(src, tmp_path / "good")


def test_resume_after_sigkill_reverifies_held_chunks(swarm: Swarm, tmp_path: Path) -> None:
    src = checkpoint(tmp_path / "src")
    _, info = swarm.publish(src, "res", "--rate", "2M")  # 16 MiB at 2 MiB/s: ~8 s
    first = swarm.fetch("res", "dst")

    def some_held() -> int:
        recs = [r for r in swarm.catalog.holders("res", 1) if not r.complete]
        return max((count(r.have) for r in recs), default=0)

    wait_until(lambda: some_held() >= 4, WAIT, "the fetcher to hold a few chunks")
    held = some_held()
    first.kill()
    again = wait_result(swarm.start("again", ["fetch", "res", str(tmp_path / "dst")]))
    assert again["verified"] >= held  # what it had announced was kept, checked by hash
    assert again["verified"] + again["fetched"] == info["chunks"]
    assert again["fetched"] < info["chunks"]
    assert identical(src, tmp_path / "dst")


def test_swarm_across_network_namespaces(tmp_path: Path) -> None:
    why = unavailable()
    if why is not None:
        pytest.skip(f"the multi-host P2P test needs network namespaces: {why}")
    src = checkpoint(tmp_path / "src", mib=4)
    names = ["pub", "f1", "f2", "f3"]
    with Hosts(names) as hosts:
        # The test process sits on the bridge (.1) and serves the metadata there.
        server = MetadataHTTPServer(f"10.213.{hosts.net}.1", 0).start()
        try:
            url = server.url
            tag = uuid.uuid4().hex[:6]
            common = ["--metadata", url, "--json", "--lease", "3"]
            pub = hosts.popen(
                "pub",
                [
                    *CLI,
                    "publish",
                    str(src),
                    "--name",
                    f"n{tag}",
                    "--chunk-size",
                    CHUNK,
                    "--rate",
                    "16M",
                    "--host",
                    hosts.addr("pub"),
                    *common,
                ],
            )
            info = wait_result(pub)
            fetchers = [
                hosts.popen(
                    h,
                    [
                        *CLI,
                        "fetch",
                        f"n{tag}",
                        str(tmp_path / h),
                        "--seed",
                        "--host",
                        hosts.addr(h),
                        *common,
                    ],
                )
                for h in names[1:]
            ]
            for h, f in zip(names[1:], fetchers, strict=True):
                st = wait_result(f)
                assert st["fetched"] == info["chunks"], hosts.outputs()
                assert identical(src, tmp_path / h)
        finally:
            server.stop()


def test_command_line_ls_unpublish_and_unknown_names(swarm: Swarm, tmp_path: Path) -> None:
    src = checkpoint(tmp_path / "src", mib=1)
    swarm.publish(src, "cli")

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*CLI, *args, "--metadata", swarm.url, "--json"],
            capture_output=True,
            text=True,
            timeout=WAIT,
            check=False,
        )

    listing = json.loads(cli("ls").stdout)
    assert [(r["name"], r["version"], r["holders"]) for r in listing] == [("cli", 1, 1)]
    gone = json.loads(cli("unpublish", "cli").stdout)
    assert gone["keys_removed"] >= 3  # current, v/1, the publisher's record
    miss = cli("fetch", "cli", str(tmp_path / "d"))
    assert miss.returncode == 1 and "nothing is published as 'cli'" in miss.stderr
    bad = cli("fetch", "no/such", str(tmp_path / "d"))
    assert bad.returncode == 1 and "object name" in bad.stderr
