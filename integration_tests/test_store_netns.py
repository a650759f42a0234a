"""The store across "machines": network namespaces on a bridge, each with its own address and
host name, a real etcd on one of them for metadata and leader election, two masters, three store
servers and a client each on their own. Puts with two replicas; a server machine killed, the
leader master's machine killed, then another server's cable pulled: reads fail over to the other
copies and the standby master. Skips (with the reason) where
namespaces cannot be made; nothing binds a wildcard address."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import wait_until
from netns import Hosts, unavailable

from mooncake_connectors.store.ha import LeaderResolver

pytestmark = pytest.mark.etcd

CLIENT = str(Path(__file__).parents[1] / "tests" / "netns_client.py")
CLI = [sys.executable, "-m", "mooncake_connectors"]
FAST = ["--heartbeat-interval", "0.2", "--server-ttl", "1.0", "--read-lease-ttl", "1.0"]
HOSTS = ["etcd", "m1", "m2", "s1", "s2", "s3", "client"]


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return bool(r.status == 200)
    except OSError:
        return False


@pytest.fixture
def hosts() -> Iterator[tuple[Hosts, str]]:
    why = unavailable()
    if why is not None:
        pytest.skip(f"multi-host store test needs network namespaces: {why}")
    etcd = shutil.which("etcd")
    if etcd is None:
        pytest.skip("etcd binary not installed (apt-get install etcd-server)")
    data = tempfile.mkdtemp(prefix="mc-netns-etcd-")
    h = Hosts(HOSTS).start()
    try:
        e = h.addr("etcd")
        client_url, peer_url = f"http://{e}:2379", f"http://{e}:2380"
        h.popen(
            "etcd",
            [
                etcd,
                "--name=n",
                f"--data-dir={data}",
                f"--listen-client-urls={client_url}",
                f"--advertise-client-urls={client_url}",
                f"--listen-peer-urls={peer_url}",
                f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster=n={peer_url}",
            ],
        )
        # the test process reaches every host through the bridge's address
        wait_until(lambda: http_ok(f"{client_url}/health"), 30, "etcd on its host")
        url = f"etcd://{e}:2379/mc-{uuid.uuid4().hex[:8]}"
        yield h, url
    finally:
        h.close()
        shutil.rmtree(data, ignore_errors=True)


def client(h: Hosts, url: str, mode: str, first: int, count: int, *extra: str) -> dict[str, object]:
    r = h.run(
        "client",
        [sys.executable, CLIENT, url, h.addr("client"), mode, str(first), str(count), *extra],
        timeout=180,
    )
    if r.returncode != 0:
        raise AssertionError(f"client {mode} failed:\n{r.stdout}\n{r.stderr}\n{h.outputs()}")
    out: dict[str, object] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


def test_store_across_namespaces_with_etcd_fails_over_to_replicas(
    hosts: tuple[Hosts, str],
) -> None:
    h, url = hosts
    masters = {}
    for m in ("m1", "m2"):
        masters[m] = h.popen(
            m,
            [
                *CLI,
                "master",
                "--host",
                h.addr(m),
                "--port",
                "50051",
                "--ha",
                url,
                "--ha-lease-ttl",
                "2",
                "--metadata",
                url,
                "--stripe-size",
                "256K",
                *FAST,
            ],
        )
    servers = {
        s: h.popen(
            s, [*CLI, "store-server", "--master", url, "--host", h.addr(s), "--memory", "32M"]
        )
        for s in ("s1", "s2", "s3")
    }
    try:
        put = client(h, url, "put", 0, 30, "3")
        assert put["ok"] == 30, put
        check = client(h, url, "check", 0, 30)
        assert check["single"] == {"ok": 30, "miss": 0, "wrong": 0}, check
        assert check["batch"] == {"ok": 30, "miss": 0, "wrong": 0}, check

        for host in HOSTS:  # every listener is on the host's own address or loopback
            listen = h.run(host, ["ss", "-ltnH"], timeout=20).stdout.split("\n")
            local = [line.split()[3] for line in listen if line.strip()]
            wild = [a for a in local if a.rsplit(":", 1)[0] in ("0.0.0.0", "*", "[::]")]
            assert not wild, f"{host} listens on a wildcard address: {wild}"
            if host in ("m1", "m2"):
                assert f"{h.addr(host)}:50051" in local, local

        servers["s1"].kill()  # a machine's server dies: every key has a copy elsewhere
        check = client(h, url, "check", 0, 30)
        assert check["single"] == {"ok": 30, "miss": 0, "wrong": 0}, check
        assert check["batch"] == {"ok": 30, "miss": 0, "wrong": 0}, check

        # the leader master's machine dies: the standby leads, the servers re-report to it
        resolver = LeaderResolver(url, 5.0)
        try:
            first = resolver.leader()
            assert first in (f"{h.addr('m1')}:50051", f"{h.addr('m2')}:50051"), first
            dead = "m1" if first.startswith(h.addr("m1") + ":") else "m2"
            masters[dead].kill()

            def moved() -> bool:
                return resolver.leader() not in (None, first)

            wait_until(moved, 30, "the standby master to lead")
        finally:
            resolver.close()
        check = client(h, url, "check", 0, 30)
        assert check["single"] == {"ok": 30, "miss": 0, "wrong": 0}, check

        put = client(h, url, "put", 30, 12, "2")  # the store keeps taking writes on two
        assert put["ok"] == 12, put
        h.cut("s2")  # another machine's cable pulled: its copies of the new keys fail over
        check = client(h, url, "check", 30, 12)
        assert check["single"] == {"ok": 12, "miss": 0, "wrong": 0}, check
        old = client(h, url, "check", 0, 30)  # keys with copies on s1 and s2: gone, not wrong
        assert old["single"]["wrong"] == 0 and old["batch"]["wrong"] == 0, old  # type: ignore[index]
    except AssertionError:
        raise AssertionError(h.outputs()) from None
