"""A worker's PD transfer session without an engine: leases and Done notices, failed loads, and
layer-wise push between two sessions over real side channels and a real transfer engine.

torch only builds KV-shaped tensors; the session is given block size, TP size and rank as
plain integers, as an engine adapter gives them.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq
from helpers import wait_until

from mooncake_connectors import certs
from mooncake_connectors.config import EngineConfig
from mooncake_connectors.pd.messages import Done, LayoutRequest, PushTarget, decode
from mooncake_connectors.pd.params import PullParams, PushParams, prompt_hash
from mooncake_connectors.pd.plan import PushRecvSpec, PushSendStep, RecvSpec, StepPlan
from mooncake_connectors.pd.session import TransferSession

torch = pytest.importorskip("torch", reason="torch is not installed")

BS = 16
NUM_BLOCKS = 64
PROMPT = list(range(100, 200))  # 100 tokens: 7 blocks of 16


@dataclasses.dataclass(frozen=True)
class Settings:
    host: str = "127.0.0.1"
    side_channel_port: int = 0
    transfer_timeout: float = 20.0
    handshake_timeout: float = 5.0
    kv_lease: float = 120.0
    accept_push: bool = False
    tls: tuple[str, str, str] | None = None  # cert, key, CA

    def engine_config(self) -> EngineConfig:
        cert, key, ca = self.tls or (None, None, None)
        return EngineConfig(
            host=self.host,
            metadata="p2p",
            transports=("tcp",),
            timeout=self.transfer_timeout,
            tls_cert=cert,
            tls_key=key,
            tls_ca=ca,
        )


@dataclasses.dataclass
class Recorded:
    """The session's stats sink: what it recorded, in order."""

    loads: list[tuple[float, int, int]] = dataclasses.field(default_factory=list)
    pushes: list[tuple[float, int, int, int]] = dataclasses.field(default_factory=list)
    failed_loads: int = 0
    expired_leases: int = 0

    def record_load(self, seconds: float, nbytes: int, nrequests: int) -> None:
        self.loads.append((seconds, nbytes, nrequests))

    def record_push(self, tail: float, nbytes: int, nrequests: int, overlapped: int) -> None:
        self.pushes.append((tail, nbytes, nrequests, overlapped))

    def record_failed_load(self) -> None:
        self.failed_loads += 1

    def record_expired_lease(self) -> None:
        self.expired_leases += 1


def session(engine_id: str = "eng", **settings: Any) -> tuple[TransferSession, Recorded]:
    stats = Recorded()
    s = TransferSession(
        Settings(**settings),
        engine_id,
        block_size=BS,
        tp_size=1,
        num_blocks=NUM_BLOCKS,
        num_kv_heads=2,
        stats=stats,
    )
    return s, stats


def pull_params(side_channel: str) -> PullParams:
    blocks = tuple(range(20, 27))
    return PullParams(
        "prefill-engine", "p-1", 100, prompt_hash(PROMPT), (side_channel,), 1, 1e12, blocks
    )


# -- leases, Done, failed loads (no KV registered) ----------------------------------------------


def test_prefill_blocks_are_freed_on_done_from_every_reader_or_at_lease_end() -> None:
    w, stats = session(kv_lease=30, transfer_timeout=1)
    try:
        w._on_done(Done("eng", ["early"], 0, 1))  # Done may beat the scheduler's plan
        w._on_done(Done("other-engine", ["a"], 0, 1))  # not ours: ignored
        w.start_load_kv(StepPlan(send={"a": 30.0, "early": 30.0, "b": 0.3}))
        assert w.get_finished() == ({"early"}, None)
        w._on_done(Done("eng", ["a"], 0, 2))  # the first of two decode ranks
        assert w.get_finished() == (None, None)
        w._on_done(Done("eng", ["a"], 0, 2))  # the same rank again does not count twice
        assert w.get_finished() == (None, None)
        w._on_done(Done("eng", ["a"], 1, 2))
        assert w.get_finished() == ({"a"}, None)
        assert stats.expired_leases == 0
        wait_until(lambda: w.get_finished()[0] == {"b"}, 5, "the lease of b to end")
        assert stats.expired_leases == 1
    finally:
        w.shutdown()


