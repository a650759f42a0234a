"""The proxy's conductor path against stand-in vLLM instances.

The stand-ins replace only the engines (a seam we do not own): they answer the two PD legs,
``/tokenize`` (one token per character) and ``/metrics`` (load set by the test). The proxy, the
live conductor and the scheduler run unchanged. KV events come from a real ZMQ PUB socket bound
like vLLM binds an ``ipc://`` endpoint. Real engines: integration_tests/vllm_pd.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

aiohttp = pytest.importorskip("aiohttp", reason="the proxy extra is not installed")
from aiohttp import web  # noqa: E402
from fake_http import LoopbackApp  # noqa: E402

from mooncake_connectors.conductor.estimators import (  # noqa: E402
    DecodeModel,
    PrefillModel,
)
from mooncake_connectors.conductor.hashing import prefix_block_hashes  # noqa: E402
from mooncake_connectors.conductor.live import CacheSource  # noqa: E402
from mooncake_connectors.conductor.proxy import (  # noqa: E402
    ConductorOptions,
    PDProxy,
    build_conductor,
)
from mooncake_connectors.conductor.types import PlacementPolicy  # noqa: E402
from mooncake_connectors.errors import ConfigError  # noqa: E402

BS = 4
PREFILL = PrefillModel(0.0, 1e-3, 0.0)  # 1 ms per new token
DECODE = DecodeModel(0.01, 0.001, 0.0, 100_000)


class Instance(LoopbackApp):
    """A stand-in vLLM server: PD legs, /tokenize, /metrics."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.bodies: list[dict[str, Any]] = []
        self.tokenized: list[dict[str, Any]] = []
        self.running = 0
        self.waiting = 0
        super().__init__()
        self.app.router.add_post("/v1/completions", self.handle)
        self.app.router.add_post("/v1/chat/completions", self.handle)
        self.app.router.add_post("/tokenize", self.tokenize)
        self.app.router.add_get("/metrics", self.metrics)
        self.app.router.add_get("/v1/models", self.models)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
            return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": {}})
        usage = {"prompt_tokens": 1, "completion_tokens": 3}
        return web.json_response({"choices": [{"text": "abc"}], "by": self.name, "usage": usage})

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.tokenized.append(body)
        text = body.get("prompt")
        if text is None:
            text = "".join(f"{m['role']}:{m['content']}\n" for m in body["messages"])
        return web.json_response({"count": len(text), "tokens": [ord(c) for c in text]})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m", "max_model_len": 2048}]})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            text=(
                f'vllm:num_requests_running{{engine="0"}} {self.running}.0\n'
                f'vllm:num_requests_waiting{{engine="0"}} {self.waiting}.0\n'
                'vllm:kv_cache_usage_perc{engine="0"} 0.1\n'
                'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="100"} 1.0\n'
            )
        )


@contextlib.asynccontextmanager
async def cluster(
    tmp: Path, **opts: Any
) -> AsyncIterator[tuple[list[Instance], Instance, str, PDProxy, list[zmq.Socket[bytes]]]]:
    prefill = [Instance("p0"), Instance("p1")]
    decode = Instance("d0")
    for u in (*prefill, decode):
        await u.start()
    ctx = zmq.Context()
    pubs: list[zmq.Socket[bytes]] = []
    events: dict[str, str] = {}
    if opts.get("cache_source", CacheSource.EVENTS) is CacheSource.EVENTS:
        for i, p in enumerate(prefill):
            pub = ctx.socket(zmq.PUB)
            pub.bind(f"ipc://{tmp}/p{i}.sock")
            pubs.append(pub)
            events[p.url] = f"ipc://{tmp}/p{i}.sock"
    options = ConductorOptions(
        kv_events=events, block_size=BS, prefill_model=PREFILL, decode_model=DECODE, **opts
    )
    urls = [p.url for p in prefill]
    live, report = await build_conductor(urls, [decode.url], options)
    assert report is None  # nothing left to profile
    proxy = PDProxy(urls, [decode.url], timeout=10, live=live, kv_events=events,
                    metrics_interval=0.05)  # fmt: skip
    runner = web.AppRunner(proxy.app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield prefill, decode, f"http://127.0.0.1:{port}", proxy, pubs
    finally:
        await runner.cleanup()
        for pub in pubs:
            pub.close(0)
        ctx.term()
        for u in (*prefill, decode):
            await u.stop()


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 30))


