"""Hostile local processes against a store and against engines holding a token, all as separate
processes run as users run them. Without the right token a process moves no byte: it cannot read
or overwrite a store server's memory even with its descriptor in hand, cannot publish a forged
descriptor on a guarded metadata server, and a forged descriptor published elsewhere gets no
byte from an initiator that holds the token (the target must prove the token too). Each failure
is a typed error; the victims' bytes stay intact."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import free_port, http_ok, pattern, wait_until
from store_cluster import FAST, Proc, client, start_master, start_server, wait_servers

from mooncake_connectors.config import EngineConfig
from mooncake_connectors.errors import AuthenticationError, SegmentNotFound
from mooncake_connectors.transfer_core import TransferEngine
from mooncake_connectors.transfer_core.metadata.base import SEGMENT_PREFIX
from mooncake_connectors.transfer_core.metadata.http import HttpClient

TOKEN = "s3cret-store-token"
STORE_TOKEN_ENV = "MOONCAKE_CONNECTORS_STORE_TOKEN"  # as the CLI reads it
HOSTILE = [sys.executable, str(Path(__file__).parents[1] / "tests" / "hostile_process.py")]


def hostile(*args: str) -> dict[str, object]:
    done = subprocess.run([*HOSTILE, *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout.splitlines()[-1]))


def server_segment(s: Proc) -> str:
    found: list[str] = []

    def announced() -> bool:
        m = re.search(r'"segment": "([^"]+)"', s.output())
        if m:
            found.append(m.group(1))
        return bool(m)

    wait_until(announced, 30, "the store server to announce its segment")
    return found[0]


def test_a_process_without_the_store_token_moves_no_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    m, addr = start_master(*FAST, "--auth-token", TOKEN)
    monkeypatch.setenv(STORE_TOKEN_ENV, TOKEN)
    s = start_server(addr, "2M")
    monkeypatch.delenv(STORE_TOKEN_ENV)
    try:
        with client(addr, auth_token=TOKEN) as c:
            wait_servers(c, 1)
            vals = {f"k{i}": pattern(i, 64 * 1024).tobytes() for i in range(8)}
            for k, v in vals.items():
                c.put(k, v)
            segment = server_segment(s)
            # The descriptor is no secret: the attacker may sniff it from the network.
            meta = HttpClient(f"http://{segment}/metadata", timeout=5, token=TOKEN)
            status, desc = meta.request("GET", {"key": SEGMENT_PREFIX + segment})
            meta.close()
            assert status == 200
            for token in ("-", "not the token"):
                got = hostile("data", desc.hex(), token)
                assert got == {
                    "read": "AuthenticationError",
                    "write": "AuthenticationError",
                    "leaked": 0,
                }
            assert c.get_batch(list(vals)) == list(vals.values())
    finally:
        s.close()
        m.close()


def metadata_server(*extra: str) -> tuple[Proc, str]:
    port = free_port()
    p = Proc(["metadata-server", "--port", str(port), *extra])
    wait_until(lambda: http_ok(f"http://127.0.0.1:{port}/health"), 30, "the metadata server")
    return p, f"http://127.0.0.1:{port}/metadata"


def victim(url: str) -> tuple[TransferEngine, np.ndarray]:
    e = TransferEngine(
        EngineConfig(metadata=url, transports=("tcp",), auth_token=TOKEN, timeout=5)
    ).start()
    buf = np.full(1 << 20, 7, dtype=np.uint8)
    e.register(buf)
    return e, buf


def test_a_forged_descriptor_gets_no_bytes() -> None:
    guarded, guarded_url = metadata_server("--auth-token", TOKEN)
    open_, open_url = metadata_server()
    procs = [guarded, open_]
    try:
        # A guarded metadata server refuses the forgery.
        for token in ("-", "not the token"):
            h = subprocess.Popen(
                [*HOSTILE, "forge", guarded_url, "evil", token],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            assert h.stdin is not None and h.stdout is not None
            assert json.loads(h.stdout.readline())["put_status"] == 401
            h.communicate("\n", timeout=30)
        e, buf = victim(guarded_url)
        try:
            with pytest.raises(SegmentNotFound):
                e.write("evil", buf.ctypes.data, 0x7F0000000000, 1 << 20)
        finally:
            e.close()
        # Published anyway (an open metadata server), it still gets nothing from a token holder.
        h = subprocess.Popen(
            [*HOSTILE, "forge", open_url, "evil", "-"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert h.stdin is not None and h.stdout is not None
        assert json.loads(h.stdout.readline())["put_status"] == 200
        e, buf = victim(open_url)
        try:
            with pytest.raises(AuthenticationError, match="failed to prove"):
                e.write("evil", buf.ctypes.data, 0x7F0000000000, 1 << 20)
            with pytest.raises(AuthenticationError, match="failed to prove"):
                e.read("evil", buf.ctypes.data, 0x7F0000000000, 1 << 20)
            assert (buf == 7).all()
        finally:
            e.close()
        out, _ = h.communicate("\n", timeout=30)
        report = json.loads(out.splitlines()[-1])
        assert report["handshakes"] >= 1  # the victim did reach the listener
        assert report["received"] == 0  # and sent it nothing past the handshake
    finally:
        for p in procs:
            p.close()
