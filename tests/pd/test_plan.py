"""The scheduler side's block arithmetic, from plain token and block ids (no engine)."""

from __future__ import annotations

import time

import pytest

from mooncake_connectors.kv_keys import KeyInputs, MultiModalInput
from mooncake_connectors.pd.params import PullParams, PushParams, prompt_hash
from mooncake_connectors.pd.plan import (
    PushProgress,
    handover,
    loadable_tokens,
    push_recv_spec,
    recv_spec,
)

BS = 16
PROMPT = list(range(100, 200))  # 100 tokens: 7 blocks of 16
REMOTE = PullParams(
    "p", "r", 100, prompt_hash(PROMPT), ("tcp://h:1",), 1, 1e12, tuple(range(20, 27))
)
PUSH = PushParams("id", "p", ("tcp://h:1",), 1)


def test_only_kv_of_exactly_this_prompt_is_loadable() -> None:
    assert loadable_tokens("d", PROMPT, REMOTE, BS) == 100
    assert loadable_tokens("d", PROMPT[:99], REMOTE, BS) == 0  # more tokens than the prompt
    assert loadable_tokens("d", [1, *PROMPT[1:]], REMOTE, BS) == 0  # other tokens
    short = PullParams("p", "r", 100, prompt_hash(PROMPT), ("tcp://h:1",), 1, 1e12, (20,))
    assert loadable_tokens("d", PROMPT, short, BS) == 0  # too few blocks for its tokens
    assert loadable_tokens("d", None, REMOTE, BS) == 0


def test_a_load_skips_the_blocks_the_local_prefix_cache_holds() -> None:
    local = list(range(50, 57))
    full = recv_spec("d", REMOTE, 100, 100, local, BS)
    assert (full.local_block_ids, full.remote_block_ids, full.error) == (
        local,
        list(REMOTE.block_ids),
        None,
    )
    rest = recv_spec("d", REMOTE, 100, 100 - 4 * BS, local, BS)
    assert rest.local_block_ids == [54, 55, 56] and rest.remote_block_ids == [24, 25, 26]
    release = recv_spec("d", REMOTE, 100, 0, [], BS)
    assert release.local_block_ids == [] and release.remote is REMOTE


def test_an_unexpected_allocation_fails_the_whole_load_safely() -> None:
    odd = recv_spec("d", REMOTE, 100, 100 - 5, list(range(50, 57)), BS)  # hit not block-aligned
    assert odd.error and odd.local_block_ids == list(range(50, 57)) and odd.remote_block_ids == []
    few = recv_spec("d", REMOTE, 100, 100, [50, 51], BS)  # fewer blocks than the tokens need
    assert few.error and few.local_block_ids == [50, 51]


def test_a_push_target_names_the_prompt_and_its_first_block() -> None:
    spec = push_recv_spec("d", PUSH, PROMPT, 100, 100 - BS, list(range(50, 57)), BS)
    assert spec.first_block == 1 and spec.local_block_ids == list(range(51, 57))
    assert spec.num_tokens == 100 and spec.prompt_hash == prompt_hash(PROMPT) and not spec.error
    none = push_recv_spec("d", PUSH, PROMPT, 0, 0, [], BS)
    assert none.local_block_ids == [] and none.remote is PUSH


def test_push_progress_announces_each_newly_complete_block_once() -> None:
    prog = PushProgress(BS)
    prog.start("r", "id", PROMPT)
    assert "r" in prog and prog
    prog.advance("r", [1, 2, 3], True, 0, 48)  # 48 tokens: 3 blocks complete
    prog.advance("r", None, False, 48, 10)  # 58: still 3
    prog.advance("r", [4, 5, 6, 7], False, 58, 42)  # 100: the prompt is done (7 blocks)
    steps = prog.take()
    assert [(s.ready, s.final) for s in steps] == [(3, False), (7, True)]
    assert steps[-1].block_ids == [1, 2, 3, 4, 5, 6, 7] and steps[0].block_ids == [1, 2, 3]
    assert "r" not in prog and prog.take() == []


