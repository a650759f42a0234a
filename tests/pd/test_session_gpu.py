"""PD on GPU KV caches: a decode session reads a prefill session's GPU blocks straight into its
own, in vLLM's GPU layout (K and V apart), over cuda_ipc and over tcp with staging.

The CUDA driver is FakeCuda at our driver seam, and the KV tensors are FakeCudaTensor (the
geometry vLLM's tensors show the connector, over fake device memory); the sessions, side
channels, engine and transports are the real ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np
import pytest
from fake_cuda import FakeCuda, FakeCudaTensor, ensure_cuda_ipc_registered, installed
from helpers import pattern, wait_until

from mooncake_connectors.config import DEFAULT_TRANSPORTS, EngineConfig
from mooncake_connectors.pd.params import PullParams, prompt_hash
from mooncake_connectors.pd.plan import RecvSpec, StepPlan
from mooncake_connectors.pd.session import TransferSession

BS, NUM_BLOCKS, HEADS, HEAD = 16, 32, 2, 64
PROMPT = list(range(100, 200))
ensure_cuda_ipc_registered()


@dataclasses.dataclass(frozen=True)
class Settings:
    transports: tuple[str, ...]
    host: str = "127.0.0.1"
    side_channel_port: int = 0
    transfer_timeout: float = 20.0
    handshake_timeout: float = 5.0
    kv_lease: float = 120.0
    accept_push: bool = False

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            host=self.host,
            metadata="p2p",
            transports=self.transports,
            timeout=self.transfer_timeout,
            transport_settings={"tcp": {"staging_chunk": 16384, "staging_buffers": 2}}
            if "tcp" in self.transports
            else {},
        )


@pytest.fixture
def fake() -> Iterator[FakeCuda]:
    with installed() as f:
        yield f


def _kv(fake: FakeCuda, seed: int | None) -> dict[str, FakeCudaTensor]:
    out = {}
    for i in range(2):
        t = FakeCudaTensor(fake, (2, NUM_BLOCKS, BS, HEADS, HEAD))
        if seed is not None:
            t.bytes[:] = pattern(seed + i, t.bytes.size)
        out[f"model.layers.{i}.self_attn.attn"] = t
    return out


def _session(engine_id: str, transports: tuple[str, ...]) -> TransferSession:
    return TransferSession(
        Settings(transports),
        engine_id,
        block_size=BS,
        tp_size=1,
        num_blocks=NUM_BLOCKS,
        num_kv_heads=HEADS,
        stats=_Stats(),
    )


class _Stats:
    """The session's stats sink; loads it recorded, failures counted."""

    def __init__(self) -> None:
        self.loads: list[tuple[float, int, int]] = []
        self.failed = 0

    def record_load(self, seconds: float, nbytes: int, nrequests: int) -> None:
        self.loads.append((seconds, nbytes, nrequests))

    def record_push(self, tail: float, nbytes: int, nrequests: int, overlapped: int) -> None:
        pass

    def record_failed_load(self) -> None:
        self.failed += 1

    def record_expired_lease(self) -> None:
        pass


@pytest.mark.parametrize("transports", [("cuda_ipc", "tcp"), ("tcp",), DEFAULT_TRANSPORTS])
def test_decode_reads_prefill_gpu_blocks_into_its_own(
    fake: FakeCuda, transports: tuple[str, ...]
) -> None:
    prefill, dec = _session("eng-p", transports), _session("eng-d", transports)
    src, dst = _kv(fake, 1), _kv(fake, None)
    try:
        prefill.register(src, 0)
        dec.register(dst, 0)
        assert dec.engine is not None
        used = [t.name for t in dec.engine.transports]
        # the default list gains cuda_ipc in front for GPU KV; a chosen list stays as chosen
        assert used == (
            ["cuda_ipc", *DEFAULT_TRANSPORTS]
            if transports == DEFAULT_TRANSPORTS
            else list(transports)
        )
        assert prefill.side_channel is not None
        blocks = tuple(range(20, 27))
        remote = PullParams(
            "eng-p", "p-1", 100, prompt_hash(PROMPT), (prefill.side_channel,), 1, 1e12, blocks
        )
        dec.start_load_kv(
            StepPlan(recv=[RecvSpec("d-1", list(range(3, 10)), list(blocks), remote)])
        )
        wait_until(lambda: "d-1" in dec._recv_done, 20, "the load to finish")
        assert dec.take_load_errors() == set()
        for name in src:
            got, want = dst[name].elements(), src[name].elements()
            assert np.array_equal(got[:, 3:10], want[:, 20:27])  # K and V planes both
            assert not got[:, 10:].any() and not got[:, :3].any()
    finally:
        prefill.shutdown()
        dec.shutdown()
