"""One fuzzing target in its own process: ``python -m mooncake_connectors.bench.fuzz_target KIND``.

It starts the listener(s) of KIND on 127.0.0.1, prints one JSON line (their addresses, the token
and what a well-behaved client needs), then answers stdin commands: ``check`` prints a JSON line
(canaries intact, peak and current RSS, open fds); ``quit`` exits. A crash of any listener thread
is visible to the harness as a dead process or a missing answer, never as a silent pass.

The TE target registers a region with canary pages on both sides that it never registers: a
write outside the region would change them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import sys
import tempfile
import threading
from typing import Any

import numpy as np

TOKEN = "fuzz-token-0123456789"
CANARY = 1 << 20  # wider than any offset the fuzzers try around the region
REGION = 1 << 16


def probe_pattern(n: int) -> bytes:
    return bytes((i * 7 + 3) & 0xFF for i in range(n))


def memory() -> dict[str, int]:
    out = {"fds": len(os.listdir("/proc/self/fd"))}
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(("VmHWM:", "VmRSS:")):
                key, val = line.split(":", 1)
                out[key.lower()] = int(val.split()[0]) * 1024
    return out


@dataclasses.dataclass(frozen=True)
class _SideSettings:
    host: str = "127.0.0.1"
    side_channel_port: int = 0
    transfer_timeout: float = 5.0
    handshake_timeout: float = 5.0
    kv_lease: float = 120.0
    accept_push: bool = False

    def engine_config(self) -> Any:
        raise NotImplementedError  # the fuzz session registers no KV


class _NoStats:
    def record_load(self, seconds: float, nbytes: int, nrequests: int) -> None: ...
    def record_push(self, tail: float, nbytes: int, nrequests: int, overlapped: int) -> None: ...
    def record_failed_load(self) -> None: ...
    def record_expired_lease(self) -> None: ...


class Target:
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.info: dict[str, Any] = {"kind": kind, "token": TOKEN, "pid": os.getpid()}
        self._keep: list[Any] = []
        self._arena: np.ndarray | None = None
        self._session: Any = None
        getattr(self, f"_start_{kind}")()

    def _start_te(self) -> None:
        from ..config import EngineConfig
        from ..transfer_core import TransferEngine

        e = TransferEngine(
            EngineConfig(host="127.0.0.1", metadata="p2p", transports=("tcp",), auth_token=TOKEN)
        ).start()
        self._keep.append(e)
        # canary | region (fuzzed) | canary; the probe region is registered apart
        arena = np.full(REGION + 2 * CANARY, 0xA5, dtype=np.uint8)
        e.register(arena[CANARY : CANARY + REGION])
        probe = np.frombuffer(bytearray(probe_pattern(4096)), dtype=np.uint8)
        e.register(probe)
        self._arena = arena
        self._keep.append(probe)
        assert e.metadata is not None
        desc = e.metadata.lookup_segment(e.segment_name)
        self.info.update(
            segment=e.segment_name,
            te=desc.endpoints["tcp"],
            p2p=f"http://{e.segment_name}/metadata",
            region=int(arena.ctypes.data) + CANARY,
            region_len=REGION,
            probe=int(probe.ctypes.data),
            probe_len=int(probe.size),
        )

    def _start_master(self) -> None:
        from ..store import Master, MasterConfig

        m = Master(MasterConfig(host="127.0.0.1", port=0, auth_token=TOKEN)).start()
        self._keep.append(m)
        self.info["master"] = m.address

    def _start_load(self) -> None:
        from ..store import Master, MasterConfig, ServerConfig, StoreServer

        m = Master(MasterConfig(host="127.0.0.1", port=0, auth_token=TOKEN)).start()
        self._keep.append(m)
        d = tempfile.mkdtemp(prefix="mc-fuzz-ssd-")
        s = StoreServer(
            ServerConfig(
                master=m.address,
                host="127.0.0.1",
                memory=1 << 22,
                ssd_dir=d,
                ssd_size=1 << 24,
                bounce_size=1 << 20,
                auth_token=TOKEN,
            )
        ).start()
        self._keep.append(s)
        assert s._loads is not None
        self.info.update(master=m.address, load=s._loads.address)

    def _start_metadata(self) -> None:
        from ..transfer_core.metadata.http import MetadataHTTPServer

        srv = MetadataHTTPServer("127.0.0.1", 0, token=TOKEN).start()
        srv.local_put("probe", probe_pattern(64))
        self._keep.append(srv)
        self.info["metadata"] = srv.url

    def _start_side(self) -> None:
        from ..pd.messages import LayerLayout, WorkerLayout
        from ..pd.session import TransferSession
        from ..pd.side_channel import SideChannelServer

        # A real prefill session, engine-free: the side channel's Done notices reach its state.
        session = TransferSession(
            _SideSettings(), "fuzz", block_size=16, tp_size=1, num_blocks=8, stats=_NoStats()
        )
        srv = SideChannelServer("127.0.0.1", 0, session._get_layout, session._on_done)
        session.layout = WorkerLayout(
            engine_id="fuzz",
            tp_rank=0,
            tp_size=1,
            segment="127.0.0.1:1",
            side_channel=srv.endpoint,
            block_size=16,
            dtype="bfloat16",
            layers=[LayerLayout("l0", 4096, 256, 256, 8)],
        )
        self._keep += [srv, session]
        self._session = session
        self.info["side"] = srv.endpoint

    def _start_grant(self) -> None:
        from ..config import EngineConfig
        from ..p2p import P2PStore

        store = P2PStore(EngineConfig(host="127.0.0.1", metadata="memory://fuzz"))
        store.publish("fuzz", {"w": np.arange(1 << 16, dtype=np.uint8)}, chunk_size=4096)
        self._keep.append(store)
        self.info["grant"] = store.holder.endpoint

    def _start_proxy(self) -> None:
        from ..conductor.listener import GuardedListener
        from ..conductor.proxy import PDProxy

        # upstreams on a port nothing listens on: every proxied request is an upstream error
        proxy = PDProxy(["http://127.0.0.1:9"], ["http://127.0.0.1:9"], timeout=5.0)
        ready = threading.Event()
        box: dict[str, Any] = {}

        def serve() -> None:
            loop = asyncio.new_event_loop()
            listener = GuardedListener(proxy.app, "127.0.0.1", 0)  # the proxy command's listener
            loop.run_until_complete(listener.start())
            box["port"] = listener.port
            ready.set()
            loop.run_forever()

        threading.Thread(target=serve, name="mc-fuzz-proxy", daemon=True).start()
        if not ready.wait(30):
            raise RuntimeError("proxy did not start")
        self.info["proxy"] = f"http://127.0.0.1:{box['port']}"

    def check(self) -> dict[str, Any]:
        out: dict[str, Any] = {"alive_threads": threading.active_count(), **memory()}
        if self._session is not None:  # what a Done flood left: bounded, not one entry per id
            s = self._session
            s.get_finished()  # the engine adapter calls it every step
            out["side_state"] = len(s._done) + len(s._early)
            out["side_dropped_done"] = s.dropped_done
        if self._arena is not None:
            a = self._arena
            out["canary_ok"] = bool((a[:CANARY] == 0xA5).all() and (a[-CANARY:] == 0xA5).all())
            # proof that hostile WRITEs got past the handshake and into the region
            out["region_bytes_changed"] = int((a[CANARY:-CANARY] != 0xA5).sum())
        return out


def main() -> None:
    # on stderr, which the harness keeps to count tracebacks and warnings
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    target = Target(sys.argv[1])
    print(json.dumps(target.info), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "check":
            print(json.dumps(target.check()), flush=True)
        elif cmd == "quit":
            break
    os._exit(0)  # the listeners' threads need no orderly stop: the harness only wants out


if __name__ == "__main__":
    main()
