"""C4: the application's GPU work writes a buffer and the engine moves it at once, as vLLM's
layer-wise push does after each layer's kernel: the copy must follow a ``Fence`` recorded on the
producer's stream (our copy stream waits for it on the GPU; no host sync)."""

from __future__ import annotations

import ctypes
from typing import Any

from .devmem import MIB, Dev, Guarded, digest, pattern
from .sweeps import Run


def ordering(dev: Dev, engine: Any, run: Run, quick: bool, torch: Any) -> dict[str, Any]:
    """Driver-queued work (memsets keeping the GPU busy, then the upload of the bytes, on the
    legacy stream, which torch's default stream is) and, with torch, torch's own kernels; each
    followed at once by an engine WRITE with the fence. The peer's bytes and every guard band
    are checked. The same without the fence is the control, reported and not judged (the fake
    library never lands the work early; a GPU usually has not landed it yet either)."""
    from mooncake_connectors.transfer_core.cuda_driver import Fence

    n = MIB + 5 if quick else 64 * MIB
    size, times = (MIB, 4) if quick else (256 * MIB, 200)
    out: dict[str, Any] = {}
    seg = run.tgt.segment
    remote = run.tgt.call("alloc", kind="gpu", size=n, seed=30)["addr"]
    local = Guarded(dev, engine, "gpu", n, seed=31)
    scratch = dev.alloc(size)
    host = dev.host_alloc(n)
    try:
        for fenced in (False, True):
            want = pattern(32 + fenced, n)
            ctypes.memmove(host, want.ctypes.data, n)
            dev.produce(local.addr, host, n, (scratch, size, times))
            fence = Fence(dev.device, 0) if fenced else None  # the legacy stream's end, now
            engine.write(seg, local.addr, remote, n, timeout=120, after=fence)
            there = run.tgt.call("check", addr=remote)
            dev.sync()  # (the control's work lands now)
            ok = there["sha"] == digest(want) and there["guards_ok"] and local.guards_ok()
            if fenced:
                out["driver_stream"] = {"bytes_and_guards_ok": ok}
                if not ok:
                    run.bad.append("ordering: a fenced copy did not see the queued bytes")
            else:
                out["control_without_fence_saw_the_bytes"] = ok
        if torch is not None:
            out["torch_stream"] = _torch_case(torch, engine, run, remote, n)
    finally:
        dev.host_free(host)
        dev.free(scratch)
        local.free(engine)
        run.tgt.call("free", addr=remote)
    return out


def _torch_case(torch: Any, engine: Any, run: Run, remote: int, n: int) -> dict[str, Any]:
    """torch's kernels on its current stream write the tensor; the fence is the PD worker's own
    (``adapters.cuda_streams.stream_fence`` of the tensor's device). Also checked: torch's
    current device and stream are what they were after register and the transfer (C9)."""
    from mooncake_connectors.adapters.cuda_streams import stream_fence

    device, stream = torch.cuda.current_device(), torch.cuda.current_stream()
    t = torch.zeros(n, dtype=torch.uint8, device="cuda")
    src = torch.from_numpy(pattern(34, n)).cuda()
    a = torch.randn(2048, 2048, device="cuda")
    torch.cuda.synchronize()
    engine.register(t)
    try:
        for _ in range(40):  # keep the stream busy, so the copy below lands late
            a = torch.tanh(a @ a)
        t.copy_(src)
        engine.write(
            run.tgt.segment,
            int(t.data_ptr()),
            remote,
            n,
            timeout=120,
            after=stream_fence(t.device)(),
        )
        there = run.tgt.call("check", addr=remote)
        ok = there["sha"] == digest(pattern(34, n)) and there["guards_ok"]
        same = torch.cuda.current_device() == device and torch.cuda.current_stream() == stream
        if not (ok and same):
            run.bad.append(
                f"ordering (torch): bytes ok {ok}, torch's device and stream kept {same}"
            )
        return {"bytes_and_guards_ok": ok, "torch_device_and_stream_unchanged": same}
    finally:
        torch.cuda.synchronize()
        engine.unregister(int(t.data_ptr()))
