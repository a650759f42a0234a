"""Small commands: version, plugins, the demo, the simulator, the fuzzer, the soak."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from .common import (
    Output,
    Verbose,
    WorkDir,
    app,
    emit,
    progress_bar,
    setup_logging,
    split_urls,
)


@app.command()
def version() -> None:
    """Print the package version."""
    from .. import __version__

    typer.echo(__version__)


@app.command()
def plugins() -> None:
    """List the transports and metadata backends found through entry points."""
    from ..transfer_core.metadata import METADATA_BACKENDS
    from ..transfer_core.transport import TRANSPORTS

    typer.echo(
        json.dumps({"transports": TRANSPORTS.names(), "metadata": METADATA_BACKENDS.names()})
    )


@app.command()
def demo(
    prompts: Annotated[int, typer.Option(min=1, max=64, help="Prompts sent each way.")] = 8,
    min_tokens: Annotated[int, typer.Option(min=1, help="Shortest prompt, in tokens.")] = 1024,
    max_prompt_tokens: Annotated[
        int, typer.Option(min=1, max=8192, help="Longest prompt, in tokens.")
    ] = 4096,
    max_tokens: Annotated[int, typer.Option(min=1, help="Tokens generated per request.")] = 32,
    interval: Annotated[
        float,
        typer.Option(min=0.0, help="Seconds between the overlapping run's prompts."),
    ] = 0.1,
    layers: Annotated[int, typer.Option(min=1, max=64, help="Layers of the local model.")] = 8,
    hidden: Annotated[
        int, typer.Option(min=64, max=4096, help="Hidden size of the local model (x64).")
    ] = 512,
    dtype: Annotated[
        str,
        typer.Option(help="The model's and the engines' dtype: float32 or bfloat16."),
    ] = "float32",
    store: Annotated[
        bool,
        typer.Option(help="Start the store; the prefill engine saves to it and loads from it."),
    ] = True,
    work_dir: WorkDir = None,
    output: Annotated[
        str | None, typer.Option("--output", "-o", help="Also write the JSON report here.")
    ] = None,
    verbose: Verbose = 0,
) -> None:
    """Prefill/decode disaggregation end to end: tiny model, store, two vLLM engines, proxy."""
    setup_logging(verbose)
    import importlib.util
    from pathlib import Path

    from rich.console import Console

    from ..bench.demo import render, run_demo

    if importlib.util.find_spec("vllm") is None:
        typer.echo("error: the demo needs vLLM here: scripts/bootstrap --vllm", err=True)
        raise typer.Exit(2)
    console = Console(stderr=True, log_path=False)
    try:
        with console.status("starting") as status:

            def say(msg: str) -> None:
                status.update(msg)
                console.log(msg)

            report = run_demo(
                prompts=prompts,
                min_tokens=min_tokens,
                max_prompt_tokens=max_prompt_tokens,
                max_tokens=max_tokens,
                interval=interval,
                layers=layers,
                hidden=hidden,
                dtype=dtype,
                store=store,
                work_dir=Path(work_dir) if work_dir else None,
                say=say,
            )
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    if output:
        with open(output, "w") as fh:
            fh.write(json.dumps(report, indent=2) + "\n")
    typer.echo(render(report))
    if not report["all_identical"]:
        typer.echo("error: some disaggregated answers differ from the single engine", err=True)
        raise typer.Exit(1)


@app.command()
def simulate(
    trace: Annotated[str, typer.Option(help="Mooncake-format trace (JSON lines).")],
    prefill: Annotated[int, typer.Option(min=1, help="Prefill instances.")] = 16,
    decode: Annotated[int, typer.Option(min=1, help="Decode instances.")] = 8,
    policy: Annotated[
        list[str] | None,
        typer.Option(help="Preset or PLACEMENT+ADMISSION; repeatable; default: every preset."),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of random placement and model noise.")] = 0,
    limit: Annotated[int | None, typer.Option(min=1, help="Replay the first N requests.")] = None,
    speedup: Annotated[float, typer.Option(min=0.01, help="Divide arrival times by this.")] = 1.0,
    ttft_slo: Annotated[float, typer.Option(min=0.001, help="TTFT SLO, seconds.")] = 30.0,
    tbt_slo: Annotated[
        list[float] | None,
        typer.Option(help="TBT SLO, seconds (mean of slowest 10% gaps); repeatable; .1 .2 .3"),
    ] = None,
    threshold: Annotated[
        float, typer.Option(min=1.0, help="Algorithm 1's kvcache_balancing_threshold.")
    ] = 1.5,
    prefill_mfu: Annotated[
        float, typer.Option(min=0.01, max=1.0, help="Prefill speed, fraction of peak FLOP/s.")
    ] = 0.2,
    nic_gbps: Annotated[float, typer.Option(min=0.1, help="Node KV bandwidth, Gbit/s.")] = 400.0,
    cache_blocks: Annotated[
        int, typer.Option(min=1, help="Prefill node DRAM pool in 512-token blocks.")
    ] = 8000,
    plot: Annotated[str | None, typer.Option(help="Write a PNG of TTFT CDFs here.")] = None,
    output: Annotated[str | None, typer.Option("--output", "-o", help="Also write JSON.")] = None,
    progress: Annotated[bool, typer.Option(help="Progress bar on stderr.")] = True,
) -> None:
    """Replay a trace through the conductor in simulated time (LLaMA2-70B on 8x A800 models)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..conductor.replay import ReplayOptions, replay
    from ..errors import ConfigError

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    try:
        opts = ReplayOptions(
            trace=trace, prefill=prefill, decode=decode, policies=tuple(policy or ()), seed=seed,
            limit=limit, speedup=speedup, ttft_slo_s=ttft_slo, tbt_slos_s=tuple(tbt_slo or ()),
            threshold=threshold, prefill_mfu=prefill_mfu, nic_gbps=nic_gbps,
            cache_blocks=cache_blocks, plot=plot,
        )  # fmt: skip
        with Progress(*columns, console=Console(stderr=True), disable=not progress) as bar:
            task = bar.add_task("replay", total=None)

            def tick(name: str, done: int, total: int) -> None:
                bar.update(task, completed=done, total=total, description=f"replay {name}")

            result = replay(opts, tick)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    emit(result, output)


