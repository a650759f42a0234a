"""Our EplbCommunicator moves expert weights byte-exact when vLLM 0.32's own rearrangement code
drives it: two EP ranks (threads, each with its own TransferEngine over tcp on 127.0.0.1) run
``rebalance_execute.rearrange_expert_weights_inplace`` with a new map from our policy."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch
from vllm.distributed.eplb.rebalance_execute import rearrange_expert_weights_inplace

from mooncake_connectors.adapters.vllm.eplb import MooncakeEplbPolicy
from mooncake_connectors.adapters.vllm.eplb_transfer import MooncakeEplbCommunicator, RankMeta
from mooncake_connectors.config import EngineConfig
from mooncake_connectors.errors import TransferError
from mooncake_connectors.transfer_core import TransferEngine
from mooncake_connectors.transfer_core.metadata.http import MetadataHTTPServer

RANKS, LOCAL, LAYERS, EXPERTS = 2, 6, 3, 10  # 12 slots: 10 experts + 2 redundant
TIMEOUT = 30.0


class ThreadExchange:
    """The ranks' group for threads of one process (vLLM's is a gloo group per process)."""

    def __init__(self, size: int) -> None:
        self._barrier = threading.Barrier(size)
        self._values: list[RankMeta | None] = [None] * size
        self._lock = threading.Lock()

    def bound(self, rank: int) -> _Bound:
        return _Bound(self, rank)


class _Bound:
    def __init__(self, group: ThreadExchange, rank: int) -> None:
        self.group, self.rank = group, rank

    def all_gather(self, value: RankMeta) -> list[RankMeta]:
        with self.group._lock:
            self.group._values[self.rank] = value
        self.group._barrier.wait(TIMEOUT)
        out = [v for v in self.group._values if v is not None]
        self.group._barrier.wait(TIMEOUT)
        return out

    def barrier(self, timeout: float) -> None:
        self.group._barrier.wait(timeout)


class FakeEpGroup:
    """vLLM reads only ``size()`` and ``rank()`` of its EP group outside the profile run."""

    def __init__(self, rank: int) -> None:
        self._rank = rank

    def size(self) -> int:
        return RANKS

    def rank(self) -> int:
        return self._rank


@pytest.fixture
def engines() -> Iterator[list[TransferEngine]]:
    srv = MetadataHTTPServer("127.0.0.1", 0).start()
    cfg = EngineConfig(metadata=srv.url, transports=("tcp",))
    out = [TransferEngine(cfg).start() for _ in range(RANKS)]
    yield out
    for engine in out:
        engine.close()
    srv.stop()


def expert_rows(expert: int, layer: int) -> list[torch.Tensor]:
    """The weights of logical expert ``expert``: distinct bytes per (layer, expert, tensor)."""
    gen = torch.Generator().manual_seed(1000 * layer + expert)
    return [
        torch.randn(8, 4, generator=gen).to(torch.bfloat16),
        torch.randint(-(2**31), 2**31 - 1, (5,), generator=gen, dtype=torch.int32),
    ]


def weights_for(p2l: torch.Tensor, rank: int) -> list[list[torch.Tensor]]:
    layers = []
    for layer in range(LAYERS):
        rows = [expert_rows(int(e), layer) for e in p2l[layer, rank * LOCAL : (rank + 1) * LOCAL]]
        layers.append([torch.stack([r[i] for r in rows]).contiguous() for i in range(2)])
    return layers


def run_ranks(engines: list[TransferEngine], old: torch.Tensor, new: torch.Tensor) -> list[Any]:
    group = ThreadExchange(RANKS)
    weights = [weights_for(old, r) for r in range(RANKS)]
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            buffers = [torch.empty_like(t) for t in weights[rank][0]]
            comm = MooncakeEplbCommunicator(
                engines[rank], rank, group.bound(rank), weights[rank], buffers, timeout=TIMEOUT
            )
            rearrange_expert_weights_inplace(
                old, new, weights[rank], buffers, FakeEpGroup(rank), comm
            )
            comm.close()
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(RANKS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(4 * TIMEOUT)
    assert not any(t.is_alive() for t in threads)
    return [errors, weights]


def test_a_rearrangement_by_our_policy_moves_every_weight_byte_exact(
    engines: list[TransferEngine],
) -> None:
    old = torch.tensor([*range(EXPERTS), 0, 1]).expand(LAYERS, -1).contiguous()
    load = torch.zeros(LAYERS, EXPERTS)
    load[:, EXPERTS - 1] = 1000.0  # the last expert (rank 1 only) gets hot: replicas on rank 0
    load[:, 2] = 500.0
    new = MooncakeEplbPolicy.rebalance_experts(load, RANKS * LOCAL, 1, 1, RANKS, old)
    assert not torch.equal(new, old)
    # At least one expert must cross ranks, or the test would not exercise a read.
    crossing = sum(
        int(e) not in old[0, (s // LOCAL) * LOCAL : (s // LOCAL + 1) * LOCAL].tolist()
        for s, e in enumerate(new[0])
    )
    assert crossing > 0
    errors, weights = run_ranks(engines, old, new)
    assert not errors, errors
    for rank in range(RANKS):
        want = weights_for(new, rank)
        for layer in range(LAYERS):
            for got, expect in zip(weights[rank][layer], want[layer], strict=True):
                assert torch.equal(got.view(torch.uint8), expect.view(torch.uint8))


def test_a_read_of_an_expert_the_sender_does_not_hold_is_a_typed_error(
    engines: list[TransferEngine],
) -> None:
    group = ThreadExchange(1)
    weights = weights_for(torch.arange(12).expand(LAYERS, -1) % EXPERTS, 0)
    comm = MooncakeEplbCommunicator(
        engines[0], 0, group.bound(0), weights, [torch.empty_like(t[0]) for t in weights[0]]
    )
    with pytest.raises(TransferError, match="before set_transfer_context"):
        comm.add_recv([w[0] for w in weights[0]], 0, 3)
    import numpy as np

    comm.set_transfer_context(np.arange(LOCAL), 0)
    with pytest.raises(TransferError, match="holds no expert 9"):
        comm.add_recv([w[0] for w in weights[0]], 0, 9)
    comm.close()


class Coordinator:
    """vLLM's GroupCoordinator, as far as the communicator factory reads it."""

    def __init__(self, cpu_group: Any) -> None:
        self.cpu_group = cpu_group


