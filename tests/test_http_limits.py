"""HTTP listeners (the metadata server; the master's /metrics uses the same server class) against
slow clients, bursts of connects and descriptor exhaustion."""

from __future__ import annotations

import errno
import os
import re
import select
import socket
import time

from helpers import wait_until
from store_cluster import Proc

from mooncake_connectors.transfer_core.metadata.http import HttpMetadata, MetadataHTTPServer


def closed_within(s: socket.socket, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([s], [], [], left)
        if not ready:
            return False
        try:
            if s.recv(65536) == b"":
                return True
        except ConnectionResetError:
            return True
    return False


def test_a_request_trickling_in_is_cut_off_while_others_are_served() -> None:
    srv = MetadataHTTPServer("127.0.0.1", 0, request_timeout=0.5).start()
    client = HttpMetadata(srv.url, timeout=5)
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
    try:
        request = b"PUT /metadata?key=slow HTTP/1.1\r\nHost: x\r\nContent-Length: 64\r\n\r\n"
        s.sendall(request[:10])
        client.put("k", b"v")  # served while the slow one is open
        assert client.get("k") == b"v"
        sent = 10
        for i in range(10, len(request)):  # a byte per 0.1 s: 6 s for the whole head
            if closed_within(s, 0.1):
                break
            s.sendall(request[i : i + 1])
            sent += 1
        assert sent < len(request), "a request trickling in was never cut off"
        assert client.get("slow") is None
    finally:
        s.close()
        client.close()
        srv.stop()


def test_a_burst_of_connects_is_queued_not_dropped() -> None:
    srv = MetadataHTTPServer("127.0.0.1", 0)  # listening, not yet accepting: connects queue up
    socks: list[socket.socket] = []
    started = False
    try:
        for _ in range(64):
            s = socket.socket()
            s.setblocking(False)
            err = s.connect_ex(("127.0.0.1", srv.port))
            assert err in (0, errno.EINPROGRESS)
            socks.append(s)
        pending = list(socks)
        deadline = time.monotonic() + 3  # a dropped SYN is retried only after 1 s, then 3 s
        while pending and time.monotonic() < deadline:
            _, ready, _ = select.select([], pending, [], 0.1)
            for s in ready:
                assert s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
                pending.remove(s)
        assert not pending, f"{len(pending)} of 64 connects not queued: the backlog is too short"
        srv.start()
        started = True
        client = HttpMetadata(srv.url, timeout=5)
        client.put("k", b"v")
        client.close()
    finally:
        for s in socks:
            s.close()
        if not started:
            srv.start()  # stop() waits for the serving thread
        srv.stop()


def test_metadata_server_backs_off_when_out_of_descriptors_and_serves_again() -> None:
    m = Proc(["metadata-server", "--port", "0"], nofile=40)
    flood: list[socket.socket] = []
    try:
        wait_until(lambda: "metadata server on" in m.output(), 30, "the server to listen")
        url = re.search(r"metadata server on (\S+)", m.output())
        assert url is not None
        port = int(url.group(1).rsplit(":", 1)[1].split("/", 1)[0])
        for _ in range(60):  # each connection holds a descriptor while its request is awaited
            flood.append(socket.create_connection(("127.0.0.1", port), timeout=5))

        def failures() -> int:
            with open(m.log.name, errors="replace") as fh:
                return fh.read().count("accept failed")

        wait_until(lambda: failures() > 0, 10, "the server to hit EMFILE")
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:  # a failing accept() must not flood the log
            assert failures() <= 3, f"{failures()} accept-failure log lines"
            time.sleep(0.1)
        assert len(os.listdir(f"/proc/{m.pid}/fd")) <= 40
        for s in flood:
            s.close()
        flood.clear()
        client = HttpMetadata(url.group(1), timeout=10)
        try:
            client.put("k", b"v")
            assert client.get("k") == b"v"
        finally:
            client.close()
    finally:
        for s in flood:
            s.close()
        m.close()
