"""KV block geometry and the transfer requests between ranks (engine-free PD protocol).

The block arithmetic is checked by moving real bytes: two transfer engines, KV-shaped tensors
(torch only builds the test's tensors), the requests ``plan_reads`` makes, and a comparison of
every block afterwards.
"""

from __future__ import annotations

import pytest

from mooncake_connectors.config import EngineConfig
from mooncake_connectors.errors import ConfigError
from mooncake_connectors.pd.layout import (
    check_compatible,
    layer_layouts,
    plan_reads,
    readers_per_source,
    register_spans,
    source_ranks,
)
from mooncake_connectors.pd.messages import (
    WorkerLayout,
)
from mooncake_connectors.transfer_core import TransferEngine
from mooncake_connectors.types import Access, TransferOp, TransferStatus

torch = pytest.importorskip("torch", reason="torch is not installed")


# -- layout -------------------------------------------------------------------------------------

NB, HEADS, BS, HEAD = 8, 2, 32, 16  # CPU layout: (blocks, kv heads, block size, 2 * head size)


def cpu_kv(fill: bool = True) -> torch.Tensor:
    t = torch.zeros(NB, HEADS, BS, 2 * HEAD, dtype=torch.bfloat16)
    if fill:
        for b in range(NB):
            t[b] = torch.arange(HEADS * BS * 2 * HEAD).reshape(HEADS, BS, 2 * HEAD) + 1000 * b
    return t


def test_cpu_layout_is_one_range_per_block() -> None:
    t = cpu_kv(False)
    (lay,) = layer_layouts("l0", t, NB, HEADS)
    assert lay.addr == t.data_ptr() and lay.num_blocks == NB
    assert lay.block_bytes == lay.stride == HEADS * BS * 2 * HEAD * 2
    assert lay.head_bytes == BS * 2 * HEAD * 2  # heads outermost inside a block


