"""The decode's paths to a prefill are ready before its first large load: the first load from a
prefill (a short prompt) leaves the transfer engine holding what a striped read drives (pooled
connections, stripe workers), so the first long prompt's read connects nothing and starts no
thread (issue #32: the first long prompt through a fresh pair stalled)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from helpers import wait_until

from mooncake_connectors.config import EngineConfig
from mooncake_connectors.pd.params import PullParams, prompt_hash
from mooncake_connectors.pd.plan import RecvSpec, StepPlan
from mooncake_connectors.pd.session import TransferSession
from mooncake_connectors.transfer_core.transports.tcp import TcpTransport

from .test_session import BS, NUM_BLOCKS, PROMPT, Recorded, Settings, _kv

torch = pytest.importorskip("torch", reason="torch is not installed")

STRIPE_MIN = 64 << 10  # a block is 16 KiB over both layers: 4 blocks or more are striped


@dataclasses.dataclass(frozen=True)
class StripedSettings(Settings):
    def engine_config(self) -> EngineConfig:
        cfg = super().engine_config()
        return cfg.replace(transport_settings={"tcp": {"stripes": 2, "stripe_min": STRIPE_MIN}})


def _session(engine_id: str) -> tuple[TransferSession, Recorded]:
    stats = Recorded()
    s = TransferSession(
        StripedSettings(transfer_timeout=10),
        engine_id,
        block_size=BS,
        tp_size=1,
        num_blocks=NUM_BLOCKS,
        num_kv_heads=2,
        stats=stats,
    )
    return s, stats


def _load(dec: TransferSession, rid: str, params: PullParams, local: list[int]) -> None:
    dec.start_load_kv(StepPlan(recv=[RecvSpec(rid, local, list(params.block_ids), params)]))
    wait_until(lambda: rid in dec._recv_done, 15, f"load {rid}")
    assert dec.get_finished() == (None, {rid}) and dec.take_load_errors() == set()


def test_the_first_long_load_from_a_prefill_sets_nothing_up() -> None:
    prefill, _ = _session("eng-p")
    dec, stats = _session("eng-d")
    src: dict[str, Any] = _kv(True)
    dst: dict[str, Any] = _kv(False)
    try:
        prefill.register(src, 0)
        dec.register(dst, 0)
        assert prefill.side_channel is not None and dec.engine is not None
        tcp = dec.engine.transports[0]
        assert isinstance(tcp, TcpTransport)
        runner = tcp._direct
        channels = (prefill.side_channel,)
        short = PullParams(
            "eng-p", "p-1", 16, prompt_hash(PROMPT[:16]), channels, 1, 1e12, block_ids=(20,)
        )
        _load(dec, "d-1", short, [3])  # one block: no stripes
        # after it, off its path: a striped read's connections and worker are ready
        wait_until(
            lambda: len(runner.threads) == 1 and sum(map(len, runner._idle.values())) >= 2,
            10,
            "the paths to the prefill to be prepared",
        )
        connects = runner.connects
        blocks = tuple(range(30, 37))
        long = PullParams(
            "eng-p", "p-2", 100, prompt_hash(PROMPT), channels, 1, 1e12, block_ids=blocks
        )
        _load(dec, "d-2", long, list(range(40, 47)))  # 112 KiB: striped
        for name in src:
            assert torch.equal(dst[name][40:47], src[name][30:37])
            assert torch.equal(dst[name][3], src[name][20])
        assert runner.connects == connects and len(runner.threads) == 1
        assert [n for _, n, _ in stats.loads] == [16 << 10, 112 << 10]
    finally:
        prefill.shutdown()
        dec.shutdown()
