"""The initiator's side of the connectors' cases (see :mod:`.connectors`): a PD prefill session
pushing and serving pulls, and the store worker's puts and gets, on this process's CUDA KV."""

from __future__ import annotations

import time
from typing import Any

from .connectors import FULL, QUICK, KvLayer, Settings, layer_names, session
from .devmem import Dev, pattern
from .target import Target


def pd_session(
    dev: Dev,
    tgt: Target,
    metadata: str,
    transports: tuple[str, ...],
    quick: bool,
    torch: Any,
    bad: list[str],
) -> dict[str, Any]:
    """Push (each layer written by its kernel, then ``save_kv_layer`` at once, fenced by the
    session's producer) and pull between this prefill session and the target's decode one."""
    from mooncake_connectors.pd.params import prompt_hash
    from mooncake_connectors.pd.plan import PushSendStep, StepPlan
    from mooncake_connectors.transfer_core.cuda_driver import Fence

    geo = QUICK if quick else FULL
    layers = {name: KvLayer(dev, geo, torch) for name in layer_names(geo)}
    prefill = session(Settings(metadata, transports), "gpucheck-p", geo)
    if torch is not None:
        from mooncake_connectors.adapters.cuda_streams import stream_fence

        prefill.producer = stream_fence(next(iter(layers.values())).tensor.device)  # PDWorker's
    else:
        prefill.producer = lambda: Fence(dev.device, 0)  # the legacy stream, the kernels' here
    host = dev.host_alloc(next(iter(layers.values())).n)
    out: dict[str, Any] = {}
    try:
        prefill.register({k: v.tensor for k, v in layers.items()}, 0)
        tgt.call("pd_open", geo=geo, metadata=metadata, transports=list(transports))
        k = geo["blocks"] // 4
        src, dst = list(range(2, 2 + k)), list(range(geo["blocks"] - k, geo["blocks"]))
        tokens = k * geo["block_size"]
        ph = prompt_hash(list(range(tokens)))
        tgt.call(
            "pd_push_recv",
            request_id="d-push",
            blocks=dst,
            num_tokens=tokens,
            prompt_hash=ph,
            push_id="push-1",
            engine_id="gpucheck-p",
            side_channel=prefill.side_channel,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the decode's target first: writes per layer
            p = prefill._pushes.get("push-1")
            if p is not None and p.target is not None:
                break
            time.sleep(0.01)
        plan = StepPlan(push_send=[PushSendStep("p-push", "push-1", src, k, tokens, ph, True)])
        data = {}
        for i, (name, layer) in enumerate(layers.items()):
            data[name] = pattern(200 + i, layer.n)
            layer.produce(data[name], host)  # this layer's kernel, landing later
            prefill.save_kv_layer(name, plan)  # its push starts now
        prefill.start_load_kv(plan)
        prefill.wait_for_save()
        got = tgt.call("pd_wait", request_id="d-push", blocks=dst, timeout=60)
        want = {name: layer.blocks_of(data[name], src) for name, layer in layers.items()}
        out["push"] = _verdict(got, want)
        dev.sync()
        # pull: the decode reads other blocks of the (landed) prefill KV into its own
        tgt.call("pd_zero")
        src2, dst2 = list(range(k + 2, 2 * k + 2)), list(range(1, k + 1))
        tgt.call(
            "pd_pull",
            request_id="d-pull",
            blocks=dst2,
            remote_blocks=src2,
            engine_id="gpucheck-p",
            remote_request_id="p-pull",
            num_tokens=tokens,
            prompt_hash=ph,
            side_channel=prefill.side_channel,
        )
        got = tgt.call("pd_wait", request_id="d-pull", blocks=dst2, timeout=60)
        want = {name: layer.blocks_of(data[name], src2) for name, layer in layers.items()}
        out["pull"] = _verdict(got, want)
        out["prefill_guards_ok"] = all(layer.check([])[1] for layer in layers.values())
    finally:
        prefill.shutdown()
        dev.host_free(host)
        for layer in layers.values():
            layer.free()
    for case in ("push", "pull"):
        if not out.get(case, {}).get("bytes_and_guards_ok"):
            bad.append(f"pd session {case} over {'+'.join(transports)}: {out.get(case)}")
    if not out.get("prefill_guards_ok"):
        bad.append(f"pd session over {'+'.join(transports)}: a prefill guard band was touched")
    return out


def _verdict(got: dict[str, Any], want: dict[str, str]) -> dict[str, Any]:
    ok = got["done"] and not got["errors"] and got["sha"] == want
    return {
        "bytes_and_guards_ok": bool(ok and got["guards_ok"] and got["others_zero"]),
        "done": got["done"],
        "load_errors": len(got["errors"]),
        "layers_ok": sum(got["sha"].get(n) == w for n, w in want.items()),
        "others_untouched": got["others_zero"],
    }


def store(
    dev: Dev, tgt: Target, transports: tuple[str, ...], quick: bool, torch: Any, bad: list[str]
) -> dict[str, Any]:
    """The store worker's save and load on CUDA KV: every block's planes put from this KV cache
    (``batch_put_from``), then read back into other blocks (``batch_get_into``)."""
    import numpy as np

    from mooncake_connectors.pd.layout import layer_layouts, register_spans
    from mooncake_connectors.store import ClientConfig, StoreClient

    geo = QUICK if quick else FULL
    names = layer_names(geo)
    layers = {name: KvLayer(dev, geo, torch) for name in names}
    master = tgt.call("store_open", memory=64 << 20 if quick else 512 << 20)["master"]
    out: dict[str, Any] = {}
    try:
        data = {}
        for i, (name, layer) in enumerate(layers.items()):
            data[name] = pattern(300 + i, layer.n)
            k = geo["blocks"] // 2  # blocks of the upper half stay zero, to be read into
            data[name].reshape(2, geo["blocks"], -1)[:, k:] = 0
            dev.put(layer.addr, data[name])
        lays = [lay for n in names for lay in layer_layouts(n, layers[n].tensor, geo["blocks"])]
        k = geo["blocks"] // 4
        src, dst = list(range(1, 1 + k)), list(range(geo["blocks"] - k, geo["blocks"]))
        keys = [f"gpucheck/{'+'.join(transports)}/{b}/{lay.name}" for b in src for lay in lays]
        with StoreClient(ClientConfig(master=master, transports=transports)) as c:
            for addr, size in register_spans(lays):
                c.register_buffer(addr, size, location=f"cuda:{dev.device}")
            put = c.batch_put_from(
                keys,
                [lay.addr + b * lay.stride for b in src for lay in lays],
                [lay.block_bytes for _ in src for lay in lays],
            )
            got = c.batch_get_into(
                keys,
                [lay.addr + b * lay.stride for b in dst for lay in lays],
                [lay.block_bytes for _ in dst for lay in lays],
            )
        sizes = [lay.block_bytes for _ in dst for lay in lays]
        checks = {}
        for name, layer in layers.items():
            sha, guards, _ = layer.check(dst)
            want = layer.blocks_of(data[name], src)
            mine = layer.dev.get(layer.addr, layer.n).reshape(2, geo["blocks"], -1)
            others = [b for b in range(geo["blocks"]) if b not in set(dst)]
            kept = bool(
                np.array_equal(mine[:, others], data[name].reshape(2, geo["blocks"], -1)[:, others])
            )
            checks[name] = sha == want and guards and kept
        out = {
            "puts_ok": put == [None] * len(keys),
            "gets_ok": got == sizes,
            "layers_ok": sum(checks.values()),
            "first_error": next((repr(e) for e in put if e is not None), None),
            "bytes_and_guards_ok": put == [None] * len(keys)
            and got == sizes
            and all(checks.values()),
        }
    finally:
        for layer in layers.values():
            layer.free()
    if not out.get("bytes_and_guards_ok"):
        bad.append(f"store over {'+'.join(transports)}: {out}")
    return out
