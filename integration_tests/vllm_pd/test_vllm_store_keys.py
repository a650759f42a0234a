"""Store keys of vLLM's own Request objects: everything the KV depends on is in them.

Requests carry a LoRARequest, a cache_salt, multimodal features (MultiModalFeatureSpec with
PlaceholderRange, the identifier hashed from the image by vLLM's MultiModalHasher) and prompt
embeddings, as vLLM's engine core builds them. The salt is also checked end to end through
vLLM's Scheduler and a real store: blocks saved under one salt are no hit for another.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from store_cluster import in_process_store

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")

import numpy as np
import torch
from test_pd_scheduler import HASHER
from test_vllm_store_scheduler import KCC, make_scheduler, vllm_config
from vllm.lora.request import LoRARequest
from vllm.multimodal.hasher import MultiModalHasher
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request, RequestStatus

from mooncake_connectors.adapters.vllm import plugin
from mooncake_connectors.adapters.vllm.store_config import StoreConnectorConfig
from mooncake_connectors.adapters.vllm.store_inputs import key_inputs, key_token_ids
from mooncake_connectors.adapters.vllm.store_scheduler import block_keys
from mooncake_connectors.kv_keys import prompt_block_hashes
from mooncake_connectors.store import ClientConfig, StoreClient
from mooncake_connectors.store.server import StoreServer

pytestmark = pytest.mark.vllm

BS = 16
PROMPT = list(range(100, 200))  # 6 loadable blocks; an image's placeholder fills 40..59
IMAGE_AT, IMAGE_LEN = 40, 20  # blocks 2 and 3
ADAPTER_X = LoRARequest("x", 1, "/adapters/x")
_n = iter(range(1_000_000))


@pytest.fixture(scope="module", autouse=True)
def registered() -> None:
    plugin.register()


def image(seed: int) -> MultiModalFeatureSpec:
    pixels = np.random.default_rng(seed).integers(0, 255, (8, 8, 3), dtype=np.uint8)
    ident = MultiModalHasher.hash_kwargs("sha256", image=pixels)
    return MultiModalFeatureSpec(
        data=None,
        modality="image",
        identifier=ident,
        mm_position=PlaceholderRange(offset=IMAGE_AT, length=IMAGE_LEN),
        mm_hash=ident,
    )


def make(
    salt: str | None = None,
    lora: LoRARequest | None = None,
    images: tuple[int, ...] = (),
    prompt: list[int] | None = None,
    embeds: torch.Tensor | None = None,
) -> Request:
    sp = SamplingParams(max_tokens=1)
    return Request(
        f"r{next(_n)}", PROMPT if prompt is None and embeds is None else prompt, sp, None,
        prompt_embeds=embeds, mm_features=[image(s) for s in images] or None,
        lora_request=lora, cache_salt=salt, block_hasher=HASHER,
    )  # fmt: skip


def hashes(r: Request) -> list[str]:
    """The store connector's block hashes of ``r`` (the scheduler's derivation)."""
    return prompt_block_hashes(key_token_ids(r), BS, key_inputs(r, BS))


def differ_from(a: list[str], b: list[str], first: int) -> bool:
    return a[:first] == b[:first] and all(x != y for x, y in zip(a[first:], b[first:], strict=True))


def test_salts_differ_in_every_block() -> None:
    a, b = hashes(make("tenant-a")), hashes(make("tenant-b"))
    assert len(a) == 6 and differ_from(a, b, 0)
    assert differ_from(a, hashes(make()), 0)
    assert hashes(make("tenant-a")) == a


def test_lora_adapters_differ_in_every_block() -> None:
    x = hashes(make(lora=ADAPTER_X))
    assert differ_from(x, hashes(make()), 0)
    assert differ_from(x, hashes(make(lora=LoRARequest("y", 2, "/adapters/y"))), 0)
    # vLLM numbers adapters per server: another instance's id for the same adapter, same keys
    assert hashes(make(lora=LoRARequest("x", 7, "/adapters/x"))) == x


def test_images_name_their_blocks() -> None:
    cat = hashes(make(images=(1,)))
    assert hashes(make(images=(1,))) == cat  # the same image at the same place
    assert differ_from(cat, hashes(make(images=(2,))), IMAGE_AT // BS)
    assert differ_from(cat, hashes(make()), IMAGE_AT // BS)


def test_prompt_embeddings_name_their_blocks() -> None:
    e = torch.randn(len(PROMPT), 8, generator=torch.Generator().manual_seed(0))
    f = e.clone()
    f[70] += 1  # block 4
    a = hashes(make(embeds=e))
    assert len(a) == 6 and hashes(make(embeds=e.clone())) == a
    assert differ_from(a, hashes(make(embeds=f)), 4)
    assert differ_from(a, hashes(make(embeds=e.to(torch.bfloat16))), 0)


def reference() -> list[str]:
    return hashes(make("s", ADAPTER_X, (1,)))


def test_another_process_computes_the_same_keys() -> None:
    here = Path(__file__).parent
    path = [str(here), *sys.path]
    code = f"import sys; sys.path[:0] = {path!r}; import {Path(__file__).stem} as t; "
    code += "print(t.reference())"
    env = {**os.environ, "PYTHONHASHSEED": "random"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == str(reference())


@pytest.fixture
def store() -> Iterator[tuple[str, StoreServer]]:
    with in_process_store(64 << 20) as store:
        yield store


def test_a_salt_loads_only_its_own_blocks(tiny_model: Path, store) -> None:
    """Blocks saved under salt A: a request with salt B (or none) gets no external tokens."""
    keys, layers = block_keys(
        StoreConnectorConfig(master=store[0]), vllm_config(tiny_model, "kv_both", {}, True), KCC
    )
    with StoreClient(ClientConfig(master=store[0])) as c:
        for h in hashes(make("a")):
            for key in keys.keys([h], layers):
                c.put(key, bytes(BS * 2 * 2 * 64 * 2))
    s = make_scheduler(tiny_model, store[0])
    assert s.connector.scheduler.store.wait_connected(10)
    for salt, hit in (("b", 0), (None, 0), ("a", 6 * BS)):
        r = make(salt)
        assert s.connector.get_num_new_matched_tokens(r, 0) == (hit, hit > 0), salt
    r = make("a")
    s.add_request(r)
    s.schedule()
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
