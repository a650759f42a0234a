"""The proxy's and the calibration's HTTP client connections to the engines they front.

aiohttp keeps an idle pooled connection for 15 s by default, and vLLM's API server (uvicorn)
closes one after 5 s (``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``). A request sent on a connection the server
is closing at that moment ends in ``ServerDisconnectedError`` with no answer: the calibration then
fails, and a user's request through the proxy is lost. Connections here are dropped by the client
after :data:`KEEPALIVE` seconds idle, before the server would, so a reused connection is never one
the engine is closing. An engine run with a shorter keep-alive than that needs ``keepalive``
lowered to match.
"""

from __future__ import annotations

import ssl as _ssl

from aiohttp import TCPConnector

KEEPALIVE = 4.0  # seconds: below vLLM's 5 s default keep-alive, so the client lets go first


def upstream_connector(
    ssl: _ssl.SSLContext | None = None, keepalive: float = KEEPALIVE
) -> TCPConnector:
    """A connector whose idle connections are closed after ``keepalive`` seconds (call it with
    an event loop running, as aiohttp requires)."""
    if ssl is None:
        return TCPConnector(keepalive_timeout=keepalive)
    return TCPConnector(ssl=ssl, keepalive_timeout=keepalive)