def test_a_push_whose_request_ends_early_is_announced_aborted() -> None:
    prog = PushProgress(BS)
    prog.start("r", "id", PROMPT)
    prog.advance("r", [1, 2], True, 0, 32)
    prog.end("r")
    prog.end("other")  # not pushing: nothing
    (first, last) = prog.take()
    assert first.ready == 2 and not first.final
    assert last.final and last.aborted and last.push_id == "id"


def test_handover_names_the_blocks_of_the_computed_tokens() -> None:
    before = time.time()
    out = handover("p", "r", PROMPT, 40, [list(range(9))], ["tcp://h:1", "tcp://h:2"], BS, 30.0)
    assert out.block_ids == (0, 1, 2) and out.num_tokens == 40 and out.tp_size == 2
    assert out.prompt_hash == prompt_hash(PROMPT[:40])
    assert before + 30.0 <= out.expires_at <= time.time() + 30.0


SALT_A, SALT_B = KeyInputs(cache_salt="tenant-a"), KeyInputs(cache_salt="tenant-b")
IMAGE = MultiModalInput("img-1", 20, 30)


@pytest.mark.parametrize(
    ("prefill", "decode"),
    [
        (SALT_A, SALT_B),  # another tenant's salt
        (SALT_A, KeyInputs()),  # a salted prompt's KV for an unsalted request
        (KeyInputs(lora_name="a", lora_path="/l/a"), KeyInputs(lora_name="b", lora_path="/l/b")),
        (KeyInputs(lora_name="a", lora_path="/l/a"), KeyInputs()),  # adapter vs base model
        (KeyInputs(lora_name="a", lora_path="/old"), KeyInputs(lora_name="a", lora_path="/new")),
        # two images behind the same placeholder token ids
        (KeyInputs(multimodal=(IMAGE,)), KeyInputs(multimodal=(MultiModalInput("img-2", 20, 30),))),
        (KeyInputs(multimodal=(IMAGE,)), KeyInputs(multimodal=(MultiModalInput("img-1", 21, 30),))),
    ],
)
def test_kv_of_other_inputs_behind_the_same_tokens_is_not_loadable(
    prefill: KeyInputs, decode: KeyInputs
) -> None:
    out = handover("p", "r", PROMPT, 100, [list(range(7))], ["tcp://h:1"], BS, 30.0, prefill)
    assert loadable_tokens("d", PROMPT, out, BS, 1, decode) == 0
    assert loadable_tokens("d", PROMPT, out, BS, 1, prefill) == 100  # its own inputs: loadable


def test_plain_prompts_hash_as_before_and_only_inputs_inside_the_tokens_count() -> None:
    # a plain text prompt's hash is its ids' alone, as older prefills computed it
    assert handover("p", "r", PROMPT, 40, [[1, 2, 3]], ["c"], BS, 1.0).prompt_hash == (
        prompt_hash(PROMPT[:40])
    )
    # an image placed after the handed-over tokens does not change their KV
    late = KeyInputs(multimodal=(MultiModalInput("img-9", 60, 10),))
    out = handover("p", "r", PROMPT, 40, [[1, 2, 3]], ["c"], BS, 1.0, late)
    assert out.prompt_hash == prompt_hash(PROMPT[:40])
    assert handover("p", "r", PROMPT, 40, [[1, 2, 3]], ["c"], BS, 1.0, SALT_A).prompt_hash != (
        prompt_hash(PROMPT[:40])
    )


def test_a_push_names_the_inputs_on_both_sides() -> None:
    prog = PushProgress(BS)
    prog.start("r", "id", PROMPT, SALT_A)
    prog.advance("r", list(range(7)), True, 0, 100)
    (step,) = prog.take()
    same = push_recv_spec("d", PUSH, PROMPT, 100, 100, list(range(7)), BS, SALT_A)
    other = push_recv_spec("d", PUSH, PROMPT, 100, 100, list(range(7)), BS, SALT_B)
    assert step.prompt_hash == same.prompt_hash != other.prompt_hash