def test_blocks_of_an_unreachable_prefill_become_load_errors_and_the_prefill_is_told() -> None:
    ctx = zmq.Context.instance()
    mute = ctx.socket(zmq.ROUTER)  # a side channel that never answers
    mute.setsockopt(zmq.LINGER, 0)
    port = mute.bind_to_random_port("tcp://127.0.0.1")
    w, stats = session(handshake_timeout=0.5, transfer_timeout=2)
    try:
        remote = pull_params(f"tcp://127.0.0.1:{port}")
        w.start_load_kv(StepPlan(recv=[RecvSpec("d-9", [4, 5, 6], [1, 2, 3], remote)]))
        wait_until(lambda: "d-9" in w._recv_done, 10, "the failed load to finish")
        assert w.get_finished() == (None, {"d-9"})
        assert w.take_load_errors() == {4, 5, 6}
        assert w.take_load_errors() == set()
        # a load queued right behind it fails without asking the silent peer again
        w.start_load_kv(StepPlan(recv=[RecvSpec("d-10", [7], [1], remote)]))
        wait_until(lambda: "d-10" in w._recv_done, 10, "the second load to fail")
        assert w.get_finished() == (None, {"d-10"}) and w.take_load_errors() == {7}
        assert stats.failed_loads == 2 and stats.loads == []
        # the prefill was told after each, so it frees its blocks before the lease ends
        got: list[Any] = []
        for _ in range(10):
            if sum(isinstance(m, Done) for m in got) == 2 or not mute.poll(2000):
                break
            _identity, payload = mute.recv_multipart()
            got.append(decode(payload))
        assert [type(m) for m in got] == [LayoutRequest, Done, Done], got
        assert got[1] == got[2] == Done("prefill-engine", ["p-1"], 0, 1)
    finally:
        w.shutdown()
        mute.close()


def test_a_refused_load_is_reported_without_reading() -> None:
    w, stats = session()
    try:
        remote = pull_params("tcp://127.0.0.1:9")  # nothing listens: no layout to ask for
        spec = RecvSpec("d-1", [3], [], remote, error="unexpected allocation")
        expired = msgspec.structs.replace(remote, expires_at=1.0)  # the lease is over
        w.start_load_kv(StepPlan(recv=[spec, RecvSpec("d-2", [4], [20], expired)]))
        wait_until(lambda: {"d-1", "d-2"} <= w._recv_done, 10, "both loads to be refused")
        assert w.take_load_errors() == {3, 4} and stats.failed_loads == 2
    finally:
        w.shutdown()


def test_a_sync_load_is_in_place_when_start_load_kv_returns_and_is_never_reported() -> None:
    prefill, _ = session("prefill-engine")
    dec, stats = session("eng-d")
    src, dst = _kv(True), _kv(False)
    try:
        prefill.register(src, 0)
        dec.register(dst, 0)
        assert prefill.side_channel is not None
        prefill.start_load_kv(StepPlan(send={"p-1": 30.0}))
        remote = pull_params(prefill.side_channel)
        local = list(range(3, 10))
        spec = RecvSpec("d-1", local, list(remote.block_ids), remote, sync=True)
        dec.start_load_kv(StepPlan(recv=[spec]))
        # no waiting: the step's forward runs right after start_load_kv
        for name in src:
            assert torch.equal(dst[name][3:10], src[name][20:27])
        assert dec.take_load_errors() == set() and len(stats.loads) == 1
        # the load's bookkeeping ended before start_load_kv returned: nothing more will come
        assert dec.get_finished() == (None, None)  # vLLM never parked the request for it
        wait_until(lambda: prefill.get_finished()[0] == {"p-1"}, 10, "the prefill to be told")
    finally:
        prefill.shutdown()
        dec.shutdown()


