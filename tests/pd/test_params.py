"""The kv_transfer_params schema: round trips through JSON, and malformed input as a typed error
that names what is wrong."""

from __future__ import annotations

import json
from typing import Any

import pytest

from mooncake_connectors.errors import MooncakeConnectorsError, ProtocolError
from mooncake_connectors.pd import params as pdp
from mooncake_connectors.pd.params import (
    PrefillEngine,
    PrefillLeg,
    PullParams,
    PushParams,
    decode,
    encode,
    prompt_hash,
)

PULL = PullParams(
    engine_id="prefill-0",
    request_id="r-1",
    block_ids=(4, 5, 6),
    num_tokens=40,
    prompt_hash=prompt_hash(range(40)),
    side_channels=("tcp://127.0.0.1:5000", "tcp://127.0.0.1:5001"),
    tp_size=2,
    expires_at=1.7e9,
)


def wire(params: pdp.Params) -> dict[str, Any]:
    """What the other side reads: the params after a JSON body round trip."""
    out: dict[str, Any] = json.loads(json.dumps(encode(params)))
    return out


def test_pull_params_keep_their_json_keys_and_round_trip() -> None:
    got = wire(PULL)
    assert got == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "prefill-0",
        "remote_request_id": "r-1",
        "remote_block_ids": [4, 5, 6],
        "remote_num_tokens": 40,
        "remote_prompt_hash": prompt_hash(range(40)),
        "remote_side_channels": ["tcp://127.0.0.1:5000", "tcp://127.0.0.1:5001"],
        "remote_tp_size": 2,
        "remote_expires_at": 1.7e9,
    }
    assert encode(PULL) == got  # lists, not tuples: equal before and after the wire
    assert decode(got, PullParams) == PULL


def test_a_pull_answer_names_the_prefill_engine_for_later_pushes() -> None:
    engine = decode(wire(PULL), PrefillEngine)
    assert engine == PrefillEngine("prefill-0", PULL.side_channels, 2)
    push = PushParams.to(engine, "push-7")
    assert wire(push) == {
        "do_remote_prefill": True,
        "push_id": "push-7",
        "remote_engine_id": "prefill-0",
        "remote_side_channels": list(PULL.side_channels),
        "remote_tp_size": 2,
    }
    assert decode(wire(push), PushParams) == push


def test_the_prefill_leg_says_remote_decode_and_carries_a_push_id_only_when_pushing() -> None:
    assert wire(PrefillLeg()) == {"do_remote_decode": True, "do_remote_prefill": False}
    leg = wire(PrefillLeg(push_id="p"))
    assert leg == {"do_remote_decode": True, "do_remote_prefill": False, "push_id": "p"}
    assert decode(leg, PrefillLeg) == PrefillLeg(push_id="p")
    assert decode({"do_remote_decode": True}, PrefillLeg) == PrefillLeg()


def test_unknown_keys_are_left_to_other_connectors() -> None:
    got = wire(PULL) | {"transfer_id": "theirs", "remote_bootstrap_addr": "http://x"}
    assert decode(got, PullParams) == PULL


def _pull(**over: Any) -> dict[str, Any]:
    return wire(PULL) | over


@pytest.mark.parametrize(
    "params, kind, match",
    [
        (None, PullParams, "must be an object, got NoneType"),
        ([1, 2], PullParams, "must be an object, got list"),
        (
            {k: v for k, v in _pull().items() if k != "remote_request_id"},
            PullParams,
            "missing required field `remote_request_id`",
        ),
        (
            _pull(remote_num_tokens="40"),
            PullParams,
            r"Expected `int`, got `str`.*remote_num_tokens",
        ),
        (_pull(remote_num_tokens=-1), PullParams, r">= 0.*remote_num_tokens"),
        (_pull(remote_block_ids=[1, -2]), PullParams, r"remote_block_ids\[1\]"),
        (_pull(remote_tp_size=0), PullParams, r">= 1.*remote_tp_size"),
        (_pull(remote_tp_size=3), PullParams, "2 side channels for tp_size 3"),
        (_pull(remote_side_channels=[]), PullParams, "remote_side_channels"),
        (_pull(remote_expires_at="soon"), PullParams, "remote_expires_at"),
        ({"remote_engine_id": "e", "remote_tp_size": 1}, PrefillEngine, "remote_side_channels"),
        (
            wire(PushParams.to(decode(wire(PULL), PrefillEngine), "x")) | {"push_id": "x" * 129},
            PushParams,
            "push_id",
        ),
        (
            wire(PushParams.to(decode(wire(PULL), PrefillEngine), "x")) | {"push_id": ""},
            PushParams,
            "push_id",
        ),
        ({"do_remote_decode": "yes"}, PrefillLeg, "do_remote_decode"),
        ({"do_remote_decode": True, "push_id": 5}, PrefillLeg, "push_id"),
    ],
)
def test_malformed_params_are_a_protocol_error_naming_the_key(
    params: Any, kind: type[Any], match: str
) -> None:
    before = json.dumps(params)
    with pytest.raises(ProtocolError, match=match) as info:
        decode(params, kind)
    assert isinstance(info.value, MooncakeConnectorsError)
    assert kind.__name__ in info.value.message
    assert json.dumps(params) == before  # the caller's object is left as it was


def test_flags_read_either_leg_and_release_marks_a_decode_request_used() -> None:
    params = wire(PushParams.to(PrefillEngine("e", ("tcp://h:1",), 1), "p"))
    assert pdp.wants_remote_prefill(params) and pdp.is_push(params)
    assert not pdp.wants_remote_decode(params)
    assert pdp.wants_remote_decode(wire(PrefillLeg())) and not pdp.is_push(wire(PrefillLeg()))
    for nothing in (None, {}):
        assert not (pdp.wants_remote_prefill(nothing) or pdp.is_push(nothing))
    pdp.release(params)
    assert not pdp.wants_remote_prefill(params)
    assert decode(params, PushParams).do_remote_prefill is False


def test_prompt_hash_tells_token_sequences_apart() -> None:
    assert prompt_hash([1, 2, 3]) == prompt_hash((1, 2, 3))
    assert prompt_hash([1, 2, 3]) != prompt_hash([1, 2, 4])
    assert prompt_hash([1, 2]) != prompt_hash([1, 2, 0])
    assert len(prompt_hash([])) == 32
