"""A store with a shared token, as processes: the master given ``--auth-token``, a store server
(with an SSD, so its load endpoint is exercised too) given it through the environment. A client
with the token puts and gets (from memory and from SSD); one without it, or with a wrong one, and
a server with a wrong one, get a clear AuthenticationError; the store keeps serving."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import pattern, wait_until
from store_cluster import FAST, client, start_master, start_server, wait_servers

from mooncake_connectors.errors import AuthenticationError

TOKEN = "s3cret-store-token"


def test_store_with_a_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    m, addr = start_master(*FAST, "--auth-token", TOKEN)
    monkeypatch.setenv("MOONCAKE_CONNECTORS_STORE_TOKEN", TOKEN)
    s = start_server(addr, "2M", "--ssd-dir", str(tmp_path / "ssd"), "--ssd-size", "8M")
    monkeypatch.setenv("MOONCAKE_CONNECTORS_STORE_TOKEN", "a wrong token")
    bad = start_server(addr, "2M")
    monkeypatch.delenv("MOONCAKE_CONNECTORS_STORE_TOKEN")
    try:
        with client(addr, auth_token=TOKEN) as c:
            wait_servers(c, 1)
            vals = {f"a{i}": pattern(i, 256 * 1024).tobytes() for i in range(16)}
            for k, v in vals.items():  # 4 MiB into 2 MiB of memory: some go to SSD
                c.put(k, v)
            wait_until(lambda: c.stats()["spilling"] == 0, 30, "spills to finish")
            assert c.stats()["spills"] > 0
            assert c.get_batch(list(vals)) == list(vals.values())
            assert c.stats()["ssd_hits"] > 0  # the load endpoint let us in too
            with pytest.raises(AuthenticationError, match="requires a token"):
                client(addr)
            with pytest.raises(AuthenticationError, match="wrong token"):
                client(addr, auth_token="not the token")
            wait_until(lambda: not bad.alive(), 30, "the server with a wrong token to give up")
            assert "wrong token" in bad.output()
            assert c.get("a15") == vals["a15"]  # still serving
            assert c.stats()["servers"] == 1
    finally:
        bad.close()
        s.close()
        m.close()