def test_a_sync_load_does_not_wait_behind_asynchronous_ones() -> None:
    ctx = zmq.Context.instance()
    mute = ctx.socket(zmq.ROUTER)  # asynchronous loads from it wait out their handshake
    mute.setsockopt(zmq.LINGER, 0)
    port = mute.bind_to_random_port("tcp://127.0.0.1")
    prefill, _ = session("prefill-engine")
    dec, _ = session("eng-d", handshake_timeout=3, transfer_timeout=5)
    src, dst = _kv(True), _kv(False)
    try:
        prefill.register(src, 0)
        dec.register(dst, 0)
        assert prefill.side_channel is not None
        silent = pull_params(f"tcp://127.0.0.1:{port}")
        stuck = [RecvSpec(f"a-{i}", [40 + i], [1], silent) for i in range(8)]
        dec.start_load_kv(StepPlan(recv=stuck))  # every loader thread busy for 3 s
        remote = pull_params(prefill.side_channel)
        spec = RecvSpec("d-1", list(range(3, 10)), list(remote.block_ids), remote, sync=True)
        t0 = time.monotonic()
        dec.start_load_kv(StepPlan(recv=[spec]))
        assert time.monotonic() - t0 < 2.0
        assert torch.equal(dst[next(iter(src))][3:10], src[next(iter(src))][20:27])
    finally:
        prefill.shutdown()
        dec.shutdown()
        mute.close()


def test_a_sync_load_from_a_silent_prefill_fails_its_blocks_within_its_deadlines() -> None:
    ctx = zmq.Context.instance()
    mute = ctx.socket(zmq.ROUTER)  # a side channel that never answers
    mute.setsockopt(zmq.LINGER, 0)
    port = mute.bind_to_random_port("tcp://127.0.0.1")
    w, _ = session(handshake_timeout=0.5, transfer_timeout=2)
    try:
        remote = pull_params(f"tcp://127.0.0.1:{port}")
        t0 = time.monotonic()
        w.start_load_kv(StepPlan(recv=[RecvSpec("d-9", [4, 5, 6], [1, 2, 3], remote, sync=True)]))
        assert time.monotonic() - t0 < 0.5 + 2 + 5
        assert w.take_load_errors() == {4, 5, 6}  # known before the forward: recomputed
        assert w.get_finished() == (None, None)
    finally:
        w.shutdown()
        mute.close()


# -- layer-wise push: two sessions, real KV tensors, side channels and transfer engine ---------


def _kv(fill: bool) -> dict[str, Any]:
    shape = (NUM_BLOCKS, 2, BS, 2 * 64)  # vLLM's CPU layout, 2 KV heads of 64
    gen = torch.Generator().manual_seed(1)
    return {
        f"model.layers.{i}.self_attn.attn": (
            torch.randn(shape, generator=gen).to(torch.bfloat16)
            if fill
            else torch.zeros(shape, dtype=torch.bfloat16)
        )
        for i in range(2)
    }


@pytest.fixture(params=["plain", "tls"])
def workers(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[TransferSession, TransferSession, Recorded, dict, dict]]:
    """A prefill and a decode session (accepting pushes) with registered KV: (prefill, decode,
    decode's stats, prefill's KV, decode's KV). ``tls``: mutual TLS on the data plane and the p2p
    metadata, CURVE bound to the certificates on the side channels."""
    tls: dict[str, Any] = {"p": {}, "d": {}}
    if request.param == "tls":
        p = certs.init(tmp_path_factory.mktemp("pki"), ("p", "d"))
        tls = {n: {"tls": (str(p[n]), str(p[f"{n}-key"]), str(p["ca"]))} for n in ("p", "d")}
    prefill, _ = session("eng-p", accept_push=True, transfer_timeout=3, **tls["p"])
    dec, stats = session("eng-d", accept_push=True, transfer_timeout=3, **tls["d"])
    src, dst = _kv(True), _kv(False)
    try:
        prefill.register(src, 0)
        dec.register(dst, 0)
        yield prefill, dec, stats, src, dst
    finally:
        prefill.shutdown()
        dec.shutdown()


