from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "tests"))

from helpers import EtcdServer

from mooncake_connectors.transfer_core.metadata.http import MetadataHTTPServer


@pytest.fixture(scope="session")
def etcd() -> Iterator[EtcdServer]:
    server = EtcdServer().start()
    yield server
    server.cleanup()


@pytest.fixture
def meta_server() -> Iterator[MetadataHTTPServer]:
    server = MetadataHTTPServer("127.0.0.1", 0).start()
    yield server
    server.stop()