def test_the_switch_makes_eplb_state_build_ours_over_a_real_gloo_group(
    engines: list[TransferEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch.distributed as dist
    from vllm.distributed.eplb import eplb_state

    from mooncake_connectors.adapters.vllm import eplb_transfer, plugin
    from mooncake_connectors.bench.ports import free_port
    from mooncake_connectors.errors import ConfigError

    vllm_factory = eplb_state.create_eplb_communicator
    monkeypatch.setattr(eplb_state, "create_eplb_communicator", vllm_factory)
    with pytest.raises(ConfigError, match="must be 'default' or 'mooncake'"):
        eplb_transfer.install({plugin.EPLB_COMMUNICATOR_ENV: "nccl"})
    assert eplb_transfer.install({}) is False
    assert eplb_state.create_eplb_communicator is vllm_factory
    monkeypatch.setenv(plugin.EPLB_COMMUNICATOR_ENV, "mooncake")
    plugin.register()
    plugin.register()
    assert eplb_state.create_eplb_communicator is not vllm_factory
    assert getattr(eplb_state.create_eplb_communicator, "_mooncake", False)
    # Again with an engine on this test's metadata server (the environment names none).
    monkeypatch.setattr(eplb_state, "create_eplb_communicator", vllm_factory)
    assert eplb_transfer.install(engine_factory=lambda: engines[0]) is True
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        weights = weights_for(torch.arange(LOCAL).expand(LAYERS, -1), 0)
        buffers = [torch.empty_like(t) for t in weights[0]]
        comm = eplb_state.create_eplb_communicator(
            Coordinator(dist.group.WORLD), "torch_gloo", weights, buffers
        )
        assert isinstance(comm, eplb_transfer.MooncakeEplbCommunicator)
        import numpy as np

        comm.set_transfer_context(np.array([3, 4, 5, 0, 1, 2]), 0)
        comm.add_recv([b[1] for b in buffers], 0, 0)  # rank 0 reads its own row 3
        comm.execute()  # waits for the read, then the gloo barrier
        for got, src in zip(buffers, weights[0], strict=True):
            assert torch.equal(got[1], src[3])
        comm.close()
    finally:
        dist.destroy_process_group()
