"""The rdma transport meeting faults of first contact over the emulated NIC (the FAKE
libibverbs.so.1 under the real pyverbs; see test_rdma_fake_ibverbs.py): a peer whose path MTU
differs and that does not negotiate it, a genuine bad rkey, and a GID table that changes
after start. Run in .venv-rdma."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fake_ibverbs_lib as fib
import pytest
from test_rdma_fake_ibverbs import ROOT, SPAN, Pair, _sha, lib, pairs

from mooncake_connectors.transfer_core.descriptor import RegionDesc, SegmentDesc, encode_segment
from mooncake_connectors.transfer_core.metadata.base import SEGMENT_PREFIX
from mooncake_connectors.transfer_core.metadata.http import HttpClient

__all__ = ["lib", "pairs"]  # fixtures, used by name
DEVS = "mlx5_0:roce:4096,mlx5_1:roce:4096"


class LegacyPeer:
    """tests/rdma_legacy_peer.py in a child: a target at its own port's MTU, which it does not
    send in the connect exchange."""

    def __init__(self, lib: Path, devices: str, fabric: str, host: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("rdma_legacy_peer.py"))],
            env={**fib.env(lib, devices, fabric, host), "PYTHONPATH": str(ROOT)},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        self.info: dict[str, Any] = json.loads(self.proc.stdout.readline())

    def publish(self, url: str, name: str, rkeys: dict[str, int]) -> None:
        nics = self.info["nics"]
        desc = SegmentDesc(
            name=name,
            host_id="another-host",
            pid=self.info["pid"],
            endpoints={"rdma": f"127.0.0.1:{self.info['port']}"},
            regions=[RegionDesc(addr=self.info["addr"], length=SPAN, rdma_rkeys=rkeys)],
            rdma_gids={n: v["gid"] for n, v in nics.items()},
            rdma_lids={n: v["lid"] for n, v in nics.items()},
        )
        client = HttpClient(url, timeout=5, token=None)
        status, _ = client.request("PUT", {"key": SEGMENT_PREFIX + name}, encode_segment(desc))
        client.close()
        assert status in (200, 201, 204), status

    def sha(self, n: int) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"sha {n}\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(10)


@pytest.fixture
def legacy(pairs: list[Pair], lib: Path) -> Iterator[tuple[Pair, LegacyPeer]]:
    """a (two 4096-MTU NICs) of a Pair, and a legacy target whose mlx5_0 runs MTU 1024 (a
    1500-byte netdev) and whose mlx5_1 runs 4096."""
    p = Pair(lib, DEVS, DEVS, gid_index=3)
    pairs.append(p)
    t = LegacyPeer(lib, "mlx5_0:roce:1024,mlx5_1:roce:4096", p.fabric, 3)
    yield p, t
    t.close()


def _rkeys(t: LegacyPeer, *nics: str, bad: int = 0) -> dict[str, int]:
    return {n: t.info["nics"][n]["rkey"] ^ bad for n in nics}


def test_an_invalid_request_fails_the_rail_and_others_carry_the_data(
    legacy: tuple[Pair, LegacyPeer],
) -> None:
    """The rails to the target's mlx5_0 run MTU 4096 on a's side and 1024 on the target's: the
    target NAKs a's WRITEs as invalid requests (IBV_WC_REM_INV_REQ_ERR). That fails those rails
    (which carry nothing: every WR is longer than 1024 bytes), and the WRs move to the rails to
    its mlx5_1: the write completes, every byte over rdma. Before, the status was taken for a
    refused rkey: a final AccessViolation, no other rail or transport tried."""
    p, t = legacy
    t.publish(p.srv.url, "legacy", _rkeys(t, "mlx5_0", "mlx5_1"))
    p.a.call(
        "transfer", op="write", peer="legacy", local=p.addr_a, remote=t.info["addr"], length=SPAN
    )
    assert t.sha(SPAN) == _sha(p.a, p.addr_a, SPAN)
    stats = p.a.call("rail_stats", peer="legacy")["stats"]
    assert sorted(stats) == ["mlx5_0>mlx5_0", "mlx5_0>mlx5_1", "mlx5_1>mlx5_0", "mlx5_1>mlx5_1"]
    assert all(v["carried"] == 0 for k, v in stats.items() if k.endswith(">mlx5_0")), stats
    assert sum(v["carried"] for v in stats.values()) > 0


def test_when_every_rail_is_an_invalid_request_the_error_names_the_causes(
    legacy: tuple[Pair, LegacyPeer],
) -> None:
    """Only the target's mlx5_0 is published: every rail NAKs. The request fails as a broken
    transport (which the engine moves to tcp where it has one), saying what usually causes it,
    not as an access violation."""
    p, t = legacy
    t.publish(p.srv.url, "legacy-mtu", _rkeys(t, "mlx5_0"))
    with pytest.raises(AssertionError) as info:
        p.a.call(
            "transfer",
            op="write",
            peer="legacy-mtu",
            local=p.addr_a,
            remote=t.info["addr"],
            length=SPAN,
        )
    msg = str(info.value)
    assert "AccessViolation" not in msg and "refused access" not in msg, msg
    assert "invalid" in msg and "path MTU" in msg, msg


def test_a_bad_rkey_stays_an_access_violation(legacy: tuple[Pair, LegacyPeer]) -> None:
    """The target's mlx5_1 (same MTU as a's) with an rkey it never issued: REM_ACCESS_ERR, a
    final AccessViolation, not retried on other rails."""
    p, t = legacy
    t.publish(p.srv.url, "legacy-rkey", _rkeys(t, "mlx5_1", bad=0x100))
    with pytest.raises(AssertionError, match=r"AccessViolation.*refused access"):
        p.a.call(
            "transfer",
            op="write",
            peer="legacy-rkey",
            local=p.addr_a,
            remote=t.info["addr"],
            length=4096,
        )
    assert t.sha(4096) == hashlib.sha256(bytes(4096)).hexdigest()


def test_a_gid_entry_gone_after_start_is_probed_again(pairs: list[Pair], lib: Path) -> None:
    """Both ends probed their RoCE v2 IPv4 GID (index 3) at start; then each netdev's address
    changed: index 3 is empty, the new address is at index 2. The first connect's RTR is
    refused (EINVAL: no such source GID, as the kernel's rdma_get_gid_attr answers) on the
    target, then on the initiator; each probes its table again, once, and connects with index 2,
    telling the peer its new GID, so the data moves over rdma. Before, the rail failed, and with
    no other transport so did the transfer."""
    p = Pair(lib, "mlx5_0:roce:4096:routed", "mlx5_0:roce:4096:routed")
    pairs.append(p)
    for host in (1, 2):
        new = f"00000000000000000000ffff0a0909{host:02x}"  # ::ffff:10.9.9.<host>
        fib.set_gids(p.fabric, host, "mlx5_0", {2: (new, "v2"), 3: None})
    p.a.call("transfer", op="write", peer=p.b.segment, local=p.addr_a, remote=p.addr_b, length=SPAN)
    assert _sha(p.b, p.addr_b, SPAN) == _sha(p.a, p.addr_a, SPAN)
    half = SPAN // 2
    p.a.call(
        "transfer", op="read", peer=p.b.segment, local=p.addr_a, remote=p.addr_b + half, length=half
    )
    assert _sha(p.a, p.addr_a, half) == _sha(p.b, p.addr_b + half, half)
    assert p.carried(p.a, p.b) > 0


def test_a_fixed_gid_index_gone_is_not_probed(pairs: list[Pair], lib: Path) -> None:
    """gid_index set by hand: the transport keeps it (the operator chose it) and the connect
    fails with the kernel's refusal instead of moving to another entry."""
    p = Pair(lib, "mlx5_0:roce:4096:routed", "mlx5_0:roce:4096:routed", gid_index=3)
    pairs.append(p)
    fib.set_gids(p.fabric, 1, "mlx5_0", {2: ("00000000000000000000ffff0a090901", "v2"), 3: None})
    with pytest.raises(AssertionError, match="cannot connect a QP"):
        p.a.call(
            "transfer", op="write", peer=p.b.segment, local=p.addr_a, remote=p.addr_b, length=4096
        )
