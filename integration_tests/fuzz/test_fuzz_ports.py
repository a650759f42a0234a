"""Every listening port under hostile input, in CI: hypothesis draws the frames (through a
recorded ``random.Random``, so a failure shrinks and replays), each target runs in its own
process, and after every port: the process is alive, a well-behaved client is served, peak RSS
grew by less than the budget, and the TE canaries around the registered region are intact.
The bench-mode run (``mooncake-connectors fuzz --frames 100000``) sends the same frames at scale."""

from __future__ import annotations

import random
import socket
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mooncake_connectors.bench.fuzz import RSS_BUDGET, TargetProcess, send_frames
from mooncake_connectors.bench.fuzz_frames import PORTS, Port, TePort
from mooncake_connectors.pd.session import _EARLY_DONE
from mooncake_connectors.transfer_core.transports import wire

EXAMPLES = 90  # connections per port, up to 47 frames each: about two thousand frames per port
PROBE_EVERY = 20
CASES = [(kind, cls) for kind, (_, classes) in PORTS.items() for cls in classes]


@pytest.fixture(scope="module")
def targets() -> Iterator[dict[str, TargetProcess]]:
    procs: dict[str, TargetProcess] = {}
    yield procs
    for p in procs.values():
        p.close()


def target(targets: dict[str, TargetProcess], kind: str) -> TargetProcess:
    if kind not in targets:
        targets[kind] = TargetProcess(kind)
    return targets[kind]


def healthy(t: TargetProcess, before: dict[str, int]) -> None:
    after = t.check()
    assert after is not None, "the target process died"
    assert after["vmhwm"] - before["vmhwm"] < RSS_BUDGET
    assert after.get("canary_ok", True) is True, "a write landed outside the registered region"
    # the side channel's session keeps a bounded number of Done ids, whatever the flood
    assert after.get("side_state", 0) <= _EARLY_DONE


@pytest.mark.parametrize(("kind", "cls"), CASES, ids=[c.name for _, c in CASES])
def test_port_survives_hostile_frames(
    targets: dict[str, TargetProcess], kind: str, cls: type[Port]
) -> None:
    t = target(targets, kind)
    before = t.check()
    assert before is not None
    port = cls(t.info)
    count = [0, 0]  # examples, frames

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(st.randoms(use_true_random=False))
    def one_connection(rng: random.Random) -> None:
        frames = [port.frame(rng) for _ in range(rng.randrange(1, 48))]
        count[1] += send_frames(port, frames, random.Random(rng.getrandbits(64)))
        count[0] += 1
        if count[0] % PROBE_EVERY == 0:
            port.probe()

    try:
        port.probe()
        one_connection()
        port.probe()
    finally:
        port.close()
    assert count[1] >= EXAMPLES
    healthy(t, before)


def _authed(port: TePort) -> socket.socket:
    s = socket.create_connection(port.address(), timeout=10)
    hello = bytearray(wire.HELLO.size)
    wire.recv_exact(s, memoryview(hello))
    nonce, ours = wire.HELLO.unpack(hello)[4], bytes(wire.NONCE)
    s.sendall(
        wire.AUTH.pack(
            wire.MAGIC, wire.VERSION, 0, wire.initiator_proof(port.token, nonce, ours), ours
        )
    )
    verdict = bytearray(wire.VERDICT.size)
    wire.recv_exact(s, memoryview(verdict))
    assert wire.VERDICT.unpack(verdict)[1] == wire.VERDICT_OK
    return s


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(
    op=st.sampled_from([wire.OP_READ, wire.OP_WRITE, wire.OP_PING]),
    offset=st.integers(-(1 << 16), 1 << 17) | st.sampled_from([-(1 << 40), 1 << 40]),
    length=st.integers(0, 1 << 17) | st.sampled_from([wire.MAX_PAYLOAD + 1, (1 << 64) - 1]),
)
def test_te_requests_outside_the_region_are_refused(
    te_session: tuple[TargetProcess, TePort, socket.socket], op: int, offset: int, length: int
) -> None:
    """Each request is answered in order with OK (wholly inside the region), ACCESS (not) or
    PROTOCOL (a length over the limit, then the connection closes); never a write outside."""
    t, _port, _ = te_session
    base, size = t.info["region"], t.info["region_len"]
    s = te_session[2]
    addr = (base + offset) % (1 << 64)
    payload = bytes(length) if op == wire.OP_WRITE and length <= wire.MAX_PAYLOAD else b""
    s.sendall(wire.REQ.pack(wire.REQ_MAGIC, op, 0, 0, 9, addr, length) + payload)
    head = bytearray(wire.RESP.size)
    wire.recv_exact(s, memoryview(head))
    _, status, _, _, _rid, n = wire.RESP.unpack(head)
    body = bytearray(n)
    wire.recv_exact(s, memoryview(body))
    inside = offset >= 0 and offset + length <= size
    if length > wire.MAX_PAYLOAD:
        assert status == wire.ST_PROTOCOL
        s.close()
        te_session_reconnect(te_session)
    elif op == wire.OP_PING:
        assert status == wire.ST_OK
    elif inside:
        assert status == wire.ST_OK, bytes(body)
    else:
        assert status in (wire.ST_ACCESS, wire.ST_PROTOCOL), (status, bytes(body))
    check = t.check()
    assert check is not None and check["canary_ok"] is True


@pytest.fixture(scope="module")
def te_session(targets: dict[str, TargetProcess]) -> Iterator[list[object]]:
    t = target(targets, "te")
    port = TePort(t.info)
    box: list[object] = [t, port, _authed(port)]
    yield box
    port.probe()
    port.close()


def te_session_reconnect(box: object) -> None:
    assert isinstance(box, list)
    box[2] = _authed(box[1])