async def until(pred: Any, what: str, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def stored_batch(tokens: list[int], seq_hashes: list[bytes]) -> bytes:
    ev = {
        "type": "BlockStored", "block_hashes": seq_hashes, "parent_block_hash": None,
        "token_ids": tokens, "block_size": BS, "lora_id": None, "medium": "GPU",
        "lora_name": None,
    }  # fmt: skip
    return msgspec.msgpack.encode([time.time(), [ev], 0])


def test_a_prefix_cached_on_the_second_instance_is_placed_there(tmp_path: Path) -> None:
    async def go() -> None:
        async with cluster(tmp_path) as (prefill, _decode, url, proxy, pubs):
            prefix = list(range(300, 324))  # six blocks
            n = len(prefix) // BS
            hashes = [bytes([i]) for i in range(n)]
            live = proxy.live
            assert live is not None
            # p1's engine reports the prefix (repeat until the subscription has reached the PUB)
            await until(
                lambda: (
                    pubs[1].send_multipart(
                        (b"t", (1).to_bytes(8, "big"), stored_batch(prefix, hashes))
                    )
                    or len(live.conductor.index.cache(prefill[1].url)) == n
                ),
                "the KV event",
            )
            async with aiohttp.ClientSession() as s:
                body = {"model": "m", "prompt": [*prefix, 1, 2, 3], "max_tokens": 3}
                async with s.post(url + "/v1/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    assert r.headers["x-conductor-prefill"] == prefill[1].url
                    assert r.headers["x-conductor-cached-blocks"] == str(n)
                    assert (await r.json())["by"] == "d0"
                async with s.get(url + "/conductor/decisions") as r:
                    (decision,) = await r.json()
                async with s.get(url + "/conductor/stats") as r:
                    stats = await r.json()
            assert decision["prefill"] == prefill[1].url and decision["cached_blocks"] == n
            # what really happened sits beside the estimate
            assert 0 < decision["prefill_leg_s"] <= decision["first_token_s"] < 30
            assert len(prefill[1].bodies) == 1 and not prefill[0].bodies
            assert not prefill[0].tokenized and not prefill[1].tokenized  # token ids as given
            assert stats["kv_events"][prefill[1].url]["batches"] >= 1
            assert stats["prefill"][prefill[1].url]["cached_blocks"] == n
            assert stats["in_flight"] == 0
            keys = prefix_block_hashes([*prefix, 1, 2, 3], BS)
            assert live.conductor.index.match(prefill[1].url, keys) == n

    run(go())


def test_text_and_chat_prompts_are_tokenized_by_an_instance(tmp_path: Path) -> None:
    async def go() -> None:
        async with cluster(tmp_path, cache_source=CacheSource.OPTIMISTIC) as (
            prefill, _decode, url, _proxy, _pubs,
        ):  # fmt: skip
            async with aiohttp.ClientSession() as s:
                text = "a shared system prompt. " * 4
                placed = []
                for suffix in ("q1", "q2"):
                    body = {"model": "m", "prompt": text + suffix, "max_tokens": 3}
                    async with s.post(url + "/v1/completions", json=body) as r:
                        assert r.status == 200
                        placed.append(r.headers["x-conductor-prefill"])
                        assert int(r.headers["x-conductor-cached-blocks"]) == (
                            0 if suffix == "q1" else len(text) // BS
                        )
                assert placed[0] == placed[1]  # the optimistic index remembered the first
                chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
                async with s.post(url + "/v1/chat/completions", json=chat) as r:
                    assert r.status == 200
                async with s.get(url + "/conductor/stats") as r:
                    stats = await r.json()
            tokenized = prefill[0].tokenized + prefill[1].tokenized
            assert len(tokenized) == 3 and stats["tokenize"]["calls"] == 3
            chat_req = next(t for t in tokenized if "messages" in t)
            assert chat_req["add_generation_prompt"] is True
            assert stats["cache_source"] == "optimistic"

    run(go())


def test_overload_is_answered_429_with_the_reason(tmp_path: Path) -> None:
    async def go() -> None:
        async with cluster(tmp_path, cache_source=CacheSource.OPTIMISTIC, ttft_slo_s=0.05) as (
            prefill, decode, url, _proxy, _pubs,
        ):  # fmt: skip
            async with aiohttp.ClientSession() as s:
                body = {"model": "m", "prompt": [5] * 200, "max_tokens": 3}  # est. 0.2 s
                async with s.post(url + "/v1/completions", json=body) as r:
                    assert r.status == 429
                    assert r.headers["x-conductor-reject-reason"] == "ttft_slo"
                    out = await r.json()
            err = out["error"]
            assert err["code"] == "ttft_slo" and err["type"] == "rate_limit_exceeded"
            assert "exceeds the 0.05s SLO" in err["message"]
            assert out["conductor"]["est_ttft_s"] > out["conductor"]["ttft_slo_s"]
            assert not prefill[0].bodies and not prefill[1].bodies and not decode.bodies

    run(go())


def test_load_from_metrics_steers_placement(tmp_path: Path) -> None:
    async def go() -> None:
        async with cluster(
            tmp_path, cache_source=CacheSource.OPTIMISTIC, placement=PlacementPolicy.LOAD_BALANCE
        ) as (prefill, _decode, url, proxy, _pubs):
            live = proxy.live
            assert live is not None
            async with aiohttp.ClientSession() as s:
                body = {"model": "m", "prompt": [5] * 40, "max_tokens": 3}
                async with s.post(url + "/v1/completions", json=body) as r:
                    assert r.status == 200  # teaches the proxy a typical prompt
                prefill[0].waiting = 6  # p0 is busy with work that bypassed the proxy
                await until(
                    lambda: (ld := live.loads.get(prefill[0].url)) is not None and ld.waiting == 6,
                    "the metrics poll",
                )
                for _ in range(2):
                    async with s.post(url + "/v1/completions", json=body) as r:
                        assert r.headers["x-conductor-prefill"] == prefill[1].url

    run(go())


def test_bad_configurations_are_refused() -> None:
    async def go() -> None:
        with pytest.raises(ConfigError, match="--kv-events"):
            await build_conductor(["http://a"], ["http://d"], ConductorOptions(block_size=BS,
                                  prefill_model=PREFILL, decode_model=DECODE))  # fmt: skip

    run(go())
    with pytest.raises(ConfigError, match="prefix fetches"):
        ConductorOptions(placement=PlacementPolicy.GLOBAL_CACHE)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--policy", "global-cache"], "prefix fetches"),
        (["--policy", "local-cache", "--kv-events", "no-equals-sign"], "PREFILL_URL=ENDPOINT"),
        (["--kv-events", "http://p=ipc:///tmp/x"], "needs a conductor policy"),
        (["--policy", "local-cache", "--prefill-model", "1,2"], "3 comma-separated"),
        (["--policy", "local-cache", "--admission", "sometimes"], "sometimes"),
    ],
)
def test_cli_refuses_bad_proxy_options(args: list[str], message: str) -> None:
    from typer.testing import CliRunner

    from mooncake_connectors.cli import app

    result = CliRunner().invoke(
        app, ["proxy", "--prefill", "http://p", "--decode", "http://d", *args]
    )
    assert result.exit_code != 0
    assert message in (result.output + repr(result.exception))


def test_calibration_reads_the_instances_and_fits_models() -> None:
    """Against stand-ins (answer times are noise here): the protocol and the fit run end to end."""
    from mooncake_connectors.conductor.calibrate import calibrate

    async def go() -> None:
        p, d = Instance("p0"), Instance("d0")
        await p.start()
        await d.start()
        try:
            cal = await calibrate([p.url], [d.url], lengths=(16, 32, 64), decode_tokens=4, batch=2)
            with pytest.raises(ConfigError, match="calibrating the instances failed"):
                await calibrate(["http://127.0.0.1:9"], [d.url], timeout=2)
        finally:
            await p.stop()
            await d.stop()
        assert cal.block_size == 16 and cal.decode.capacity_tokens == 1600
        assert cal.model == "m" and [n for n, _, _ in cal.samples] == [16, 32, 64]
        assert cal.prefill.time(64) >= 0 and cal.decode.base_s > 0
        # the profile prompts are random token ids from /tokenize, prefill legs are plain
        assert all(b["max_tokens"] == 1 for b in p.bodies[1:4])

    run(go())
