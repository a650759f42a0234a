"""SGLang's Mooncake PD disaggregation engine-free: two role processes, and ``bench sglang-pd``.

A :class:`Pair` starts a prefill and a decode process (:mod:`.sglang_pd_role`), each building
SGLang's own ``MooncakeKVManager`` over CPU buffers, and drives one request at a time through
SGLang's classes: the decode's ``MooncakeKVReceiver`` (``init``, ``send_metadata``), the prefill's
``MooncakeKVSender`` (``init``, ``send`` of the page indices), both polled to the end. Systems:

  ours        the alias on (``MOONCAKE_CONNECTORS_AS_MOONCAKE=1``): SGLang's ``from mooncake.engine
              import TransferEngine`` gets our facade, protocol tcp (same-host peers over shm)
  ours_tcp    the same, TCP only (``MOONCAKE_CONNECTORS_TRANSPORTS=tcp``), as Mooncake's tcp
  mooncake    the alias off: Mooncake's wheel, protocol tcp

Everything binds 127.0.0.1: SGLang's bootstrap server and ZMQ sockets take the host they are
given (``host``, ``SGLANG_HOST_IP``), Mooncake's tcp listener ``MC_TCP_BIND_ADDRESS``.

The benchmark runs the systems side by side (one pair each, all alive at once), rounds
interleaved so machine noise hits all alike; round 0 warms up and is dropped. Per case and
system: p50/p99 of one request's transfer (the prefill's ``send`` to its ``Success``), GB/s and
pages/s from the median. Ratios: ours ÷ mooncake and ours_tcp ÷ mooncake; against Mooncake's tcp
the like-for-like figure is ours_tcp's.
"""

from __future__ import annotations

import concurrent.futures
import os
import statistics
import time
from typing import Any

from .ports import free_port
from .procs import RoleProc, loadavg, machine

MARK = "@@sglang-pd "  # the role process's reply prefix (sglang_pd_role.MARK)
ROLE_MODULE = "mooncake_connectors.bench.sglang_pd_role"
SYSTEMS = ("ours", "ours_tcp", "mooncake")
KV_POLL = {0: "Failed", 1: "Bootstrapping", 2: "WaitingForInput", 3: "Transferring", 4: "Success"}

# name -> (layers, kv heads, head dim, page tokens); bf16 K and V, SGLang's MHA pool layout
GEOMETRIES: dict[str, tuple[int, int, int, int]] = {
    "small": (24, 2, 64, 64),  # Qwen2.5-0.5B-like: 16 KiB per page per K or V buffer
    "llama8b": (32, 8, 128, 64),  # Llama-3-8B at TP1: 128 KiB per page per buffer
}


