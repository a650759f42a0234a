"""One role of SGLang's Mooncake PD disaggregation, engine-free, as its own process.

``python -m mooncake_connectors.bench.sglang_pd_role CONFIG_JSON`` builds SGLang's own
``MooncakeKVManager`` (``sglang.srt.disaggregation.mooncake.conn``, unmodified) for the prefill or
the decode role over CPU buffers that stand in for the KV pools, the way SGLang's scheduler does:
it publishes a ``ServerArgs`` (``disaggregation_mode``, ``disaggregation_transfer_backend
mooncake``, the bootstrap port, ``host``) with the launcher's rank bundle, starts the shared
``MooncakeTransferEngine`` (``init_mooncake_transfer_engine``: ``from mooncake.engine import
TransferEngine``, our facade when the alias is on, Mooncake's wheel when it is off), and hands the
manager a ``KVArgs`` of pointers and lengths. The prefill process also runs SGLang's
``MooncakeKVBootstrapServer``, as SGLang's prefill server does.

Then it reads one JSON command a line on stdin and answers one JSON line on stdout, prefixed
with :data:`MARK` (SGLang's own output may share stdout). Commands: ``recv`` (decode: a
``MooncakeKVReceiver``, ``init``, ``send_metadata`` of the page indices), ``send`` (prefill: a
``MooncakeKVSender``, ``init``, wait for the decode's metadata, ``send`` of the page indices, poll
to the end), ``wait`` (decode: poll the receiver to Success or Failed), ``digest`` (sha256 of the
named pages of every buffer), ``quit``. Every wait is bounded by the command's ``timeout``.

Layout (SGLang's MHA pool, ``get_contiguous_buf_infos``): one K buffer a layer, then one V buffer
a layer, each ``pages`` pages of ``page_bytes``; one aux (metadata) buffer of ``aux_slots`` rows.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import sys
import time
from typing import Any

MARK = "@@sglang-pd "


def _reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


class Buffers:
    """The KV pool stand-in: 2 x ``layers`` page arrays and one aux array, in real memory."""

    def __init__(self, layers: int, pages: int, page_bytes: int, aux_slots: int, aux_bytes: int):
        self.page_bytes, self.aux_bytes = page_bytes, aux_bytes
        self.kv = [ctypes.create_string_buffer(pages * page_bytes) for _ in range(2 * layers)]
        self.aux = ctypes.create_string_buffer(aux_slots * aux_bytes)

    def fill(self, seed: int) -> None:
        for i, buf in enumerate([*self.kv, self.aux]):
            data = hashlib.shake_256(f"{seed}:{i}".encode()).digest(len(buf))
            ctypes.memmove(buf, data, len(buf))

    def page_digests(self, pages: list[int]) -> list[list[str]]:
        """Per buffer, per page: sha256 hex of its bytes."""
        n = self.page_bytes
        return [
            [hashlib.sha256(buf.raw[p * n : (p + 1) * n]).hexdigest() for p in pages]
            for buf in self.kv
        ]

    def untouched(self, pages: set[int]) -> bool:
        """Are all pages but ``pages`` still zero (nothing written outside the sent pages)?"""
        n = self.page_bytes
        total = len(self.kv[0]) // n
        zero = bytes(n)
        return all(
            buf.raw[p * n : (p + 1) * n] == zero
            for buf in self.kv
            for p in range(total)
            if p not in pages
        )

    def aux_digest(self, slot: int) -> str:
        n = self.aux_bytes
        return hashlib.sha256(self.aux.raw[slot * n : (slot + 1) * n]).hexdigest()


def _publish(cfg: dict[str, Any]) -> None:
    """Publish the process config as SGLang's scheduler entry does, with its rank bundle."""
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(
        model_path="dummy",
        host="127.0.0.1",
        port=int(cfg["http_port"]),
        disaggregation_mode=cfg["role"],
        disaggregation_transfer_backend="mooncake",
        disaggregation_bootstrap_port=int(cfg["bootstrap_port"]),
    )
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0, dp_rank=None, gpu_id=0))
    # The process groups come from torch.distributed at model-parallel setup, which this
    # engine-free process skips. The managers read only the pipeline group, and use it only at
    # pp_size > 1 (PPConsensusStore): a single-stage process states it has none.
    get_parallel().override_permanently(pp_group=None)


