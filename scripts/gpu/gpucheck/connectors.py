"""C5: the connectors' own code on CUDA KV caches in vLLM's GPU layout, without vLLM.

The PD session (``pd.session.TransferSession``, what vLLM's ``PDWorker`` is): the initiator's
prefill session pushes each layer from ``save_kv_layer`` right after that layer's kernel wrote
it (fenced by the session's ``producer``, as PDWorker sets it), then the target's decode session
pulls other blocks. The store: the store worker's calls (``layer_layouts``/``register_spans``
over the KV cache, ``batch_put_from`` and ``batch_get_into`` of a ``StoreClient``) against a
master and store server in the target (the StoreWorker class itself needs vLLM). Every result is
compared by SHA-256 per layer, with guard bands around each layer and untouched blocks checked.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from .devmem import GUARD, GUARD_BYTE, Dev, digest

QUICK = {"layers": 2, "blocks": 16, "block_size": 16, "heads": 2, "head_dim": 64}
FULL = {"layers": 4, "blocks": 256, "block_size": 16, "heads": 8, "head_dim": 128}


@dataclasses.dataclass(frozen=True)
class Settings:
    """What a TransferSession asks of its settings (vLLM's PDConfig gives the same)."""

    metadata: str
    transports: tuple[str, ...]
    accept_push: bool = False
    host: str = "127.0.0.1"
    side_channel_port: int = 0
    transfer_timeout: float = 60.0
    handshake_timeout: float = 10.0
    kv_lease: float = 120.0

    def engine_config(self) -> Any:
        from mooncake_connectors.config import EngineConfig

        return EngineConfig(
            host=self.host,
            metadata=self.metadata,
            transports=self.transports,
            timeout=self.transfer_timeout,
        )


class _Stats:
    def __getattr__(self, name: str) -> Any:  # record_load, record_push, ...: not judged here
        return lambda *args: None


@dataclasses.dataclass(frozen=True)
class _Device:
    type: str
    index: int


class DevTensor:
    """The geometry a connector asks of a KV tensor, over driver memory (no CUDA torch)."""

    def __init__(self, addr: int, shape: tuple[int, ...], device: int) -> None:
        self.addr, self.shape = addr, shape
        self.device, self.dtype = _Device("cuda", device), "torch.bfloat16"

    def stride(self) -> tuple[int, ...]:
        out, acc = [], 1
        for dim in reversed(self.shape):
            out.append(acc)
            acc *= dim
        return tuple(reversed(out))

    def element_size(self) -> int:
        return 2

    def data_ptr(self) -> int:
        return self.addr

    def is_contiguous(self) -> bool:
        return True


class KvLayer:
    """One layer's KV cache, (2, blocks, block_size, heads, head_dim) bf16, between guard bands:
    a torch tensor when torch has CUDA, else driver memory."""

    def __init__(self, dev: Dev, geo: dict[str, int], torch: Any = None) -> None:
        self.dev, self.torch = dev, torch
        self.shape = (2, geo["blocks"], geo["block_size"], geo["heads"], geo["head_dim"])
        self.blocks = geo["blocks"]
        self.n = int(np.prod(self.shape)) * 2
        self.block_bytes = self.n // (2 * self.blocks)
        if torch is not None:
            flat = torch.full(
                (self.n + 2 * GUARD,), GUARD_BYTE, dtype=torch.uint8, device=f"cuda:{dev.device}"
            )
            flat[GUARD : GUARD + self.n].zero_()
            torch.cuda.synchronize()
            self.flat = flat
            self.tensor: Any = flat[GUARD : GUARD + self.n].view(torch.bfloat16).view(self.shape)
            self.base = int(flat.data_ptr())
        else:
            self.base = dev.alloc(self.n + 2 * GUARD)
            dev.put(self.base, np.full(self.n + 2 * GUARD, GUARD_BYTE, dtype=np.uint8))
            self.tensor = DevTensor(self.base + GUARD, self.shape, dev.device)
        self.addr = self.base + GUARD
        self.zero()

    def zero(self) -> None:
        self.dev.put(self.addr, np.zeros(self.n, dtype=np.uint8))

    def produce(self, data: np.ndarray, host: int) -> None:
        """The layer's kernel writes ``data``, queued on the application's stream (torch's
        current one, or the legacy stream); it lands later."""
        if self.torch is not None:
            src = self.torch.from_numpy(data).to(f"cuda:{self.dev.device}")
            a = self.torch.randn(1024, 1024, device=f"cuda:{self.dev.device}")
            for _ in range(20):  # keep the stream busy: the copy lands late
                a = self.torch.tanh(a @ a)
            self.flat[GUARD : GUARD + self.n].copy_(src)
            return
        import ctypes

        ctypes.memmove(host, data.ctypes.data, self.n)
        self.dev.produce(self.addr, host, self.n)

    def blocks_of(self, data: np.ndarray, ids: list[int]) -> str:
        """SHA-256 of blocks ``ids`` of K, then of V, in ``data`` (this layer's bytes)."""
        bb, plane = self.block_bytes, self.n // 2
        parts = [
            data[kv * plane + b * bb : kv * plane + (b + 1) * bb] for kv in (0, 1) for b in ids
        ]
        return digest(np.concatenate(parts) if parts else np.empty(0, dtype=np.uint8))

    def check(self, ids: list[int]) -> tuple[str, bool, bool]:
        """(SHA of blocks ``ids``, guard bands intact, every other block still zero)."""
        data = self.dev.get(self.addr, self.n)
        lo, hi = self.dev.get(self.base, GUARD), self.dev.get(self.addr + self.n, GUARD)
        guards = bool((lo == GUARD_BYTE).all() and (hi == GUARD_BYTE).all())
        bb, plane = self.block_bytes, self.n // 2
        others = [b for b in range(self.blocks) if b not in set(ids)]
        zero = all(
            not data[kv * plane + b * bb : kv * plane + (b + 1) * bb].any()
            for kv in (0, 1)
            for b in others
        )
        return self.blocks_of(data, ids), guards, zero

    def free(self) -> None:
        if self.torch is None:
            self.dev.free(self.base)


def layer_names(geo: dict[str, int]) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(geo["layers"])]