@pytest.mark.parametrize("target_first", [True, False])
def test_push_writes_each_layer_into_the_decode_blocks(workers: Any, target_first: bool) -> None:
    prefill, dec, stats, src, dst = workers
    assert prefill.side_channel is not None
    remote = PushParams("pid", "eng-p", (prefill.side_channel,), 1)
    recv = PushRecvSpec("d-1", [40, 41, 42], 1, 60, prompt_hash(PROMPT[:60]), remote)
    send = PushSendStep("p-1", "pid", [5, 6, 7, 8], 4, 60, prompt_hash(PROMPT[:60]), True)
    step_plan = StepPlan(push_send=[send])

    def forward() -> None:
        for name in src:
            prefill.save_kv_layer(name, step_plan)
        prefill.start_load_kv(step_plan)  # after the forward, as vLLM does: no double count
        prefill.wait_for_save()

    if target_first:
        dec.start_load_kv(StepPlan(push_recv=[recv]))
        wait_until(lambda: prefill._pushes.get("pid") is not None, 5, "the push target")
        forward()
    else:  # the prefill computed everything before the decode allocated: caught up
        forward()
        dec.start_load_kv(StepPlan(push_recv=[recv]))
    wait_until(lambda: "d-1" in dec._recv_done, 10, "the push to end")
    assert dec.get_finished() == (None, {"d-1"}) and dec.take_load_errors() == set()
    for name in src:  # prefill blocks 6, 7, 8 (from first_block 1) -> decode 40, 41, 42
        assert torch.equal(dst[name][40:43], src[name][6:9])
        assert not dst[name][43].any() and not dst[name][39].any()
    (pushed,) = stats.pushes
    assert (pushed[3] > 0) == target_first  # bytes written while the forward ran
    # Pushed: the prefill frees the blocks as soon as the engine hands them over (no Done).
    prefill.start_load_kv(StepPlan(send={"p-1": 30.0}))
    wait_until(lambda: prefill.get_finished()[0] == {"p-1"}, 5, "the blocks to be freed")


def test_push_for_other_tokens_is_refused_and_the_decode_recomputes(workers: Any) -> None:
    prefill, dec, stats, src, dst = workers
    assert prefill.side_channel is not None
    remote = PushParams("pid", "eng-p", (prefill.side_channel,), 1)
    recv = PushRecvSpec("d-1", [40, 41], 0, 32, prompt_hash(PROMPT[:32]), remote)
    dec.start_load_kv(StepPlan(push_recv=[recv]))
    wait_until(lambda: prefill._pushes.get("pid") is not None, 5, "the push target")
    other = PushSendStep("p-1", "pid", [5, 6], 2, 32, prompt_hash(PROMPT[1:33]), True)
    m = StepPlan(push_send=[other])
    for name in src:
        prefill.save_kv_layer(name, m)
    prefill.wait_for_save()
    wait_until(lambda: "d-1" in dec._recv_done, 10, "the refusal")
    assert dec.take_load_errors() == {40, 41} and stats.failed_loads == 1
    assert not dst["model.layers.0.self_attn.attn"][40:42].any()  # nothing was written