def _kv_args(buffers: Buffers, cfg: dict[str, Any]) -> Any:
    """A ``KVArgs`` as SGLang's ``_init_kv_manager`` fills it for a plain MHA pool."""
    from sglang.srt.disaggregation.mooncake.conn import KVArgs

    args = KVArgs()
    args.engine_rank = 0
    args.pp_rank = 0
    args.system_dp_rank = 0
    args.rust_http_port = None
    args.kv_cache_dtype_str = "bfloat16"
    args.kv_layout = None
    args.prefill_start_layer = 0
    args.prefill_end_layer = cfg["layers"]
    args.kv_data_ptrs = [ctypes.addressof(b) for b in buffers.kv]
    args.kv_data_lens = [len(b) for b in buffers.kv]
    args.kv_item_lens = [buffers.page_bytes] * len(buffers.kv)
    args.num_draft_entries = 0
    args.kv_layer_ids = []  # a plain MHA pool reports none: positional K-then-V pairing
    args.kv_head_num = cfg["heads"]
    args.total_kv_head_num = cfg["heads"]
    args.page_size = cfg["page_tokens"]
    args.aux_data_ptrs = [ctypes.addressof(buffers.aux)]
    args.aux_data_lens = [len(buffers.aux)]
    args.aux_item_lens = [buffers.aux_bytes]
    args.ib_device = None
    args.gpu_id = 0
    # setup_state_kv_args for a pool without state components
    args.state_types = []
    args.state_data_ptrs = []
    args.state_data_lens = []
    args.state_item_lens = []
    args.state_dim_per_tensor = []
    args.state_slice_outer_counts = []
    args.state_layer_ids = []
    args.is_hybrid_mla_backend = False
    args.state_conv_shard_groups = []
    args.swa_kv_cache_layout = None
    args.mla_compression_ratios = None
    return args


