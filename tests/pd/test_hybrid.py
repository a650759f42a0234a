"""Several KV cache groups (vLLM's hybrid KV cache manager) in the engine-free PD parts: the
transfer params' per-group block ids, the per-group load plan with null blocks, and a real pull
between two sessions that copies each group's blocks for that group's layers only."""

from __future__ import annotations

from typing import Any

import pytest
from helpers import wait_until

from mooncake_connectors.errors import ConfigError, ProtocolError
from mooncake_connectors.pd import params as pdp
from mooncake_connectors.pd.layout import check_compatible
from mooncake_connectors.pd.params import PullParams, prompt_hash
from mooncake_connectors.pd.plan import (
    RecvSpec,
    StepPlan,
    handover,
    loadable_tokens,
    recv_spec_groups,
)
from mooncake_connectors.pd.session import TransferSession

from .test_session import BS, NUM_BLOCKS, PROMPT, Recorded, Settings, _kv

torch = pytest.importorskip("torch", reason="torch is not installed")

LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
GROUPS = [[LAYERS[0]], [LAYERS[1]]]  # a sliding-window group, a full-attention group
KINDS = ["sliding:32", "full"]
CHANNELS = ["tcp://h:1"]


def hybrid_params(swa: list[int], full: list[int], side_channel: str = CHANNELS[0]) -> PullParams:
    return PullParams(
        "eng-p",
        "p-1",
        100,
        prompt_hash(PROMPT),
        (side_channel,),
        1,
        1e12,
        group_block_ids=(tuple(swa), tuple(full)),
    )


def test_one_group_keeps_the_old_params_several_drop_remote_block_ids() -> None:
    one = pdp.encode(handover("p", "r", PROMPT, 100, [list(range(9))], CHANNELS, BS, 30.0))
    assert one["remote_block_ids"] == list(range(7)) and "remote_group_block_ids" not in one
    two = pdp.encode(
        handover(
            "p", "r", PROMPT, 100, [[0, 0, 0, 3, 4, 5, 6], list(range(10, 17))], CHANNELS, BS, 30
        )
    )
    assert "remote_block_ids" not in two  # a decode that knows one group refuses these params
    assert two["remote_group_block_ids"] == [[0, 0, 0, 3, 4, 5, 6], list(range(10, 17))]
    back = pdp.decode(two, PullParams)
    assert back.groups() == ((0, 0, 0, 3, 4, 5, 6), tuple(range(10, 17)))
    for bad in ({}, {"remote_block_ids": [1], "remote_group_block_ids": [[1], [2]]}):
        with pytest.raises(ProtocolError, match="exactly one"):
            pdp.decode(
                {k: v for k, v in two.items() if k != "remote_group_block_ids"} | bad, PullParams
            )


def test_group_counts_must_match_to_load() -> None:
    remote = hybrid_params([0, 0, 0, 3, 4, 5, 6], list(range(10, 17)))
    assert loadable_tokens("d", PROMPT, remote, BS, num_groups=2) == 100
    assert loadable_tokens("d", PROMPT, remote, BS, num_groups=1) == 0  # hybrid on one side
    short = hybrid_params([0, 0, 3], list(range(10, 17)))
    assert loadable_tokens("d", PROMPT, short, BS, num_groups=2) == 0  # a group too short


def test_null_blocks_are_not_read_and_a_block_freed_by_the_prefill_fails_the_load() -> None:
    remote = hybrid_params([0, 0, 0, 3, 4, 5, 6], list(range(10, 17)))
    swa, full = [0, 0, 0, 0, 44, 45, 46, 47], list(range(50, 58))  # decode: 4 nulls, 8 blocks
    spec = recv_spec_groups("d", remote, 100, 100, [swa, full], BS)
    assert spec.error is None
    assert spec.groups == [([44, 45, 46], [4, 5, 6]), (list(range(50, 57)), list(range(10, 17)))]
    assert spec.local_block_ids == [44, 45, 46, *range(50, 57)]
    # A local prefix hit of 2 blocks: only blocks 2.. are read.
    hit = recv_spec_groups("d", remote, 100, 100 - 2 * BS, [swa, full], BS)
    assert hit.groups == [([44, 45, 46], [4, 5, 6]), (list(range(52, 57)), list(range(12, 17)))]
    # The decode needs block 2 of the sliding-window group, which the prefill already freed.
    fewer_nulls = [0, 0, 42, 43, 44, 45, 46]
    bad = recv_spec_groups("d", remote, 100, 100, [fewer_nulls, full], BS)
    assert bad.groups is None and bad.error is not None and "group 0: block 2" in bad.error
    assert set(bad.local_block_ids) >= {42, 43, 44, 45, 46}  # all reported as failed


