"""Restart survival: a single (non-HA) master killed the instant a put is acknowledged, then
restarted on its address, rebuilds its index from what the servers re-report, and no
acknowledged put is lost (the holdings deltas reach the servers before the put's answer)."""

from __future__ import annotations

from pathlib import Path

from helpers import pattern, wait_until
from store_cluster import FAST, client, start_master, start_server, wait_servers

KiB = 1024


def test_master_killed_right_after_an_ack_loses_no_acknowledged_put() -> None:
    m, addr = start_master(*FAST)
    port = int(addr.rsplit(":", 1)[1])
    servers = [start_server(addr, "16M") for _ in range(2)]
    try:
        with client(addr, timeout=20) as c:
            wait_servers(c, 2)
            acked = {}
            for i in range(40):
                k, v = f"a{i}", pattern(i, 2000 + i).tobytes()
                c.put(k, v, replicas=1 + i % 2)
                acked[k] = v
            m.kill()  # no wait for the next tick: the last puts' deltas must already be out
            m, _ = start_master(*FAST, port=port)
            wait_servers(c, 2)
            got = c.get_batch(list(acked))
            lost = [k for k, g in zip(acked, got, strict=True) if g is None]
            assert not lost, f"acknowledged puts lost across the restart: {lost}"
            assert got == list(acked.values())
    finally:
        for s in servers:
            s.close()
        m.close()


def test_server_restarted_on_its_ssd_dir_reindexes_and_rereports(tmp_path: Path) -> None:
    """Objects spilled to SSD survive a SIGKILLed server restarted on the same --ssd-dir: its
    files are re-indexed (a file whose CRC no longer matches is dropped, never served) and
    re-reported; what lived only in its memory is gone, as DRAM is."""
    m, addr = start_master(*FAST)
    ssd = tmp_path / "ssd"
    args = ["--ssd-dir", str(ssd), "--ssd-size", "8M"]
    s = start_server(addr, "2M", *args)
    try:
        with client(addr, timeout=20) as c:
            wait_servers(c, 1)
            vals = {f"d{i}": pattern(i, 256 * KiB).tobytes() for i in range(24)}
            for k, v in vals.items():  # 6 MiB into 2 MiB of memory: most of it spills
                c.put(k, v)
            wait_until(lambda: c.stats()["spilling"] == 0, 20, "spills to finish")
            described = sorted(ssd.glob("*.part"))
            assert len(described) >= 10
            s.kill()
            damaged = described[0].with_suffix(".obj")
            raw = bytearray(damaged.read_bytes())
            raw[-1] ^= 0xFF  # one flipped byte: the CRC check must refuse this file
            damaged.write_bytes(bytes(raw))
            s = start_server(addr, "2M", *args)
            wait_until(lambda: len(list(ssd.glob("*.part"))) == len(described) - 1, 20, "reindex")
            got: dict[str, bytes | None] = {}

            def readable() -> bool:
                got.update(zip(vals, c.get_batch(list(vals)), strict=True))
                return sum(v is not None for v in got.values()) >= len(described) - 1

            wait_until(readable, 20, "the re-reported objects to be readable")
            assert all(got[k] == v for k, v in vals.items() if got[k] is not None)
            assert c.stats()["ssd_used_bytes"] <= 8 << 20
            c.put("after", b"ok")
            assert c.get("after") == b"ok"
    finally:
        s.close()
        m.close()