def test_kernel_blocks_and_k_v_first_layouts() -> None:
    t = torch.zeros(2 * NB, HEADS, BS // 2, 2 * HEAD, dtype=torch.bfloat16)  # 2 kernel blocks each
    (lay,) = layer_layouts("l0", t, NB, HEADS)
    assert lay.block_bytes == lay.stride == 2 * HEADS * (BS // 2) * 2 * HEAD * 2
    assert lay.head_bytes == 0  # two kernel blocks per block: heads are not outermost
    kv = torch.zeros(2, NB, BS, HEADS, HEAD, dtype=torch.float16)  # GPU flash-attention style
    k, v = layer_layouts("l1", kv, NB)
    assert (k.name, v.name) == ("l1/k", "l1/v")
    assert v.addr - k.addr == NB * BS * HEADS * HEAD * 2
    assert k.block_bytes == k.stride == BS * HEADS * HEAD * 2
    assert k.head_bytes == 0


def test_layouts_that_are_not_block_major_are_refused() -> None:
    t = torch.zeros(HEADS, NB, BS, 2 * HEAD).transpose(0, 1)  # blocks not outermost in memory
    with pytest.raises(ConfigError, match="cannot address by block"):
        layer_layouts("l0", t, NB)
    with pytest.raises(ConfigError, match="cannot address by block"):
        layer_layouts("l0", torch.zeros(NB + 1, 4), NB)


def test_layers_interleaved_in_one_allocation_share_one_span() -> None:
    big = torch.zeros(NB, 2, HEADS, BS, 2 * HEAD)  # blocks outermost, then layers
    lays = [lay for i in range(2) for lay in layer_layouts(f"l{i}", big[:, i], NB)]
    assert lays[0].stride == 2 * lays[0].block_bytes
    assert register_spans(lays) == [(big.data_ptr(), big.numel() * 4)]
    a, b = cpu_kv(False), cpu_kv(False)
    spans = register_spans([*layer_layouts("a", a, NB), *layer_layouts("b", b, NB)])
    assert sorted(spans) == sorted([(a.data_ptr(), a.nbytes), (b.data_ptr(), b.nbytes)])


def worker_layout(
    tensors: dict[str, torch.Tensor], segment: str = "seg", rank: int = 0, tp: int = 1
) -> WorkerLayout:
    layers = [lay for n, t in tensors.items() for lay in layer_layouts(n, t, NB, t.shape[1])]
    dtype = str(next(iter(tensors.values())).dtype)
    return WorkerLayout("e", rank, tp, segment, "tcp://127.0.0.1:1", BS, dtype, layers)


def test_plan_reads_coalesces_runs_and_names_the_blocks_of_each_request() -> None:
    local = worker_layout({"l0": cpu_kv(False), "l1": cpu_kv(False)})
    remote = worker_layout({"l0": cpu_kv(False), "l1": cpu_kv(False)})
    reqs, owners = plan_reads(local, [remote], [0, 1, 2, 6], [3, 4, 5, 1])
    assert len(reqs) == 4  # two runs x two layers
    assert owners == [(0, 1, 2), (6,), (0, 1, 2), (6,)]
    size = local.layers[0].block_bytes
    assert reqs[0].length == 3 * size and reqs[1].length == size
    assert reqs[0].remote_addr == remote.layers[0].addr + 3 * size
    assert reqs[1].local_addr == local.layers[0].addr + 6 * size
    with pytest.raises(ConfigError, match="out of range"):
        plan_reads(local, [remote], [7, 8], [0, 1])
    with pytest.raises(ConfigError, match="local blocks for"):
        plan_reads(local, [remote], [1], [1, 2])


def test_incompatible_layouts_are_named() -> None:
    ours = worker_layout({"l0": cpu_kv(False)})
    with pytest.raises(ConfigError, match="layers differ"):
        check_compatible(ours, worker_layout({"other": cpu_kv(False)}))
    small = torch.zeros(NB, 1, BS, 2 * HEAD, dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match="block of"):
        check_compatible(ours, worker_layout({"l0": small}))
    check_compatible(ours, worker_layout({"l0": cpu_kv(False)}))


def test_planned_reads_move_each_block_into_its_place() -> None:
    src = {"l0": cpu_kv(), "l1": cpu_kv() * 2}
    dst = {"l0": cpu_kv(False), "l1": cpu_kv(False)}
    prefill = TransferEngine(EngineConfig(metadata="memory://pd-parts", transports=("tcp",)))
    decode = TransferEngine(EngineConfig(metadata="memory://pd-parts", transports=("tcp",)))
    with prefill, decode:
        for engine, tensors in ((prefill, src), (decode, dst)):
            lays = [lay for n, t in tensors.items() for lay in layer_layouts(n, t, NB)]
            engine.register_many(register_spans(lays), access=Access.READ, owner=tensors)
        remote = worker_layout(src, prefill.segment_name)
        reqs, _ = plan_reads(worker_layout(dst), [remote], [0, 1, 2, 6], [3, 4, 5, 1])
        batch = decode.submit(reqs, timeout=10)
        assert batch.wait(15)
        assert batch.statuses == [TransferStatus.COMPLETED] * len(reqs)
    for name in src:
        for lb, rb in zip([0, 1, 2, 6], [3, 4, 5, 1], strict=True):
            assert torch.equal(dst[name][lb], src[name][rb])
        for untouched in (3, 4, 5, 7):
            assert not dst[name][untouched].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_other_element_sizes_move_block_for_block(dtype: torch.dtype) -> None:
    """A float32 model (4-byte elements, as ``--dtype float32`` gives) and a 2-byte one: the
    block arithmetic scales with the element size, and every byte lands in its block."""
    shape = (NB, HEADS, BS, 2 * HEAD)
    src = {"l0": torch.randn(shape, generator=torch.Generator().manual_seed(5)).to(dtype)}
    dst = {"l0": torch.zeros(shape, dtype=dtype)}
    (lay,) = layer_layouts("l0", src["l0"], NB, HEADS)
    elem = torch.tensor([], dtype=dtype).element_size()
    assert lay.block_bytes == lay.stride == HEADS * BS * 2 * HEAD * elem
    assert lay.head_bytes == BS * 2 * HEAD * elem
    with pytest.raises(ConfigError, match="dtype"):
        check_compatible(worker_layout(dst), worker_layout({"l0": cpu_kv(False)}))
    prefill = TransferEngine(EngineConfig(metadata="memory://pd-elem", transports=("tcp",)))
    decode = TransferEngine(EngineConfig(metadata="memory://pd-elem", transports=("tcp",)))
    with prefill, decode:
        for engine, tensors in ((prefill, src), (decode, dst)):
            lays = layer_layouts("l0", tensors["l0"], NB)
            engine.register_many(register_spans(lays), access=Access.READ, owner=tensors)
        remote = worker_layout(src, prefill.segment_name)
        check_compatible(worker_layout(dst), remote)
        reqs, _ = plan_reads(worker_layout(dst), [remote], [0, 1, 7], [6, 2, 3])
        batch = decode.submit(reqs, timeout=10)
        assert batch.wait(15)
        assert batch.statuses == [TransferStatus.COMPLETED] * len(reqs)
    for lb, rb in zip([0, 1, 7], [6, 2, 3], strict=True):
        assert torch.equal(dst["l0"][lb], src["l0"][rb])
    assert not dst["l0"][2:7].any()


def test_tp_pairing() -> None:
    assert source_ranks(0, 1, 2) == [0, 1] and source_ranks(1, 2, 4) == [2, 3]
    assert source_ranks(3, 4, 2) == [1] and source_ranks(0, 2, 2) == [0]
    assert readers_per_source(4, 2) == 2 and readers_per_source(1, 2) == 1
    with pytest.raises(ConfigError, match="divide"):
        source_ranks(0, 2, 3)


def rank_kv(heads: int, seed: int, fill: bool = True) -> torch.Tensor:
    t = torch.zeros(NB, heads, BS, 2 * HEAD, dtype=torch.bfloat16)
    if fill:
        t.copy_(torch.randint(-100, 100, t.shape, generator=torch.Generator().manual_seed(seed)))
    return t


def move(src: list[dict[str, torch.Tensor]], dst: list[dict[str, torch.Tensor]], ns: str) -> None:
    """Prefill ranks ``src`` to decode ranks ``dst``, one engine per rank, as the workers do."""
    engines = [
        TransferEngine(EngineConfig(metadata=f"memory://{ns}", transports=("tcp",))).start()
        for _ in range(len(src) + len(dst))
    ]
    try:
        layouts = []
        for i, (engine, tensors) in enumerate(zip(engines, src + dst, strict=True)):
            rank, tp = (i, len(src)) if i < len(src) else (i - len(src), len(dst))
            lay = worker_layout(tensors, engine.segment_name, rank, tp)
            engine.register_many(register_spans(lay.layers), access=Access.READ, owner=tensors)
            layouts.append(lay)
        prefill, decode = layouts[: len(src)], layouts[len(src) :]
        for rank, local in enumerate(decode):
            sources = [prefill[r] for r in source_ranks(rank, len(dst), len(src))]
            for remote in sources:
                check_compatible(local, remote)
            reqs, _ = plan_reads(local, sources, [0, 1, 2, 6], [3, 4, 5, 1])
            batch = engines[len(src) + rank].submit(reqs, timeout=10)
            assert batch.wait(15)
            assert batch.statuses == [TransferStatus.COMPLETED] * len(reqs)
    finally:
        for e in engines:
            e.close()


def test_decode_with_smaller_tp_gathers_heads_from_each_prefill_rank() -> None:
    src = [{"l0": rank_kv(1, 10 + r), "l1": rank_kv(1, 20 + r)} for r in range(2)]
    dst = [{"l0": rank_kv(2, 0, False), "l1": rank_kv(2, 0, False)}]
    move(src, dst, "pd-tp-2to1")
    for name in ("l0", "l1"):
        for lb, rb in zip([0, 1, 2, 6], [3, 4, 5, 1], strict=True):
            for head in range(2):
                assert torch.equal(dst[0][name][lb, head], src[head][name][rb, 0])
        assert not dst[0][name][7].any()


def test_decode_with_larger_tp_reads_its_heads_of_the_prefill_block() -> None:
    src = [{"l0": rank_kv(2, 30), "l1": rank_kv(2, 31)}]
    dst = [{"l0": rank_kv(1, 0, False), "l1": rank_kv(1, 0, False)} for _ in range(2)]
    move(src, dst, "pd-tp-1to2")
    for rank in range(2):
        for name in ("l0", "l1"):
            for lb, rb in zip([0, 1, 2, 6], [3, 4, 5, 1], strict=True):
                assert torch.equal(dst[rank][name][lb, 0], src[0][name][rb, rank])


def test_heterogeneous_tp_needs_head_major_blocks_and_equal_heads() -> None:
    one = worker_layout({"l0": rank_kv(1, 0, False)}, rank=0, tp=2)
    two = worker_layout({"l0": rank_kv(2, 0, False)}, rank=0, tp=1)
    check_compatible(two, one)
    check_compatible(one, two)
    three = worker_layout({"l0": rank_kv(3, 0, False)}, rank=0, tp=1)
    with pytest.raises(ConfigError, match="replicated"):
        check_compatible(three, one)
    split = torch.zeros(2 * NB, 2, BS // 2, 2 * HEAD, dtype=torch.bfloat16)
    kernel = WorkerLayout(
        "e", 0, 1, "s", "", BS, "torch.bfloat16", layer_layouts("l0", split, NB, 2)
    )
    with pytest.raises(ConfigError, match="head-major"):
        check_compatible(kernel, one)


def test_planned_writes_push_only_the_named_layers_into_the_peer() -> None:
    src = {"l0": cpu_kv(), "l1": cpu_kv() * 2}
    dst = {"l0": cpu_kv(False), "l1": cpu_kv(False)}
    prefill = TransferEngine(EngineConfig(metadata="memory://pd-push", transports=("tcp",)))
    decode = TransferEngine(EngineConfig(metadata="memory://pd-push", transports=("tcp",)))
    with prefill, decode:
        for engine, tensors, access in ((prefill, src, Access.READ), (decode, dst, Access.WRITE)):
            lays = [lay for n, t in tensors.items() for lay in layer_layouts(n, t, NB)]
            engine.register_many(register_spans(lays), access=access, owner=tensors)
        target = worker_layout(dst, decode.segment_name)
        reqs, _ = plan_reads(
            worker_layout(src), [target], [3, 4, 5], [0, 1, 7], op=TransferOp.WRITE, layers={"l1"}
        )
        assert {r.op for r in reqs} == {TransferOp.WRITE} and len(reqs) == 2  # 3-4-5 -> 0-1, 7
        batch = prefill.submit(reqs, timeout=10)
        assert batch.wait(15)
        assert batch.statuses == [TransferStatus.COMPLETED] * len(reqs)
    for lb, rb in zip([0, 1, 7], [3, 4, 5], strict=True):
        assert torch.equal(dst["l1"][lb], src["l1"][rb])
    assert not dst["l0"].any()  # not named: not written