def hybrid_session(engine_id: str, groups: Any = GROUPS) -> TransferSession:
    return TransferSession(
        Settings(transfer_timeout=5),
        engine_id,
        block_size=BS,
        tp_size=1,
        num_blocks=NUM_BLOCKS,
        num_kv_heads=2,
        stats=Recorded(),
        groups=groups,
        group_kinds=None if groups is None else KINDS,
    )


def test_a_pull_copies_each_groups_blocks_for_its_layers_only() -> None:
    prefill, dec = hybrid_session("eng-p"), hybrid_session("eng-d")
    src, dst = _kv(True), _kv(False)
    try:
        prefill.register(src, 0)
        dec.register(dst, 0)
        assert prefill.side_channel is not None
        remote = hybrid_params([0, 0, 0, 0, 4, 5, 6], list(range(10, 17)), prefill.side_channel)
        spec = recv_spec_groups(
            "d-1", remote, 100, 100, [[0, 0, 0, 0, 44, 45, 46], list(range(50, 57))], BS
        )
        dec.start_load_kv(StepPlan(recv=[spec]))
        wait_until(lambda: "d-1" in dec._recv_done, 20, "the load to finish")
        assert dec.take_load_errors() == set()
        swa, full = (dst[n] for n in LAYERS)
        assert torch.equal(swa[44:47], src[LAYERS[0]][4:7])
        assert torch.equal(full[50:57], src[LAYERS[1]][10:17])
        # nothing else written: not the other group's blocks, not the null block
        assert not swa[50:57].any() and not full[44:47].any() and not swa[0].any()
    finally:
        prefill.shutdown()
        dec.shutdown()


def test_a_single_group_prefill_is_refused_by_a_hybrid_decode() -> None:
    prefill, dec = hybrid_session("eng-p", groups=None), hybrid_session("eng-d")
    try:
        prefill.register(_kv(True), 0)
        dec.register(_kv(False), 0)
        assert prefill.layout is not None and dec.layout is not None
        with pytest.raises(ConfigError, match="KV cache groups differ"):
            check_compatible(dec.layout, prefill.layout)
        assert prefill.side_channel is not None
        remote = hybrid_params([4, 5, 6, 7, 8, 9, 10], list(range(10, 17)), prefill.side_channel)
        spec = RecvSpec("d-1", [44, 50], [], remote, groups=[([44], [4]), ([50], [10])])
        dec.start_load_kv(StepPlan(recv=[spec]))
        wait_until(lambda: "d-1" in dec._recv_done, 20, "the load to end")
        assert dec.take_load_errors() == {44, 50}  # recomputed, nothing read
    finally:
        prefill.shutdown()
        dec.shutdown()


# -- several groups with different TP sizes (vLLM's CPU layout: heads outermost in a block) ------


def tp_session(engine_id: str, tp: int, heads: int) -> TransferSession:
    return TransferSession(
        Settings(transfer_timeout=5),
        engine_id,
        block_size=BS,
        tp_size=tp,
        num_blocks=NUM_BLOCKS,
        num_kv_heads=heads,
        stats=Recorded(),
        groups=GROUPS,
        group_kinds=KINDS,
    )


def heads_kv(heads: int, seed: int | None) -> dict[str, Any]:
    """One rank's KV: ``heads`` KV heads of 64 per block; zeros when ``seed`` is None."""
    shape = (NUM_BLOCKS, heads, BS, 2 * 64)
    gen = torch.Generator().manual_seed(seed or 0)
    return {
        n: torch.randn(shape, generator=gen).to(torch.bfloat16)
        if seed is not None
        else torch.zeros(shape, dtype=torch.bfloat16)
        for n in LAYERS
    }