class Role:
    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        t0 = time.perf_counter()
        _publish(cfg)
        from sglang.srt.disaggregation.mooncake import conn
        from sglang.srt.disaggregation.utils import DisaggregationMode
        from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
            init_mooncake_transfer_engine,
        )

        self.conn = conn
        self.bootstrap_addr = f"127.0.0.1:{cfg['bootstrap_port']}"
        self.server = None
        if cfg["role"] == "prefill":
            self.server = conn.MooncakeKVBootstrapServer(
                host="127.0.0.1", port=cfg["bootstrap_port"]
            )
        # What SGLang's maybe_init_shared_mooncake_transfer_engine does for a PD role.
        self.engine = init_mooncake_transfer_engine(hostname="127.0.0.1", gpu_id=0, ib_device=None)
        self.buffers = Buffers(
            cfg["layers"], cfg["pages"], cfg["page_bytes"], cfg["aux_slots"], cfg["aux_bytes"]
        )
        if cfg["role"] == "prefill":
            self.buffers.fill(int(cfg.get("seed", 1)))
        mode = DisaggregationMode.PREFILL if cfg["role"] == "prefill" else DisaggregationMode.DECODE
        from sglang.srt.runtime_context import get_server_args

        self.mgr = conn.MooncakeKVManager(
            _kv_args(self.buffers, cfg), mode, get_server_args(), False
        )
        self.receivers: dict[int, Any] = {}
        engine_type = type(self.engine.engine)
        self.ready = {
            "ready": True,
            "pid": os.getpid(),
            "session": self.engine.get_session_id(),
            "engine": f"{engine_type.__module__}.{engine_type.__qualname__}",
            "start_s": round(time.perf_counter() - t0, 3),
        }

    # -- decode ---------------------------------------------------------------------------------
    def recv(self, cmd: dict[str, Any]) -> dict[str, Any]:
        import numpy as np

        room, deadline = int(cmd["room"]), time.monotonic() + float(cmd["timeout"])
        # The decode scheduler's _ensure_prefill_info: retried until the prefill registered.
        while not self.mgr.try_ensure_parallel_info(self.bootstrap_addr):
            if time.monotonic() > deadline:
                return {"error": "prefill parallel info not available in time"}
            time.sleep(0.05)
        receiver = self.conn.MooncakeKVReceiver(
            mgr=self.mgr, bootstrap_addr=self.bootstrap_addr, bootstrap_room=room
        )
        receiver.init(0)
        receiver.send_metadata(np.asarray(cmd["pages"], dtype=np.int32), int(cmd["aux_index"]))
        self.receivers[room] = receiver
        return {"status": int(receiver.poll())}

    def wait(self, cmd: dict[str, Any]) -> dict[str, Any]:
        from sglang.srt.disaggregation.base.conn import KVPoll

        room = int(cmd["room"])
        receiver = self.receivers[room]
        t0 = time.monotonic()
        status = self._poll_until(receiver, float(cmd["timeout"]), (KVPoll.Success, KVPoll.Failed))
        out: dict[str, Any] = {"status": int(status), "wait_s": round(time.monotonic() - t0, 3)}
        if status == KVPoll.Failed:
            out["reason"] = self.mgr.failure_records.get(room, "")
        if cmd.get("clear", True):
            receiver.clear()
            self.receivers.pop(room, None)
        return out

    # -- prefill --------------------------------------------------------------------------------
    def send(self, cmd: dict[str, Any]) -> dict[str, Any]:
        import numpy as np
        from sglang.srt.disaggregation.base.conn import KVPoll

        room, timeout = int(cmd["room"]), float(cmd["timeout"])
        pages = np.asarray(cmd["pages"], dtype=np.int32)
        sender = self.conn.MooncakeKVSender(
            mgr=self.mgr, bootstrap_addr=self.bootstrap_addr, bootstrap_room=room
        )
        sender.init(len(pages), int(cmd["aux_index"]))
        # The prefill scheduler's bootstrap queue: wait for the decode's metadata.
        status = self._poll_until(sender, timeout, (KVPoll.WaitingForInput, KVPoll.Failed))
        if status != KVPoll.WaitingForInput:
            return {"status": int(status), "stage": "bootstrap"}
        t0 = time.perf_counter()
        chunk = int(cmd.get("chunk", 0)) or len(pages)
        for start in range(0, len(pages), chunk):  # chunked prefill sends a chunk per forward
            sender.send(pages[start : start + chunk])
        status = self._poll_until(sender, timeout, (KVPoll.Success, KVPoll.Failed))
        out: dict[str, Any] = {"status": int(status), "send_s": time.perf_counter() - t0}
        if status == KVPoll.Failed:
            out["reason"] = self.mgr.failure_records.get(room, "")
        sender.clear()
        return out

    def has_room(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Whether the decode's metadata for ``room`` reached this prefill (its bootstrap
        thread files it under the room): ``send_metadata`` only queues it on a ZMQ socket."""
        return {"has": int(cmd["room"]) in self.mgr.transfer_infos}

    def _poll_until(self, obj: Any, timeout: float, ends: tuple[int, ...]) -> int:
        deadline = time.monotonic() + timeout
        while True:
            status = int(obj.poll())
            if status in ends or time.monotonic() > deadline:
                return status
            time.sleep(0.0002)

    def digest(self, cmd: dict[str, Any]) -> dict[str, Any]:
        pages = [int(p) for p in cmd["pages"]]
        return {
            "pages": self.buffers.page_digests(pages),
            "aux": self.buffers.aux_digest(int(cmd["aux_index"])),
            "untouched": self.buffers.untouched(set(pages)) if cmd.get("untouched") else None,
        }

    def close(self) -> None:
        self.mgr.teardown()
        if self.server is not None:
            self.server.close()


def main() -> None:
    # As SGLang's run_scheduler_process starts: its general plugins first. Ours (an entry point of
    # this package) switches the mooncake alias on under MOONCAKE_CONNECTORS_AS_MOONCAKE=1.
    from sglang.srt.plugins import load_plugins

    load_plugins()
    cfg = json.loads(sys.argv[1])
    role = Role(cfg)
    _reply(role.ready)
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "quit":
            role.close()
            _reply({"bye": True})
            break
        try:
            _reply(getattr(role, op)(cmd))
        except Exception as exc:  # report to the driver; it decides
            _reply({"error": f"{type(exc).__name__}: {exc}"})
    sys.stdout.flush()
    os._exit(0)  # SGLang's daemon threads (zmq, bootstrap loop) need not be joined


if __name__ == "__main__":
    main()
