"""The proxy's client connections to engines let go of idle connections before the engine does.

The server here plays an engine that closes an idle keep-alive connection just as the client
sends on it: it answers the first request on each connection and closes the connection, with no
answer, on a request that comes after the connection sat idle. A client that reuses that
connection loses its request (aiohttp's default keeps idle connections 15 s, vLLM's server 5 s);
``upstream_connector`` opens a fresh one instead.
"""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import ClientSession, ClientTimeout, ServerDisconnectedError, TCPConnector

from mooncake_connectors.conductor.upstream import KEEPALIVE, upstream_connector

RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: text/plain\r\n\r\nok"


async def _engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answer a connection's first request; on its next one (it sat idle: the engine is closing
    it at that moment) close without an answer. Every read has a deadline."""
    try:
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        writer.write(RESPONSE)
        await writer.drain()
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError):
        pass
    finally:
        writer.close()


async def _two_requests(connector: TCPConnector, idle: float) -> list[str]:
    server = await asyncio.start_server(_engine, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    got: list[str] = []
    try:
        async with ClientSession(connector=connector, timeout=ClientTimeout(total=5)) as s:
            for i in range(2):
                if i:
                    await asyncio.sleep(idle)
                # POST, as completions are: aiohttp retries only idempotent methods itself
                async with s.post(f"http://127.0.0.1:{port}/v1/completions", json={}) as r:
                    got.append(await r.text())
    finally:
        server.close()
        await server.wait_closed()
    return got


def test_a_connection_idle_past_the_keepalive_is_not_reused() -> None:
    async def run() -> list[str]:
        return await _two_requests(upstream_connector(keepalive=0.2), idle=0.5)

    assert asyncio.run(run()) == ["ok", "ok"]


def test_without_it_the_second_request_is_lost() -> None:
    # what the proxy and the calibration did before: aiohttp's default keep-alive (15 s)
    async def run() -> list[str]:
        return await _two_requests(TCPConnector(), idle=0.5)

    with pytest.raises(ServerDisconnectedError):
        asyncio.run(run())


def test_the_default_lets_go_before_vllms_server_does() -> None:
    assert KEEPALIVE < 5  # vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE default, seconds