SWA_P, FULL_P = [0, 0, 0, 0, 4, 5, 6], list(range(10, 17))  # the prefill's blocks
SWA_D, FULL_D = [0, 0, 0, 0, 44, 45, 46], list(range(50, 57))  # the decode's


def pull_groups(decoders: list[TransferSession], prefills: list[TransferSession]) -> None:
    channels = tuple(p.side_channel for p in prefills)
    assert all(channels)
    remote = PullParams(
        "eng-p",
        "p-1",
        100,
        prompt_hash(PROMPT),
        channels,  # type: ignore[arg-type]
        len(prefills),
        1e12,
        group_block_ids=(tuple(SWA_P), tuple(FULL_P)),
    )
    for dec in decoders:
        spec = recv_spec_groups("d-1", remote, 100, 100, [SWA_D, FULL_D], BS)
        dec.start_load_kv(StepPlan(recv=[spec]))
        wait_until(lambda d=dec: "d-1" in d._recv_done, 20, "the load to finish")
        assert dec.take_load_errors() == set()


def check_groups(dst: dict[str, Any], src_heads: Any) -> None:
    """``dst``'s blocks of each group hold ``src_heads(layer, prefill block)`` (its heads), and
    nothing else of ``dst`` was written."""
    swa, full = (dst[n] for n in LAYERS)
    for lb, rb in zip(SWA_D[4:], SWA_P[4:], strict=True):
        assert torch.equal(swa[lb], src_heads(LAYERS[0], rb))
    for lb, rb in zip(FULL_D, FULL_P, strict=True):
        assert torch.equal(full[lb], src_heads(LAYERS[1], rb))
    assert not swa[50:57].any() and not full[44:47].any() and not swa[0].any()


def test_groups_with_prefill_tp_2_and_decode_tp_1_gather_each_groups_heads() -> None:
    prefills = [tp_session("eng-p", 2, 1) for _ in range(2)]
    dec = tp_session("eng-d", 1, 2)
    src = [heads_kv(1, 10 + r) for r in range(2)]
    dst = heads_kv(2, None)
    try:
        for rank, (p, kv) in enumerate(zip(prefills, src, strict=True)):
            p.register(kv, rank)
        dec.register(dst, 0)
        assert dec.layout is not None and all(p.layout is not None for p in prefills)
        for p in prefills:
            check_compatible(dec.layout, p.layout)  # type: ignore[arg-type]
            p.start_load_kv(StepPlan(send={"p-1": 30.0}))  # held for the decode
        pull_groups([dec], prefills)
        check_groups(dst, lambda n, b: torch.cat([src[0][n][b], src[1][n][b]]))
        for p in prefills:  # each prefill rank was told Done by the one decode rank
            wait_until(lambda p=p: p.get_finished()[0] == {"p-1"}, 10, "the blocks to be freed")
    finally:
        for s in (*prefills, dec):
            s.shutdown()


def test_groups_with_prefill_tp_1_and_decode_tp_2_read_each_ranks_heads() -> None:
    prefill = tp_session("eng-p", 1, 2)
    decoders = [tp_session("eng-d", 2, 1) for _ in range(2)]
    src = heads_kv(2, 30)
    dst = [heads_kv(1, None) for _ in range(2)]
    try:
        prefill.register(src, 0)
        for rank, (d, kv) in enumerate(zip(decoders, dst, strict=True)):
            d.register(kv, rank)
        prefill.start_load_kv(StepPlan(send={"p-1": 30.0}))  # held for the decode
        pull_groups(decoders[:1], [prefill])
        # the first rank's Done has arrived; the second rank has not read yet
        wait_until(lambda: 0 in prefill._done.get("p-1", (0, 0, set()))[2], 10, "rank 0's Done")
        assert prefill.get_finished() == (None, None)
        pull_groups(decoders[1:], [prefill])
        wait_until(lambda: prefill.get_finished()[0] == {"p-1"}, 10, "the blocks to be freed")
        for rank in range(2):
            check_groups(dst[rank], lambda n, b, r=rank: src[n][b][r : r + 1])
    finally:
        for s in (prefill, *decoders):
            s.shutdown()
