"""The check's second process: a target engine serving allocations, checks and the connectors'
peer roles over a line-per-command JSON pipe, and the initiator's handle on it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from . import connectors
from .devmem import Dev, Guarded, digest, start_engine

SCRIPT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "check_transfer.py"
)
KV = {"layers": 4, "blocks": 512, "block_size": 16, "heads": 8, "head_dim": 128}


def tensor_sha(t: Any) -> str:
    import torch

    return digest(t.detach().reshape(-1).view(torch.uint8).cpu().numpy())


# -- the target process ----------------------------------------------------------------------
def target(metadata: str) -> None:
    dev = Dev()
    engine = start_engine(metadata, ("cuda_ipc", "shm", "tcp"))
    keep: dict[int, Guarded] = {}
    kv: dict[str, Any] = {}
    state: dict[str, Any] = {}
    print(json.dumps({"segment": engine.segment_name}), flush=True)
    for line in sys.stdin:
        msg = json.loads(line)
        cmd = msg["cmd"]
        try:
            if cmd == "alloc":
                g = Guarded(dev, engine, msg["kind"], msg["size"], msg["seed"])
                keep[g.addr] = g
                reply: dict[str, Any] = {"addr": g.addr, "sha": g.sha()}
            elif cmd == "check":
                g = keep[msg["addr"]]
                reply = {"sha": g.sha(), "guards_ok": g.guards_ok()}
            elif cmd == "free":
                keep.pop(msg["addr"]).free(engine)
                reply = {}
            elif cmd == "kv":  # torch only: a vLLM-shaped KV cache, one tensor per layer
                import torch

                shape = (2, KV["blocks"], KV["block_size"], KV["heads"], KV["head_dim"])
                layers = {}
                for i in range(KV["layers"]):
                    g_ = torch.Generator(device="cpu").manual_seed(100 + i)
                    layers[f"l{i}"] = torch.randn(shape, generator=g_).to(torch.bfloat16).cuda()
                    engine.register(layers[f"l{i}"])
                kv.update(layers)
                reply = {"ptrs": {k: int(v.data_ptr()) for k, v in layers.items()}}
            elif cmd == "kv_sha":
                import torch

                ids = msg["blocks"]
                parts = [kv[k][:, ids].contiguous() for k in sorted(kv)]
                reply = {"sha": tensor_sha(torch.stack(parts))}
            elif cmd == "quit":
                connectors.close_target(state, store=True)
                engine.close()
                print("{}", flush=True)
                return
            else:  # the connectors' cases (PD session, store)
                reply = connectors.serve(cmd, msg, dev, state)
        except Exception as exc:
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), flush=True)


class Target:
    def __init__(self, metadata: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, SCRIPT, "--role", "target", "--metadata", metadata],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.segment = self._read()["segment"]

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"target exited (rc={self.proc.poll()})")
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"target: {reply['error']}")
        return reply

    def call(self, cmd: str, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"cmd": cmd, **args}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.call("quit")
        finally:
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
