"""The store as the conductor's global cache index: a real master, stand-in engines.

The store runs for real (a master and a store server process, a client writing keys the way the
vLLM store connector names them); the engines are the stand-ins of test_proxy_conductor (a seam
we do not own). Real engines: integration_tests/vllm_pd/test_conductor_store.py.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator

import pytest

aiohttp = pytest.importorskip("aiohttp", reason="the proxy extra is not installed")
from aiohttp import web  # noqa: E402
from store_cluster import FAST, client, start_master, start_server, wait_servers  # noqa: E402
from test_proxy_conductor import BS, DECODE, PREFILL, Instance, run, until  # noqa: E402

from mooncake_connectors.adapters.keys import Shard  # noqa: E402
from mooncake_connectors.adapters.vllm.store_keys import BlockKeys, prompt_block_hashes  # noqa: E402
from mooncake_connectors.conductor.estimators import TransferModel  # noqa: E402
from mooncake_connectors.conductor.live import CacheSource  # noqa: E402
from mooncake_connectors.conductor.proxy import (  # noqa: E402
    ConductorOptions,
    PDProxy,
    build_conductor,
)
from mooncake_connectors.conductor.store_probe import StoreProbe, key_inputs_of  # noqa: E402
from mooncake_connectors.conductor.types import PlacementPolicy  # noqa: E402
from mooncake_connectors.errors import ConfigError  # noqa: E402
from mooncake_connectors.kv_keys import KeyInputs  # noqa: E402
from mooncake_connectors.store import StoreClient  # noqa: E402

TEMPLATE = "vllm/v2/m/bfloat16.b4.h2x8/tp0-1.pp0-1/{block}/model.layers.0.self_attn.attn"


@pytest.fixture(scope="module")
def store() -> Iterator[tuple[str, StoreClient]]:
    master, addr = start_master(*FAST)
    server = start_server(addr, "16M")
    c = client(addr)
    try:
        wait_servers(c, 1)
        yield addr, c
    finally:
        c.close()
        server.close()
        master.close()


def save(
    c: StoreClient, probe: StoreProbe, tokens: list[int], blocks: range, salt: str | None = None
) -> None:
    keys = probe.keys(tokens, KeyInputs(cache_salt=salt))
    for b in blocks:
        c.put(keys[b], b"kv" * 8)


def test_probe_keys_are_the_store_connectors() -> None:
    rng = random.Random(5)
    connector = BlockKeys("vllm", "m", "bfloat16.b4.h2x8", Shard(False))
    probe = StoreProbe("127.0.0.1:1", TEMPLATE, BS)
    try:
        for n in (0, 1, 4, 5, 17, 64):
            tokens = [rng.randrange(150_000) for _ in range(n)]
            for inputs in (KeyInputs(), KeyInputs(cache_salt="t")):
                hashes = prompt_block_hashes(tokens, BS, inputs)
                layer = ["model.layers.0.self_attn.attn"]
                assert probe.keys(tokens, inputs) == connector.keys(hashes, layer)
    finally:
        probe.close()


def test_a_template_without_the_key_version_is_refused() -> None:
    with pytest.raises(ConfigError, match="key version"):
        StoreProbe("127.0.0.1:1", TEMPLATE.replace("/v2/", "/"), BS)


def test_what_the_request_body_gives_the_keys() -> None:
    assert key_inputs_of({"prompt": "hi", "cache_salt": "t"}) == KeyInputs(cache_salt="t")
    assert key_inputs_of({"prompt": "hi", "cache_salt": ""}) == KeyInputs()
    text = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert key_inputs_of({"messages": text}) == KeyInputs()
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
    assert key_inputs_of({"messages": [{"role": "user", "content": [image]}]}) is None
    assert key_inputs_of({"prompt_embeds": "AAAA"}) is None


def test_the_probe_counts_a_salts_blocks_only(store: tuple[str, StoreClient]) -> None:
    addr, c = store
    probe = StoreProbe(addr, TEMPLATE.replace("vllm/", "salted/"), BS)
    try:
        tokens = list(range(3000, 3000 + 4 * BS + 1))
        save(c, probe, tokens, range(4), salt="a")
        assert probe.held_blocks(tokens, KeyInputs(cache_salt="a")) == 4
        assert probe.held_blocks(tokens, KeyInputs(cache_salt="b")) == 0
        assert probe.held_blocks(tokens) == 0
        assert probe.held_blocks(tokens, None) == 0  # keys unknown here: not asked
        assert probe.stats()["calls"] == 3
    finally:
        probe.close()


def test_the_probe_counts_leading_blocks_only(store: tuple[str, StoreClient]) -> None:
    addr, c = store
    probe = StoreProbe(addr, TEMPLATE, BS)
    try:
        tokens = list(range(1000, 1000 + 8 * BS + 1))  # eight loadable blocks
        assert probe.held_blocks(tokens) == 0
        save(c, probe, tokens, range(3))
        save(c, probe, tokens, range(4, 8))  # block 3 missing: the prefix stops there
        assert probe.held_blocks(tokens) == 3
        save(c, probe, tokens, range(3, 4))
        assert probe.held_blocks(tokens) == 8
        assert probe.held_blocks(tokens[:2]) == 0  # no full block before the last token
        assert probe.stats()["errors"] == 0
    finally:
        probe.close()


def test_an_unreachable_master_counts_as_nothing_held() -> None:
    from helpers import free_port

    probe = StoreProbe(f"127.0.0.1:{free_port()}", TEMPLATE, BS, timeout=0.3)
    try:
        assert probe.held_blocks(list(range(40))) == 0
        assert probe.stats()["errors"] == 1 and probe.stats()["last_error"]
    finally:
        probe.close()


@pytest.mark.parametrize("policy", [PlacementPolicy.GLOBAL_CACHE, PlacementPolicy.ADAPTIVE])
def test_a_prefix_in_the_store_is_loaded_where_the_queue_is_short(
    store: tuple[str, StoreClient], policy: PlacementPolicy
) -> None:
    addr, c = store

    async def go() -> None:
        prefill = [Instance("p0"), Instance("p1")]
        decode = Instance("d0")
        for u in (*prefill, decode):
            await u.start()
        urls = [p.url for p in prefill]
        options = ConductorOptions(
            placement=policy,
            cache_source=CacheSource.OPTIMISTIC, block_size=BS, prefill_model=PREFILL,
            decode_model=DECODE, store_master=addr, store_keys=TEMPLATE,
            store_load=TransferModel(10_000.0, 1, 0.001),  # 0.1 ms per token
            metrics_interval_s=0.05,
        )  # fmt: skip
        live, report = await build_conductor(urls, [decode.url], options)
        assert report is None and live.store is not None
        proxy = PDProxy(urls, [decode.url], timeout=10, live=live, metrics_interval=0.05)
        runner = web.AppRunner(proxy.app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        try:
            start = 2000 if policy is PlacementPolicy.GLOBAL_CACHE else 5000  # a prompt each
            prompt = list(range(start, start + 100 * BS + 1))
            save(c, live.store, prompt, range(100))  # another instance computed it earlier
            async with aiohttp.ClientSession() as s:
                warm = {"model": "m", "prompt": [7] * 400, "max_tokens": 1}
                async with s.post(url + "/v1/completions", json=warm) as r:
                    assert r.status == 200  # teaches the proxy a typical prompt
                prefill[0].waiting = prefill[1].waiting = 0
                busy = prefill[0] if r.headers["x-conductor-prefill"] == urls[0] else prefill[1]
                busy.waiting = 5  # work that bypassed the proxy
                await until(
                    lambda: (ld := live.loads.get(busy.url)) is not None and ld.waiting == 5,
                    "the metrics poll",
                )
                body = {"model": "m", "prompt": prompt, "max_tokens": 3}
                async with s.post(url + "/v1/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    assert r.headers["x-conductor-prefill"] != busy.url
                    assert r.headers["x-conductor-load-blocks"] == "100"
                    # 400 tokens loaded (0.041 s) and 1 computed, not 401 computed (0.401 s)
                    assert float(r.headers["x-conductor-est-ttft-ms"]) < 100
                async with s.get(url + "/conductor/decisions") as r:
                    decision = (await r.json())[-1]
                async with s.get(url + "/conductor/stats") as r:
                    stats = await r.json()
                # the same prompt for another tenant: the store holds none of its keys
                async with s.post(url + "/v1/completions", json=body | {"cache_salt": "t"}) as r:
                    assert r.status == 200, await r.text()
                    assert r.headers["x-conductor-load-blocks"] == "0"
                async with s.get(url + "/conductor/decisions") as r:
                    assert (await r.json())[-1]["store_blocks"] == 0
            assert decision["store_blocks"] == 100 and decision["load_blocks"] == 100
            assert stats["store"]["calls"] >= 2 and stats["store"]["errors"] == 0
            assert stats["store_load"]["latency_s"] == 0.001
        finally:
            await runner.cleanup()
            for u in (*prefill, decode):
                await u.stop()

    run(go())


def test_store_placements_without_the_store_are_refused() -> None:
    for policy in (PlacementPolicy.GLOBAL_CACHE, PlacementPolicy.ADAPTIVE):
        with pytest.raises(ConfigError, match="MultiConnector over MooncakeConnectorsPD"):
            ConductorOptions(placement=policy)
    with pytest.raises(ConfigError, match="both its master and its key template"):
        ConductorOptions(store_master="127.0.0.1:1")
    with pytest.raises(ConfigError, match="exactly once"):
        StoreProbe("127.0.0.1:1", "vllm/no-field", BS)


def test_store_load_calibration_refuses_a_single_instance() -> None:
    from mooncake_connectors.conductor.calibrate import calibrate_store_load

    probe = StoreProbe("127.0.0.1:1", TEMPLATE, BS)
    try:
        with pytest.raises(ConfigError, match="two prefill instances"):
            asyncio.run(calibrate_store_load(["http://127.0.0.1:1"], probe, PREFILL))
    finally:
        probe.close()


class SavingInstance(Instance):
    """A stand-in engine whose store connector saves every prompt it computes (as the vLLM store
    connector does when a request finishes) and, with ``loads``, counts store hits."""

    def __init__(self, name: str, c: StoreClient, probe: StoreProbe, loads: bool) -> None:
        super().__init__(name)
        self.client, self.probe, self.loads, self.hits = c, probe, loads, 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = body.get("prompt")
        if isinstance(prompt, list):
            keys = self.probe.keys(prompt)
            present = await asyncio.to_thread(self.client.batch_exists, keys) if keys else []
            if self.loads and present and present[0]:
                self.hits += len(keys) * BS
            for k, p in zip(keys, present, strict=True):
                if not p:
                    await asyncio.to_thread(self.client.put, k, b"kv")
        return await super().handle(request)

    async def metrics(self, request: web.Request) -> web.Response:
        base = await super().metrics(request)
        extra = f'vllm:external_prefix_cache_hits_total{{engine="0"}} {self.hits}.0\n'
        return web.Response(text=base.text + extra)  # type: ignore[operator]


@pytest.mark.parametrize("loads", [True, False])
def test_store_load_calibration_needs_instances_that_load(
    store: tuple[str, StoreClient], loads: bool
) -> None:
    """An instance that does not load from the store (no store connector) refuses the start."""
    from mooncake_connectors.conductor.calibrate import calibrate_store_load

    addr, c = store

    async def go() -> None:
        probe = StoreProbe(addr, TEMPLATE.replace("vllm/", f"cal{int(loads)}/"), BS)
        engines = [SavingInstance(f"p{i}", c, probe, loads) for i in range(2)]
        for e in engines:
            await e.start()
        try:
            urls = [e.url for e in engines]
            if loads:
                model, report = await calibrate_store_load(urls, probe, PREFILL, lengths=(64, 256))
                assert model.kv_bytes_per_token == 1 and model.bandwidth_bytes_per_s > 0
                assert [s[0] for s in report["samples"]] == [63 // BS * BS, 255 // BS * BS]
            else:
                with pytest.raises(ConfigError, match="did not load a prefix the store holds"):
                    await calibrate_store_load(urls, probe, PREFILL, lengths=(64, 256))
        finally:
            probe.close()
            for e in engines:
                await e.stop()

    run(go())
