"""The PD connector loads a prefill's KV only for the same inputs: vLLM's own Request objects.

Two requests with the same token ids can need different KV: another tenant's ``cache_salt``,
another LoRA adapter, another image behind the same placeholder tokens. The prefill's
``remote_prompt_hash`` names those inputs, so a decode request that differs in any of them
computes its prompt instead of reading KV computed for the other one. The salt goes end to end
through vLLM's Scheduler on both sides; adapters and images through the connector's
``get_num_new_matched_tokens`` on Requests built as vLLM's engine core builds them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")

from test_pd_scheduler import ASYNC, HASHER, PROMPT, make_scheduler, remote_params, step
from test_vllm_store_keys import ADAPTER_X, image
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request

from mooncake_connectors.adapters.vllm import plugin
from mooncake_connectors.adapters.vllm.store_inputs import key_inputs
from mooncake_connectors.kv_keys import identity_digest
from mooncake_connectors.pd.params import prompt_hash

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module", autouse=True)
def registered() -> None:
    plugin.register()


def salted(rid: str, salt: str | None, params: Any) -> Request:
    sp = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params})
    return Request(rid, PROMPT, sp, None, cache_salt=salt, block_hasher=HASHER)


def test_a_salted_prefill_s_kv_is_loaded_only_under_the_same_salt(tiny_model: Path) -> None:
    prefill = make_scheduler(tiny_model, "kv_producer", {"kv_lease": 60})
    prefill.add_request(salted("p-1", "tenant-a", {"do_remote_decode": True}))
    _, finished = step(prefill, {"p-1": 5})
    params = finished["p-1"]
    assert params["remote_prompt_hash"] != prompt_hash(PROMPT)  # the salt is in it
    decode = make_scheduler(tiny_model, "kv_consumer", ASYNC)
    for rid, salt in (("d-b", "tenant-b"), ("d-0", None)):
        decode.add_request(salted(rid, salt, dict(params)))
        out, _ = step(decode, {rid: 1})
        assert out.num_scheduled_tokens == {rid: 100}, (salt, "must compute its own prompt")
    decode.add_request(salted("d-a", "tenant-a", dict(params)))
    out, _ = step(decode)
    assert out.num_scheduled_tokens == {}  # waiting for the prefill's KV: same salt, a hit
    assert [s.request_id for s in out.kv_connector_metadata.recv if s.local_block_ids] == ["d-a"]


_n = iter(range(1_000_000))


def built(lora: LoRARequest | None = None, images: tuple[int, ...] = ()) -> Request:
    params = {"kv_transfer_params": None}
    return Request(
        f"in-{next(_n)}", PROMPT, SamplingParams(max_tokens=1, extra_args=params), None,
        mm_features=[image(s) for s in images] or None, lora_request=lora,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("prefill", "other"),
    [
        (built(lora=ADAPTER_X), built(lora=LoRARequest("y", 2, "/adapters/y"))),
        (built(lora=ADAPTER_X), built()),  # the base model
        (built(images=(1,)), built(images=(2,))),  # same placeholder ids, another image
    ],
    ids=["other-adapter", "base-model", "other-image"],
)
def test_kv_of_another_adapter_or_image_is_not_loaded(
    tiny_model: Path, prefill: Request, other: Request
) -> None:
    s = make_scheduler(tiny_model, "kv_consumer", ASYNC)
    identity = identity_digest(key_inputs(prefill, 16), len(PROMPT))
    assert identity  # vLLM's request carries what the KV depends on
    params = remote_params(PROMPT, remote_prompt_hash=prompt_hash(PROMPT, identity))
    for r, expected in ((other, 0), (prefill, 100)):
        r.kv_transfer_params = dict(params)
        assert s.connector.get_num_new_matched_tokens(r, 0) == (expected, expected > 0)
