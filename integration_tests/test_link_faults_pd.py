"""An engine-free PD pull (two TransferSessions, real side channels, a real transfer engine)
with both its side channel and its data plane through a fault relay: under delay and loss the
decode reads the exact prefill blocks; through a partition that never heals the load fails with
load errors (the engine would recompute) within its deadline, never a hang; healed, the next
load succeeds without restarting either side."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from helpers import wait_until

from mooncake_connectors.bench.faultlink import FaultLink
from mooncake_connectors.config import EngineConfig
from mooncake_connectors.pd.params import PullParams, prompt_hash
from mooncake_connectors.pd.plan import RecvSpec, StepPlan
from mooncake_connectors.pd.session import TransferSession
from mooncake_connectors.transfer_core.descriptor import decode_segment, encode_segment
from mooncake_connectors.transfer_core.metadata.base import SEGMENT_PREFIX

torch = pytest.importorskip("torch", reason="torch is not installed")

BS, NUM_BLOCKS, TIMEOUT, MARGIN = 16, 32, 3.0, 2.0
PROMPT = list(range(100, 200))  # 100 tokens: 7 blocks
NS = f"memory://pdlf-{uuid.uuid4().hex[:8]}"


@dataclasses.dataclass(frozen=True)
class Settings:
    host: str = "127.0.0.1"
    side_channel_port: int = 0
    transfer_timeout: float = TIMEOUT
    handshake_timeout: float = TIMEOUT
    kv_lease: float = 120.0
    accept_push: bool = False

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            host=self.host, metadata=NS, transports=("tcp",), timeout=self.transfer_timeout
        )


class NoStats:
    def __getattr__(self, name: str) -> Any:
        return lambda *a: None


def _kv(fill: bool) -> dict[str, Any]:
    shape = (NUM_BLOCKS, 2, BS, 2 * 64)
    gen = torch.Generator().manual_seed(3)
    return {
        f"model.layers.{i}.self_attn.attn": (
            torch.randn(shape, generator=gen).to(torch.bfloat16)
            if fill
            else torch.zeros(shape, dtype=torch.bfloat16)
        )
        for i in range(2)
    }


@pytest.fixture
def pd() -> Iterator[tuple[TransferSession, TransferSession, dict, dict, FaultLink, FaultLink]]:
    def make(engine_id: str) -> TransferSession:
        return TransferSession(
            Settings(), engine_id, block_size=BS, tp_size=1, num_blocks=NUM_BLOCKS,
            num_kv_heads=2, stats=NoStats(),
        )  # fmt: skip

    prefill, dec = make("prefill-engine"), make("decode-engine")
    src, dst = _kv(True), _kv(False)
    prefill.register(src, 0)
    dec.register(dst, 0)
    assert prefill.engine is not None and prefill.side_channel is not None
    md = prefill.engine.metadata
    assert md is not None
    key = SEGMENT_PREFIX + prefill.engine.segment_name
    desc = decode_segment(md.get(key) or b"")
    host, port = desc.endpoints["tcp"].rsplit(":", 1)
    data = FaultLink((host, int(port)))
    fields = {f: getattr(desc, f) for f in desc.__struct_fields__}
    fields["endpoints"] = {**desc.endpoints, "tcp": data.address}
    md.put(key, encode_segment(type(desc)(**fields)))
    sc_host, sc_port = prefill.side_channel.removeprefix("tcp://").rsplit(":", 1)
    side = FaultLink((sc_host, int(sc_port)))
    try:
        yield prefill, dec, src, dst, data, side
    finally:
        dec.shutdown()
        prefill.shutdown()
        data.close()
        side.close()


def load(dec: TransferSession, side: FaultLink, req: str, local: list[int]) -> bool:
    """One pull of prefill blocks 20..26; True when it succeeded, False on load errors."""
    remote = PullParams(
        "prefill-engine", "p-" + req, 100, prompt_hash(PROMPT),
        (f"tcp://{side.address}",), 1, 1e12, tuple(range(20, 27)),
    )  # fmt: skip
    t0 = time.monotonic()
    dec.start_load_kv(StepPlan(recv=[RecvSpec(req, local, list(range(20, 27)), remote)]))
    wait_until(lambda: req in dec._recv_done, 2 * TIMEOUT + 3 * MARGIN, f"load {req} to end")
    assert time.monotonic() - t0 < 2 * TIMEOUT + 3 * MARGIN
    errors = dec.take_load_errors()
    assert errors in (set(), set(local))
    return not errors


def same(src: dict, dst: dict, local: list[int]) -> bool:
    return all(torch.equal(dst[n][local[0] : local[-1] + 1], src[n][20:27]) for n in src)


def test_pd_pull_through_a_bad_then_cut_then_healed_link(pd: Any) -> None:
    _prefill, dec, src, dst, data, side = pd
    for link in (data, side):
        link.shape(delay=0.05, jitter=0.02, loss=0.05)
    assert load(dec, side, "d-1", list(range(0, 7)))
    assert same(src, dst, list(range(0, 7)))
    data.partition()
    assert not load(dec, side, "d-2", list(range(8, 15)))  # load errors, within its deadline
    data.heal()
    for link in (data, side):
        link.shape()
    deadline = time.monotonic() + 30
    i = 3
    while not load(dec, side, f"d-{i}", list(range(16, 23))):
        assert time.monotonic() < deadline, "no recovery after the partition healed"
        i += 1
    assert same(src, dst, list(range(16, 23)))