def session(settings: Settings, engine_id: str, geo: dict[str, int]) -> Any:
    from mooncake_connectors.pd.session import TransferSession

    return TransferSession(
        settings,
        engine_id,
        block_size=geo["block_size"],
        tp_size=1,
        num_blocks=geo["blocks"],
        num_kv_heads=geo["heads"],
        stats=_Stats(),
    )


# -- the target's side ---------------------------------------------------------------------------
def serve(cmd: str, msg: dict[str, Any], dev: Dev, state: dict[str, Any]) -> dict[str, Any]:
    """The target's connector commands (the decode session, the store servers)."""
    from mooncake_connectors.pd.params import PullParams, PushParams
    from mooncake_connectors.pd.plan import PushRecvSpec, RecvSpec, StepPlan

    if cmd == "pd_open":
        close_target(state)  # the previous transport's session
        geo = msg["geo"]
        layers = {name: KvLayer(dev, geo) for name in layer_names(geo)}
        dec = session(Settings(msg["metadata"], tuple(msg["transports"]), True), "gpucheck-d", geo)
        state["pd"], state["layers"], state["recved"] = dec, layers, set()
        dec.register({k: v.tensor for k, v in layers.items()}, 0)
        return {"side_channel": dec.side_channel}
    s: Any = state.get("pd")
    layers = state.get("layers", {})
    if s is None and cmd.startswith("pd_"):
        return {"error": f"{cmd} before pd_open"}
    if cmd == "pd_push_recv":
        remote = PushParams(msg["push_id"], msg["engine_id"], (msg["side_channel"],), 1)
        spec = PushRecvSpec(
            msg["request_id"], msg["blocks"], 0, msg["num_tokens"], msg["prompt_hash"], remote
        )
        s.start_load_kv(StepPlan(push_recv=[spec]))
        return {}
    if cmd == "pd_pull":
        pull = PullParams(
            engine_id=msg["engine_id"],
            request_id=msg["remote_request_id"],
            block_ids=tuple(msg["remote_blocks"]),
            num_tokens=msg["num_tokens"],
            prompt_hash=msg["prompt_hash"],
            side_channels=(msg["side_channel"],),
            tp_size=1,
            expires_at=time.time() + 600,
        )
        s.start_load_kv(
            StepPlan(recv=[RecvSpec(msg["request_id"], msg["blocks"], msg["remote_blocks"], pull)])
        )
        return {}
    if cmd == "pd_wait":
        deadline = time.monotonic() + msg["timeout"]
        while msg["request_id"] not in state["recved"] and time.monotonic() < deadline:
            state["recved"] |= s.get_finished()[1] or set()
            time.sleep(0.01)
        done = msg["request_id"] in state["recved"]
        checks = {name: layer.check(msg["blocks"]) for name, layer in layers.items()}
        return {
            "done": done,
            "errors": sorted(s.take_load_errors()),
            "sha": {name: c[0] for name, c in checks.items()},
            "guards_ok": all(c[1] for c in checks.values()),
            "others_zero": all(c[2] for c in checks.values()),
        }
    if cmd == "pd_zero":
        for layer in layers.values():
            layer.zero()
        return {}
    if cmd == "store_open" and "store" in state:
        return {"master": state["store"][0].address}
    if cmd == "store_open":
        from mooncake_connectors.config import DEFAULT_TRANSPORTS, GPU_TRANSPORT
        from mooncake_connectors.store.config import MasterConfig, ServerConfig
        from mooncake_connectors.store.master import Master
        from mooncake_connectors.store.server import StoreServer

        master = Master(MasterConfig(port=0, heartbeat_interval=0.2, server_ttl=30.0)).start()
        # cuda_ipc too: the store's memfd pool is then copied into from the client's GPU
        state["store"] = (
            master,
            StoreServer(
                ServerConfig(
                    master=master.address,
                    memory=msg["memory"],
                    transports=(GPU_TRANSPORT, *DEFAULT_TRANSPORTS),
                )
            ).start(),
        )
        return {"master": master.address}
    return {"error": f"unknown command {cmd}"}


def close_target(state: dict[str, Any], store: bool = False) -> None:
    if "pd" in state:
        state.pop("pd").shutdown()
        for layer in state.pop("layers").values():
            layer.free()
    if store and "store" in state:
        master, server = state.pop("store")
        server.close()
        master.close()
