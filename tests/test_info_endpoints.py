"""Information endpoints (``/metrics``, ``/health``, the metadata listing) answer any local process
on the default loopback binds (127.0.0.1, ::1); bound anywhere else they require the token when
one is set. 127.0.0.2 stands for "anywhere else": it is loopback, so the test stays on this host,
but it is not a default bind."""

from __future__ import annotations

import http.client
from collections.abc import Iterator

import pytest
from helpers import free_port

from mooncake_connectors.config import EngineConfig
from mooncake_connectors.store import Master, MasterConfig
from mooncake_connectors.transfer_core import TransferEngine
from mooncake_connectors.transfer_core.metadata.http import HttpMetadata, MetadataHTTPServer

TOKEN = "s3cret-token"
ELSEWHERE = "127.0.0.2"


def status(host: str, port: int, target: str, token: str | None = None) -> int:
    conn = http.client.HTTPConnection(host, port, timeout=5)
    try:
        conn.request("GET", target, headers={"Authorization": f"Bearer {token}"} if token else {})
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


@pytest.fixture
def metadata_server(request: pytest.FixtureRequest) -> Iterator[MetadataHTTPServer]:
    host, token = request.param
    s = MetadataHTTPServer(host, 0, token=token).start()
    yield s
    s.stop()


@pytest.mark.parametrize("metadata_server", [(ELSEWHERE, TOKEN)], indirect=True)
def test_metadata_server_elsewhere_requires_the_token(metadata_server: MetadataHTTPServer) -> None:
    s = metadata_server
    HttpMetadata(s.url, token=TOKEN).put("segments/x", b"descriptor")
    for target in ("/health", "/metadata?prefix=", "/metadata?prefix=segments/"):
        assert status(s.host, s.port, target) == 401
        assert status(s.host, s.port, target, "wrong token!") == 401
        assert status(s.host, s.port, target, TOKEN) == 200
    assert HttpMetadata(s.url, token=TOKEN).list("segments/") == {"segments/x": b"descriptor"}


@pytest.mark.parametrize("metadata_server", [("127.0.0.1", TOKEN)], indirect=True)
def test_metadata_server_on_the_default_bind_keeps_health_open(
    metadata_server: MetadataHTTPServer,
) -> None:
    s = metadata_server
    assert status(s.host, s.port, "/health") == 200
    assert status(s.host, s.port, "/metadata?prefix=") == 401  # the listing is data: token
    assert status(s.host, s.port, "/metadata?prefix=", TOKEN) == 200


@pytest.mark.parametrize("host", [ELSEWHERE, "127.0.0.1"])
def test_master_metrics_and_health(host: str) -> None:
    m = Master(MasterConfig(host=host, port=0, metrics_port=0, auth_token=TOKEN)).start()
    try:
        port = m.metrics_port
        assert port is not None
        for target in ("/metrics", "/health"):
            want = 401 if host == ELSEWHERE else 200
            assert status(host, port, target) == want
            assert status(host, port, target, "wrong token!") == want
            assert status(host, port, target, TOKEN) == 200
    finally:
        m.close()


def test_master_without_a_token_serves_metrics_anywhere() -> None:
    m = Master(MasterConfig(host=ELSEWHERE, port=0, metrics_port=0)).start()
    try:
        assert m.metrics_port is not None
        assert status(ELSEWHERE, m.metrics_port, "/health") == 200
    finally:
        m.close()


def test_engine_metrics_elsewhere_require_the_token() -> None:
    port = free_port()
    e = TransferEngine(
        EngineConfig(
            host=ELSEWHERE,
            metadata="memory://metrics",
            transports=("tcp",),
            metrics_port=port,
            auth_token=TOKEN,
        )
    ).start()
    try:
        assert status(ELSEWHERE, port, "/metrics") == 401
        assert status(ELSEWHERE, port, "/metrics", "wrong token!") == 401
        assert status(ELSEWHERE, port, "/metrics", TOKEN) == 200
    finally:
        e.close()
