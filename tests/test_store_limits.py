"""The master's control port against exhaustion: descriptors (EMFILE backs off, logs a bounded
number of lines, serves again), unfinished frames (an in-flight byte budget), slow peers (a
whole-frame and an authentication deadline), and keys (a key budget that evicts or refuses)."""

from __future__ import annotations

import json
import os
import random
import select
import socket
import time
from collections.abc import Iterator

import pytest
from helpers import wait_until
from store_cluster import Proc, client

from mooncake_connectors.store import Master, MasterConfig
from mooncake_connectors.store.protocol import (
    HEADER,
    MAGIC,
    PREFIX,
    PROTOCOL_VERSION,
    Bools,
    Code,
    Exists,
)
from mooncake_connectors.store.records import key_cost
from mooncake_connectors.store.rpc import Channel
from mooncake_connectors.store.state import MasterState

MiB = 1 << 20
TOKEN = "limits-token-1"


@pytest.fixture
def master() -> Iterator[Master]:
    cfg = MasterConfig(port=0, max_frame=1 * MiB, max_inflight=2 * MiB, frame_timeout=0.5)
    m = Master(cfg).start()
    yield m
    m.close()


def raw(m: Master) -> socket.socket:
    host, port = m.address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5)


def closed_within(s: socket.socket, timeout: float) -> bool:
    """Whether the peer closes ``s`` within ``timeout`` (answers it sends first are skipped)."""
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


def served(m: Master) -> None:
    ch = Channel(m.address, timeout=5)
    try:
        assert isinstance(ch.call(Exists(["k"]), 5), Bools)
    finally:
        ch.close()


def head(length: int) -> bytes:
    return PREFIX.pack(length) + HEADER.pack(MAGIC, PROTOCOL_VERSION, 0, 1)


def test_trickling_frame_is_closed_within_the_frame_deadline(master: Master) -> None:
    s = raw(master)
    try:
        s.sendall(head(100)[:-1])
        served(master)  # others are served while it trickles
        assert closed_within(s, 5), "a frame trickling in was never cut off"
        served(master)
    finally:
        s.close()


def test_unauthenticated_connection_is_closed_within_the_frame_deadline() -> None:
    m = Master(MasterConfig(port=0, auth_token=TOKEN, frame_timeout=0.5)).start()
    try:
        s = raw(m)
        try:
            assert closed_within(s, 5), "a connection that never authenticated stayed open"
        finally:
            s.close()
        ch = Channel(m.address, timeout=5, token=TOKEN)
        ch.close()
    finally:
        m.close()


def test_unfinished_frames_stay_within_the_in_flight_budget() -> None:
    cfg = MasterConfig(port=0, max_frame=1 * MiB, max_inflight=2 * MiB, frame_timeout=60)
    master = Master(cfg).start()
    rpc = master.rpc
    assert rpc is not None
    socks = [raw(master) for _ in range(4)]
    try:
        socks[0].sendall(head(MiB - 64))  # a declared length alone allocates nothing
        wait_until(lambda: rpc.inflight == PREFIX.size + HEADER.size, 5, "the header to arrive")
        sent = 0
        for s in socks:
            try:
                s.sendall(head(MiB - 64) + bytes(900 * 1024))
                sent += 1
            except (BrokenPipeError, ConnectionResetError):
                pass
            assert rpc.inflight <= 2 * MiB
        # Two unfinished 0.9 MiB frames fit in 2 MiB, four do not: the master closes one or two
        # (given a loaded machine's time to do so; the others stay open for the 60 s deadline).
        refused: set[int] = set()
        deadline = time.monotonic() + 10
        while not refused and time.monotonic() < deadline:
            refused.update(i for i, s in enumerate(socks) if closed_within(s, 0.05))
        refused.update(i for i, s in enumerate(socks) if i not in refused and closed_within(s, 0.5))
        assert 1 <= len(refused) <= 2, refused
        assert rpc.inflight <= 2 * MiB
        served(master)
        for s in socks:
            s.close()
        wait_until(lambda: rpc.inflight == 0, 5, "closed connections to release their bytes")
    finally:
        for s in socks:
            s.close()
        master.close()


def failures(p: Proc) -> int:
    with open(p.log.name, errors="replace") as fh:
        return fh.read().count("accept failed")


def test_master_backs_off_when_out_of_descriptors_and_serves_again() -> None:
    m = Proc(["master", "--port", "0"], nofile=48)  # port 0: no race for a free port
    flood: list[socket.socket] = []
    try:
        wait_until(lambda: '{"master": ' in m.output(), 30, "the master to listen")
        line = m.output().split('{"master": ', 1)[1].split("\n", 1)[0]
        port = int(json.loads('{"master": ' + line)["master"].rsplit(":", 1)[1])
        for _ in range(80):
            flood.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        wait_until(lambda: failures(m) > 0, 10, "the master to hit EMFILE")
        # a failing accept() must neither spin nor flood the log; watch for a while
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            lines = failures(m)
            assert lines <= 3, f"{lines} accept-failure log lines: the master spins"
            time.sleep(0.1)
        assert len(os.listdir(f"/proc/{m.pid}/fd")) <= 48
        for s in flood:
            s.close()
        flood.clear()
        assert m.alive(), m.output()
        c = client(f"127.0.0.1:{port}", timeout=10)
        try:
            assert c.stats()["keys"] == 0
        finally:
            c.close()
        assert m.alive()
    finally:
        for s in flood:
            s.close()
        m.close()


# -- the key budget (MasterState, explicit clock) ----------------------------------------------
def state(**cfg: object) -> MasterState:
    s = MasterState(MasterConfig(port=0, **cfg), now=-100.0)  # type: ignore[arg-type]
    rec = s.server("srv0", None, 0.0)
    s.mount(rec, "seg0", 1 << 32, 64 * MiB, "host", "", 0, False)
    return s


def long_key(i: int) -> str:
    return f"{i:08d}".ljust(4096, "k")


def test_keys_are_charged_and_old_objects_evicted_to_stay_within_the_key_budget() -> None:
    s = state(key_budget=1 * MiB)
    for i in range(1000):  # empty values, 4 KiB keys: 4 MiB of keys in all
        pid = random.getrandbits(40) + 1
        codes, _ = s.put_start(pid, [long_key(i)], [0], 1, 0, 0, "", 0.0)
        assert codes == [Code.OK]
        assert s.put_end(pid, [long_key(i)], [], 0.0) == [Code.OK]
        assert s.key_bytes <= 1 * MiB
    assert s.key_bytes == sum(key_cost(k) for k in s.objects)
    assert long_key(999) in s.objects and long_key(0) not in s.objects  # LRU went first
    s.remove_all(True, 0.0)
    assert s.key_bytes == 0


def test_a_put_past_the_key_budget_that_nothing_can_make_room_for_is_refused() -> None:
    s = state(key_budget=1 * MiB, put_lease_ttl=2.0)
    keys = [long_key(i) for i in range(400)]
    codes, _ = s.put_start(7, keys, [0] * len(keys), 1, 0, 0, "", 0.0)  # puts in progress
    fit = 1 * MiB // key_cost(keys[0])
    assert codes[:fit] == [Code.OK] * fit
    assert set(codes[fit:]) == {Code.NO_SPACE}
    assert s.key_bytes <= 1 * MiB
    s.tick(3.0)  # the put leases expire
    assert s.key_bytes == 0 and not s.pending