def role_env(system: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a role process of ``system``."""
    if system not in SYSTEMS:
        raise ValueError(f"system must be one of {', '.join(SYSTEMS)}, got {system!r}")
    env = dict(os.environ)
    for k in ("MOONCAKE_CONNECTORS_AS_MOONCAKE", "MOONCAKE_CONNECTORS_TRANSPORTS"):
        env.pop(k, None)
    env.update(
        SGLANG_HOST_IP="127.0.0.1",  # SGLang's get_local_ip_auto: its ZMQ binds and session ids
        MOONCAKE_PROTOCOL="tcp",  # SGLang's default is rdma
        MC_TCP_BIND_ADDRESS="127.0.0.1",  # Mooncake's tcp listener binds 0.0.0.0 otherwise
        SGLANG_PLUGINS="mooncake_connectors",  # SGLang's plugin whitelist: ours only, not others
        NO_PROXY="127.0.0.1,localhost",
        no_proxy="127.0.0.1,localhost",
    )
    if system != "mooncake":
        env["MOONCAKE_CONNECTORS_AS_MOONCAKE"] = "1"
    if system == "ours_tcp":
        env["MOONCAKE_CONNECTORS_TRANSPORTS"] = "tcp"
    env.update(extra or {})
    return env


class Pair:
    """A prefill and a decode process of ``system`` over pools of ``pages`` pages."""

    def __init__(
        self,
        system: str,
        *,
        layers: int,
        heads: int,
        head_dim: int,
        page_tokens: int,
        pages: int,
        aux_slots: int = 8,
        aux_bytes: int = 256,
        env: dict[str, str] | None = None,
        start_timeout: float = 600.0,
    ) -> None:
        self.system = system
        page_bytes = page_tokens * heads * head_dim * 2  # bf16
        self.page_bytes, self.layers = page_bytes, layers
        self.bootstrap_port = free_port()
        base = dict(
            layers=layers,
            heads=heads,
            page_tokens=page_tokens,
            page_bytes=page_bytes,
            pages=pages,
            aux_slots=aux_slots,
            aux_bytes=aux_bytes,
            bootstrap_port=self.bootstrap_port,
        )
        self.environ = role_env(system, env)
        self.base, self.start_timeout = base, start_timeout
        self.procs: list[RoleProc] = []
        try:
            # Both start at once (importing SGLang dominates); the decode contacts the prefill's
            # bootstrap server only per request.
            self.prefill = self._start("prefill")
            self.decode = self._start("decode")
            self.prefill_info = self.prefill.reply(start_timeout)
            self.decode_info = self.decode.reply(start_timeout)
        except BaseException:
            self.close()
            raise
        self._room = 0

    def _start(self, role: str) -> RoleProc:
        cfg = {**self.base, "role": role, "http_port": free_port()}
        proc = RoleProc(ROLE_MODULE, MARK, cfg, self.environ)
        self.procs.append(proc)
        return proc

    def restart_decode(self) -> None:
        """A fresh decode process (the old one killed or stopped) for the same prefill."""
        self.decode.stop()
        self.decode = self._start("decode")
        self.decode_info = self.decode.reply(self.start_timeout)

    def next_room(self) -> int:
        self._room += 1
        return self._room

    def post_metadata(self, room: int, dst: list[int], aux: int, timeout: float = 60.0) -> None:
        got = self.decode.call(
            {"op": "recv", "room": room, "pages": dst, "aux_index": aux}, timeout
        )
        if got["status"] == 0:
            raise RuntimeError(f"decode receiver failed at send_metadata: {got}")

    def transfer(
        self,
        src: list[int],
        dst: list[int],
        *,
        aux_src: int = 0,
        aux_dst: int = 0,
        chunk: int = 0,
        timeout: float = 60.0,
    ) -> dict[str, Any]:
        """One request: the decode posts ``dst``, the prefill sends ``src``; both outcomes."""
        room = self.next_room()
        self.post_metadata(room, dst, aux_dst, timeout)
        sent = self.prefill.call(
            {"op": "send", "room": room, "pages": src, "aux_index": aux_src, "chunk": chunk},
            timeout,
        )
        got = self.decode.call({"op": "wait", "room": room}, timeout)
        return {"room": room, "prefill": sent, "decode": got}

    def close(self) -> None:
        for p in reversed(self.procs):
            p.stop()


def _pages(n: int, run: int, offset: int) -> list[int]:
    """``n`` page indices in runs of ``run`` consecutive pages with a one-page gap between."""
    out: list[int] = []
    p = offset
    while len(out) < n:
        out.extend(range(p, p + run))
        p += run + 1
    return out[:n]


def _ratios(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    ratios: dict[str, dict[str, float]] = {"ours_tcp_vs_mooncake": {}, "ours_vs_mooncake": {}}
    for case, row in results.items():
        for ours in ("ours_tcp", "ours"):
            if ours in row and "mooncake" in row:
                ratios[f"{ours}_vs_mooncake"][case] = round(
                    row[ours]["gb_s"] / row["mooncake"]["gb_s"], 2
                )
    return ratios


def _pattern_benchmark(
    cases: str, pages: int, run: int, requests: int, rounds: int, chosen: list[str]
) -> dict[str, Any]:
    from .sglang_pd_pattern import run_pattern

    results: dict[str, Any] = {}
    for case in [c.strip() for c in cases.split(",") if c.strip()]:
        if case not in GEOMETRIES:
            raise ValueError(f"unknown case {case!r}; choose from {', '.join(GEOMETRIES)}")
        layers, heads, dim, tokens = GEOMETRIES[case]
        row = run_pattern(
            systems=chosen,
            layers=layers,
            item=tokens * heads * dim * 2,
            src=_pages(pages, run, 0),
            dst=_pages(pages, run, 1),
            requests=requests,
            rounds=rounds,
        )
        results[case] = {"layers": layers, "pages_per_request": pages, "contiguous_run": run, **row}
    return {
        "benchmark": "sglang-pd --pattern",
        "what": (
            "the batch_transfer_sync_write calls SGLang's Mooncake PD sender issues for one "
            "request (every K/V layer buffer x each run of pages, then the aux row), from this "
            "process to a target process, on the same Mooncake-API script for each engine; "
            "SGLang itself not involved"
        ),
        "rounds": rounds,
        "requests_per_round": requests,
        "results": results,
        "ratios": _ratios(results),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def run_sglang_pd_benchmark(
    *,
    cases: str = "small,llama8b",
    pages: int = 16,
    run: int = 4,
    requests: int = 5,
    rounds: int = 3,
    systems: str = ",".join(SYSTEMS),
    pattern: bool = False,
) -> dict[str, Any]:
    chosen = [s.strip() for s in systems.split(",") if s.strip()]
    bad = [s for s in chosen if s not in SYSTEMS]
    if bad:
        raise ValueError(f"unknown system(s) {bad}; choose from {', '.join(SYSTEMS)}")
    if pattern:
        return _pattern_benchmark(cases, pages, run, requests, rounds, chosen)
    notes: list[str] = []
    results: dict[str, Any] = {}
    for case in [c.strip() for c in cases.split(",") if c.strip()]:
        if case not in GEOMETRIES:
            raise ValueError(f"unknown case {case!r}; choose from {', '.join(GEOMETRIES)}")
        layers, heads, dim, tokens = GEOMETRIES[case]
        src, dst = _pages(pages, run, 0), _pages(pages, run, 1)
        pool = max(src + dst) + 2
        pairs: dict[str, Pair] = {}
        try:
            # Started at once (importing SGLang dominates a start), then all alive side by side.
            with concurrent.futures.ThreadPoolExecutor(len(chosen)) as pool_starter:
                starts = {
                    system: pool_starter.submit(
                        Pair,
                        system,
                        layers=layers,
                        heads=heads,
                        head_dim=dim,
                        page_tokens=tokens,
                        pages=pool,
                    )
                    for system in chosen
                }
                for system, fut in starts.items():
                    try:
                        pairs[system] = fut.result()
                    except (RuntimeError, TimeoutError) as exc:
                        if system != "mooncake":
                            raise
                        notes.append(f"mooncake not run: {str(exc).splitlines()[0]}")
            samples: dict[str, list[float]] = {s: [] for s in pairs}
            order = list(pairs)
            for r in range(rounds + 1):
                for system in order[r % len(order) :] + order[: r % len(order)]:
                    for _ in range(requests):
                        out = pairs[system].transfer(src, dst)
                        ok = out["prefill"]["status"] == 4 and out["decode"]["status"] == 4
                        if not ok:
                            raise RuntimeError(f"{system} {case}: request failed: {out}")
                        if r:
                            samples[system].append(out["prefill"]["send_s"])
            page_bytes = pairs[order[0]].page_bytes
            nbytes = pages * page_bytes * 2 * layers
            row: dict[str, Any] = {
                "layers": layers,
                "page_tokens": tokens,
                "pages_per_request": pages,
                "contiguous_run": run,
                "bytes_per_request": nbytes,
                "blocks_per_request": 2 * layers * -(-pages // run),
                "engines": {s: p.prefill_info["engine"] for s, p in pairs.items()},
            }
            for system, xs in samples.items():
                med = statistics.median(xs)
                row[system] = {
                    "n": len(xs),
                    "p50_ms": round(med * 1e3, 3),
                    "p99_ms": round(sorted(xs)[min(len(xs) - 1, int(0.99 * len(xs)))] * 1e3, 3),
                    "gb_s": round(nbytes / med / 1e9, 3),
                    "pages_s": round(pages / med, 1),
                }
            results[case] = row
        finally:
            for p in pairs.values():
                p.close()
    ratios = _ratios(results)
    return {
        "benchmark": "sglang-pd",
        "what": (
            "SGLang's MooncakeKVSender/Receiver/Manager (unmodified) in a prefill and a decode "
            "process over CPU buffers; one request = send_metadata, then send of the pages, "
            "polled to Success; timed from the prefill's send to its Success"
        ),
        "machine": machine(),
        "loadavg": loadavg(),
        "rounds": rounds,
        "requests_per_round": requests,
        "results": results,
        "ratios": ratios,
        "notes": notes,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