def test_decode_gives_up_on_a_push_that_never_comes() -> None:
    dec, stats = session("eng-d", accept_push=True, transfer_timeout=0.5)
    ctx = zmq.Context.instance()
    mute = ctx.socket(zmq.ROUTER)  # a prefill that takes the target and never pushes
    mute.setsockopt(zmq.LINGER, 0)
    port = mute.bind_to_random_port("tcp://127.0.0.1")
    try:
        dec.register(_kv(False), 0)
        remote = PushParams("pid", "eng-p", (f"tcp://127.0.0.1:{port}",), 1)
        recv = PushRecvSpec("d-1", [3, 4], 0, 32, prompt_hash(PROMPT[:32]), remote)
        dec.start_load_kv(StepPlan(push_recv=[recv]))
        wait_until(lambda: dec.get_finished()[1] == {"d-1"}, 10, "the decode to give up")
        assert dec.take_load_errors() == {3, 4} and stats.failed_loads == 1
    finally:
        dec.shutdown()
        mute.close()


# -- hostile peers on the plaintext side channel: bounded state, the channel keeps answering ----


def _held_state(w: TransferSession) -> int:
    """Done ids and push targets the session keeps."""
    return len(w._done) + len(getattr(w, "_early", {})) + len(w._pushes)


def test_a_done_flood_for_unknown_ids_is_bounded_and_a_held_request_is_still_freed() -> None:
    from mooncake_connectors.pd.messages import encode
    from mooncake_connectors.pd.side_channel import SideChannelClient

    w, _ = session(accept_push=True)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    client = SideChannelClient(timeout=5)
    try:
        w.register(_kv(False), 0)
        assert w.side_channel is not None
        w.start_load_kv(StepPlan(send={"held": 60.0}))
        before = _held_state(w)
        sock.connect(w.side_channel)
        # 40 messages of 1,000 fresh ids (40,000 ids), one of 200,000 ids, 100 push targets
        for i in range(40):
            ids = [f"forged-{i}-{j}" for j in range(1000)]
            sock.send(encode(Done("eng", ids, 0, 1)))
        sock.send(encode(Done("eng", [f"x{j}" for j in range(200_000)], 0, 1)))
        layout = w.layout
        assert layout is not None
        for i in range(100):
            target = PushTarget(f"push-{i}", "eng", layout, 0, [], 1, "h", 1e12)
            sock.send(encode(target))
        sock.send(encode(Done("eng", ["held"], 0, 1)))  # after the flood, on the same pipe
        wait_until(lambda: "held" in w._done, 20, "the Done for the held request")
        # the channel still answers a good client
        assert client.fetch_layout(w.side_channel).engine_id == "eng"
        assert w.get_finished() == ({"held"}, None)  # a Done for a held request frees it
        grown = _held_state(w) - before
        assert grown <= 4096 + 32, f"{grown} entries kept for ids nobody holds"
        assert w.dropped_done >= 40_000 - 4096 and w.dropped_targets >= 100 - 32
    finally:
        client.close()
        sock.close()
        w.shutdown()


def test_a_good_layout_request_is_answered_during_a_done_flood() -> None:
    import threading

    from mooncake_connectors.pd.messages import encode
    from mooncake_connectors.pd.side_channel import SideChannelClient

    w, _ = session()
    stop = threading.Event()
    sent = [0]

    def flood(endpoint: str) -> None:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        try:
            for i in range(3000):  # bounded: about 3 million ids
                if stop.is_set():
                    return
                ids = [f"f-{i}-{j}" for j in range(1000)]
                sock.send(encode(Done("eng", ids, 0, 1)))
                sent[0] += 1
        finally:
            sock.close()

    client = SideChannelClient(timeout=10)
    try:
        w.register(_kv(False), 0)
        assert w.side_channel is not None
        flooder = threading.Thread(target=flood, args=(w.side_channel,), daemon=True)
        flooder.start()
        wait_until(lambda: sent[0] >= 50, 20, "the flood to start")
        for _ in range(3):
            assert client.fetch_layout(w.side_channel).engine_id == "eng"
        stop.set()
        flooder.join(30)
        assert client.fetch_layout(w.side_channel).engine_id == "eng"
        assert _held_state(w) <= 4096
    finally:
        stop.set()
        client.close()
        w.shutdown()
