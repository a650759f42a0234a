"""The PD proxy against stand-in prefill and decode servers.

The stand-ins are small aiohttp apps that record what reaches them and answer like vLLM's
OpenAI server does (the ``kv_transfer_params`` handshake). They replace only the engines, a
seam we do not own; the proxy runs unchanged. The real engines are in integration_tests/vllm_pd.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

aiohttp = pytest.importorskip("aiohttp", reason="the proxy extra is not installed")
from aiohttp import web  # noqa: E402
from fake_http import LoopbackApp  # noqa: E402

from mooncake_connectors.conductor.listener import GuardedListener  # noqa: E402
from mooncake_connectors.conductor.proxy import PDProxy  # noqa: E402


class Upstream(LoopbackApp):
    """A stand-in vLLM server: records request bodies, answers completions and streams."""

    def __init__(self, name: str, *, fail: bool = False) -> None:
        self.name = name
        self.fail = fail
        self.push_info = False  # answer prefill legs with the engine's side channels
        self.bare = False  # answer prefill legs without kv_transfer_params
        self.delay = 0.0  # seconds before answering
        self.bodies: list[dict[str, Any]] = []
        super().__init__()
        self.app.router.add_post("/v1/completions", self.handle)
        self.app.router.add_post("/v1/chat/completions", self.handle)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        await asyncio.sleep(self.delay)
        if self.fail:
            return web.json_response({"error": "boom"}, status=500)
        params = body.get("kv_transfer_params") or {}
        if params.get("do_remote_decode"):
            engine = {
                "remote_engine_id": f"engine-{self.name}",
                "remote_side_channels": [f"tcp://127.0.0.1:1{self.name[1:]}"],
                "remote_tp_size": 1,
            }
            answer = {"from": self.name} | (engine if self.push_info else {})
            if self.bare:
                return web.json_response({"choices": [{"text": "x"}]})
            return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": answer})
        if body.get("stream"):
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            for word in ("a", "b", "c"):
                chunk = {"choices": [{"text": word}], "by": self.name}
                await out.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await out.write(b"data: [DONE]\n\n")
            await out.write_eof()
            return out
        return web.json_response({"choices": [{"text": "decoded"}], "by": self.name, "got": params})


@contextlib.asynccontextmanager
async def cluster(
    push: bool = False, **listener: float
) -> AsyncIterator[tuple[list[Upstream], list[Upstream], str]]:
    prefill = [Upstream("p0"), Upstream("p1")]
    decode = [Upstream("d0"), Upstream("d1")]
    for u in (*prefill, *decode):
        u.push_info = push
        await u.start()
    proxy = PDProxy([u.url for u in prefill], [u.url for u in decode], timeout=10, push=push)
    server = GuardedListener(proxy.app, "127.0.0.1", 0, **listener)  # the proxy command's
    await server.start()
    try:
        yield prefill, decode, f"http://127.0.0.1:{server.port}"
    finally:
        await server.close()
        for u in (*prefill, *decode):
            await u.stop()


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_prefill_leg_then_decode_leg_round_robin() -> None:
    async def go() -> None:
        async with cluster() as (prefill, decode, url):
            async with aiohttp.ClientSession() as s:
                answers = []
                for i in range(4):
                    body = {"model": "m", "prompt": f"p{i}", "max_tokens": 50, "min_tokens": 9}
                    async with s.post(url + "/v1/completions", json=body) as r:
                        assert r.status == 200
                        answers.append(await r.json())
            # the prefill leg: one token, no stream, asks for the KV to be kept for decode
            for leg in prefill[0].bodies + prefill[1].bodies:
                assert leg["max_tokens"] == 1 and leg["stream"] is False
                assert "min_tokens" not in leg
                assert leg["kv_transfer_params"]["do_remote_decode"] is True
            # round-robin on both lists
            assert [len(u.bodies) for u in (*prefill, *decode)] == [2, 2, 2, 2]
            # the decode leg is the client's request plus the prefill's transfer params
            assert [a["got"] for a in answers] == [{"from": p} for p in ("p0", "p1", "p0", "p1")]
            assert decode[0].bodies[0]["max_tokens"] == 50
            assert decode[0].bodies[0]["min_tokens"] == 9

    run(go())


def test_chat_streaming_is_relayed_and_a_failed_prefill_falls_back() -> None:
    async def go() -> None:
        async with cluster() as (prefill, _decode, url):
            body = {
                "model": "m",
                "messages": [{"role": "user", "content": "hi"}],
                "max_completion_tokens": 8,
                "stream": True,
            }
            async with aiohttp.ClientSession() as s:
                async with s.post(url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200
                    text = (await r.read()).decode()
                assert [
                    json.loads(line[6:])["choices"][0]["text"]
                    for line in text.split("\n\n")
                    if line.startswith("data: {")
                ] == ["a", "b", "c"]
                assert text.rstrip().endswith("data: [DONE]")
                leg = prefill[0].bodies[0]
                assert leg["max_completion_tokens"] == 1 and leg["stream"] is False
                # a prefill that fails: decode computes the prompt itself, the client is served
                for p in prefill:
                    p.fail = True
                body2 = {"model": "m", "prompt": "q", "max_tokens": 4}
                async with s.post(url + "/v1/completions", json=body2) as r:
                    assert r.status == 200
                    out = await r.json()
                assert out["choices"][0]["text"] == "decoded" and out["got"] == {}
                async with s.post(url + "/v1/completions", data=b"{not json") as r:
                    assert r.status == 400

    run(go())


def test_proxy_needs_both_lists() -> None:
    with pytest.raises(ValueError, match="at least one prefill and one decode"):
        PDProxy([], ["http://127.0.0.1:1"])


def test_layerwise_push_runs_both_legs_at_once_after_learning_the_prefill() -> None:
    async def go() -> None:
        async with cluster(push=True) as (prefill, _decode, url):
            async with aiohttp.ClientSession() as s:
                answers = []
                for i in range(4):
                    body = {"model": "m", "prompt": f"p{i}", "max_tokens": 5}
                    async with s.post(url + "/v1/completions", json=body) as r:
                        assert r.status == 200
                        answers.append(await r.json())
            for _ in range(100):  # the prefill legs run beside the decode legs: let them land
                if all(len(p.bodies) == 2 for p in prefill):
                    break
                await asyncio.sleep(0.02)
            got = [a["got"] for a in answers]
            # the first request to each prefill is a pull: its answer says where the engine is
            assert got[0]["from"] == "p0" and got[1]["from"] == "p1"
            assert "push_id" not in got[0] and "push_id" not in got[1]
            for i, p in ((2, "p0"), (3, "p1")):
                ids = {got[i]["push_id"]}
                assert got[i]["do_remote_prefill"] is True
                assert got[i]["remote_engine_id"] == f"engine-{p}"
                assert got[i]["remote_side_channels"] == [f"tcp://127.0.0.1:1{p[1:]}"]
                leg = prefill[int(p[1])].bodies[-1]["kv_transfer_params"]
                assert leg["do_remote_decode"] is True and {leg["push_id"]} == ids
            assert got[2]["push_id"] != got[3]["push_id"]

    run(go())
