"""``mooncake-connectors bench moe``: the MoE router, placement and engine-EPLB measurements."""

from __future__ import annotations

from typing import Annotated

import typer

from .common import Output, Verbose, bench_app, emit, setup_logging, split_csv


@bench_app.command("moe")
def bench_moe(
    rounds: Annotated[
        int, typer.Option(min=1, max=100000, help="Routing repetitions; median reported.")
    ] = 100,
    seed: Annotated[int, typer.Option(help="Seed of the synthetic Zipf loads.")] = 0,
    threads: Annotated[
        int, typer.Option(min=0, max=1024, help="torch intra-op threads (0: torch's default).")
    ] = 0,
    only: Annotated[
        str, typer.Option(help="Sections to run: routing,placement,balance,vllm,sglang.")
    ] = "routing,placement,balance,vllm,sglang",
    engine_experts: Annotated[
        int, typer.Option(min=2, max=4096, help="SGLang row: logical experts per layer.")
    ] = 256,
    engine_cases: Annotated[
        str, typer.Option(help="SGLang row: cases RANKSxSLOTSxNODESxGROUPS, comma-separated.")
    ] = "32x288x1x8,32x288x4x8,64x320x8x8",
    output: Output = None,
    verbose: Verbose = 0,
) -> None:
    """MoE router: routing µs vs plain indexing, placement ms, balance vs DeepSeek's EPLB, and
    our placement inside vLLM's and SGLang's EPLB."""
    setup_logging(verbose)
    from ..bench.moe import parse_cases, run_moe_benchmark
    from ..errors import ConfigError

    try:
        result = run_moe_benchmark(
            rounds=rounds,
            seed=seed,
            threads=threads,
            only=tuple(split_csv(only)),
            engine_experts=engine_experts,
            engine_cases=parse_cases(engine_cases),
        )
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    emit(result, output)
