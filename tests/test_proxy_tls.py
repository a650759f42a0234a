"""The proxy's listener over TLS (``--tls-cert/--tls-key/--tls-ca``): with a CA, a client needs a
certificate the CA signed; a plaintext client gets an error, not a hang."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

aiohttp = pytest.importorskip("aiohttp", reason="the proxy extra is not installed")
from mooncake_connectors import certs  # noqa: E402
from mooncake_connectors.conductor.listener import GuardedListener  # noqa: E402
from mooncake_connectors.conductor.proxy import PDProxy  # noqa: E402
from mooncake_connectors.tls import TlsConfig, client_context  # noqa: E402


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    ours = certs.init(tmp_path_factory.mktemp("ours"), ("proxy", "client"))
    theirs = certs.init(tmp_path_factory.mktemp("theirs"), ("rogue",))
    yield {**ours, "rogue": theirs["rogue"], "rogue-key": theirs["rogue-key"]}


def node(pki: dict[str, Path], name: str | None) -> TlsConfig:
    if name is None:
        return TlsConfig(ca=str(pki["ca"]))
    return TlsConfig(str(pki[name]), str(pki[f"{name}-key"]), str(pki["ca"]))


async def health(pki: dict[str, Path], client: ssl.SSLContext | None, scheme: str) -> Any:
    proxy = PDProxy(["http://127.0.0.1:9"], ["http://127.0.0.1:9"], tls=node(pki, "proxy"))
    assert proxy.server_ssl is not None
    listener = GuardedListener(proxy.app, "127.0.0.1", 0, ssl_context=proxy.server_ssl)
    await listener.start()
    port = listener.port
    try:
        timeout = aiohttp.ClientTimeout(total=10)
        async with (
            aiohttp.ClientSession(timeout=timeout) as s,
            s.get(f"{scheme}://127.0.0.1:{port}/health", ssl=client or False) as r,
        ):
            return r.status
    finally:
        await listener.close()


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_a_client_with_a_ca_signed_certificate_is_served(pki: dict[str, Path]) -> None:
    assert run(health(pki, client_context(node(pki, "client")), "https")) == 200


@pytest.mark.parametrize("who", [None, "rogue"], ids=["no-cert", "other-ca"])
def test_a_client_outside_the_ca_is_refused(pki: dict[str, Path], who: str | None) -> None:
    ctx = (
        client_context(node(pki, who))
        if who is None
        else client_context(TlsConfig(str(pki["rogue"]), str(pki["rogue-key"]), str(pki["ca"])))
    )
    with pytest.raises((aiohttp.ClientError, ssl.SSLError)):
        run(health(pki, ctx, "https"))


def test_a_plaintext_client_gets_an_error(pki: dict[str, Path]) -> None:
    with pytest.raises(aiohttp.ClientError):
        run(health(pki, None, "http"))