@app.command()
def fuzz(
    frames: Annotated[int, typer.Option(min=1, help="Frames sent to each port.")] = 100_000,
    port: Annotated[
        list[str] | None,
        typer.Option(help="Targets to fuzz (te, master, load, metadata, side, grant, proxy); all."),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the frame generator (a run replays).")] = 0,
    output: Output = None,
    verbose: Verbose = 0,
) -> None:
    """Hostile frames at every listening port, each target in its own process (JSON report);
    exits 1 when any port crashed, stopped serving, grew its memory or wrote outside a region."""
    setup_logging(verbose)
    from ..bench.fuzz import run_fuzz
    from ..bench.fuzz_frames import PORTS

    kinds = split_urls(port or []) or list(PORTS)
    unknown = [k for k in kinds if k not in PORTS]
    if unknown:
        raise typer.BadParameter(f"unknown target(s) {unknown}; known: {list(PORTS)}")
    with progress_bar("fuzz") as advance:
        result = run_fuzz(frames, kinds, seed=seed, progress=lambda _p, n, t: advance(n, t))
    emit(result, output)
    if not result["ok"]:
        raise typer.Exit(1)


@app.command()
def soak(
    minutes: Annotated[float, typer.Option(min=0.5, help="How long to run.")] = 30.0,
    rate: Annotated[float, typer.Option(min=1, max=1000, help="Operations per second.")] = 40.0,
    fault_every: Annotated[float, typer.Option(min=5, help="Seconds between faults.")] = 20.0,
    seed: Annotated[int, typer.Option(help="Seed of the workload and the faults.")] = 0,
    output: Output = None,
    verbose: Verbose = 0,
) -> None:
    """Mixed store + TE workload with server kills, master restarts and link flaps on a
    schedule (JSON report); exits 1 when an acknowledged put was lost or a read was wrong."""
    setup_logging(verbose)
    from ..bench.soak import run_soak

    result = run_soak(minutes, rate=rate, fault_every=fault_every, seed=seed)
    emit(result, output)
    if result["acknowledged_puts_lost"] or result["corrupt_reads"]:
        raise typer.Exit(1)
