"""A stand-in HTTP server on 127.0.0.1 for the proxy tests (aiohttp; import after importorskip)."""

from __future__ import annotations

from aiohttp import web


class LoopbackApp:
    """``app`` served on an ephemeral loopback port; ``url`` is set by ``start``."""

    def __init__(self) -> None:
        self.app = web.Application()
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        self.runner = web.AppRunner(self.app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
