"""``mooncake-connectors p2p …``: publish and fetch checkpoints through the P2P store."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    from ..p2p import P2PStore

from .common import (
    Verbose,
    app,
    serve_until_stopped,
    setup_logging,
)

p2p_app = typer.Typer(
    help="P2P store: swarm distribution of checkpoints and weights.", no_args_is_help=True
)
app.add_typer(p2p_app, name="p2p")

Metadata = Annotated[
    str | None,
    typer.Option(help="Metadata service: http://… (default, embedded), etcd://… or memory://…."),
]
Host = Annotated[str, typer.Option(help="Address to bind and advertise.")]
Token = Annotated[
    str | None,
    typer.Option(
        envvar="MOONCAKE_CONNECTORS_TOKEN",
        help="The engines' shared secret: guards tcp, metadata and grants (>= 8 characters).",
    ),
]
Rate = Annotated[str | None, typer.Option(help="Egress budget while serving, bytes/s (e.g. 100M).")]
ServeCap = Annotated[str | None, typer.Option(help="Most bytes served to any one peer.")]
Lease = Annotated[float, typer.Option(min=0.5, help="Seconds a silent holder stays listed.")]
AsJson = Annotated[bool, typer.Option("--json", help="Print the result as JSON only.")]


def _p2p_store(
    metadata: str | None,
    host: str,
    token: str | None,
    rate: str | None = None,
    serve_cap: str | None = None,
    lease: float = 10.0,
) -> P2PStore:
    from ..config import engine_config_from_env
    from ..p2p import P2PStore
    from ..store.config import parse_size

    over: dict[str, object] = {"host": host}
    if metadata:
        over["metadata"] = metadata
    if token:
        over["auth_token"] = token
    return P2PStore(
        engine_config_from_env(None, **over),
        rate=parse_size(rate) if rate else None,
        serve_cap=parse_size(serve_cap) if serve_cap else None,
        lease=lease,
    )


def _p2p_errors(fn: Callable[..., None]) -> Callable[..., None]:
    """The package's errors as one line and exit status 1, not a traceback."""
    import functools

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> None:
        from ..errors import MooncakeConnectorsError

        try:
            fn(*args, **kwargs)
        except MooncakeConnectorsError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from exc

    return run


@p2p_app.command("publish")
@_p2p_errors
def p2p_publish(
    paths: Annotated[list[str], typer.Argument(help="Files or directories to publish.")],
    name: Annotated[str, typer.Option("--name", help="Name fetchers ask for.")],
    chunk_size: Annotated[str, typer.Option(help="Chunk size.")] = "4M",
    metadata: Metadata = None,
    host: Host = "127.0.0.1",
    auth_token: Token = None,
    rate: Rate = None,
    serve_cap: ServeCap = None,
    lease: Lease = 10.0,
    as_json: AsJson = False,
    verbose: Verbose = 0,
) -> None:
    """Publish PATHS as a new version of NAME and serve it until interrupted (SIGTERM, ^C)."""
    setup_logging(verbose)
    from ..store.config import parse_size

    node = _p2p_store(metadata, host, auth_token, rate, serve_cap, lease)
    try:
        m = node.publish(name, paths, chunk_size=parse_size(chunk_size))
        info = {
            "name": m.name,
            "version": m.version,
            "files": len(m.files),
            "total_size": m.total_size,
            "chunks": len(m.chunks),
            "pid": os.getpid(),
        }
        typer.echo(
            json.dumps(info)
            if as_json
            else f"serving {m.name} v{m.version}: {len(m.files)} files, {m.total_size} bytes, "
            f"{len(m.chunks)} chunks (stop with ^C)"
        )
        sys.stdout.flush()
        serve_until_stopped()
    finally:
        node.close()


@p2p_app.command("fetch")
@_p2p_errors
def p2p_fetch(
    name: Annotated[str, typer.Argument(help="Published name.")],
    dest: Annotated[str, typer.Argument(help="Directory to fetch into (resumes what is there).")],
    version: Annotated[int | None, typer.Option(help="Pin a version (default: newest).")] = None,
    k: Annotated[int, typer.Option(min=1, help="Requests in flight per holder.")] = 4,
    parallel: Annotated[int, typer.Option(min=1, help="Requests in flight in all.")] = 8,
    timeout: Annotated[float, typer.Option(min=1, help="Give up after this many seconds.")] = 600,
    seed: Annotated[
        bool, typer.Option(help="Keep serving what was fetched until interrupted.")
    ] = False,
    metadata: Metadata = None,
    host: Host = "127.0.0.1",
    auth_token: Token = None,
    rate: Rate = None,
    serve_cap: ServeCap = None,
    lease: Lease = 10.0,
    as_json: AsJson = False,
    verbose: Verbose = 0,
) -> None:
    """Fetch NAME into DEST from every holder, verifying each chunk and serving it onward."""
    setup_logging(verbose)
    import dataclasses

    from ..p2p import FetchStats

    node = _p2p_store(metadata, host, auth_token, rate, serve_cap, lease)
    try:
        if as_json:
            stats = node.fetch(name, dest, version=version, k=k, parallel=parallel, timeout=timeout)
        else:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TransferSpeedColumn,
            )

            with Progress(
                TextColumn(f"[bold]{name}"),
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                TextColumn("{task.fields[peers]} peers"),
                console=Console(stderr=True),
            ) as bar:
                task = bar.add_task(name, total=None, peers=0)

                def show(s: FetchStats) -> None:
                    bar.update(task, completed=s.done_bytes, total=s.total_bytes, peers=s.peers)

                stats = node.fetch(
                    name,
                    dest,
                    version=version,
                    k=k,
                    parallel=parallel,
                    timeout=timeout,
                    on_progress=show,
                )
        result = dataclasses.asdict(stats)
        typer.echo(
            json.dumps(result)
            if as_json
            else f"{name} v{stats.version}: {stats.fetched} chunks fetched, {stats.verified} "
            f"already here, {stats.corrupt} corrupt refetched, {stats.seconds:.1f}s"
        )
        sys.stdout.flush()
        if seed:
            serve_until_stopped()
    finally:
        node.close()


@p2p_app.command("ls")
@_p2p_errors
def p2p_ls(
    metadata: Metadata = None,
    host: Host = "127.0.0.1",
    auth_token: Token = None,
    as_json: AsJson = False,
) -> None:
    """List published objects: version, size, chunks, live holders."""
    import dataclasses

    node = _p2p_store(metadata, host, auth_token)
    try:
        rows = node.ls()
    finally:
        node.close()
    if as_json:
        typer.echo(json.dumps([dataclasses.asdict(r) for r in rows]))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table("name", "version", "files", "bytes", "chunks", "holders", "complete")
    for r in rows:
        table.add_row(
            r.name,
            str(r.version),
            str(r.files),
            str(r.total_size),
            str(r.chunks),
            str(r.holders),
            str(r.complete_holders),
        )
    Console().print(table)


@p2p_app.command("unpublish")
@_p2p_errors
def p2p_unpublish(
    name: Annotated[str, typer.Argument(help="Published name.")],
    metadata: Metadata = None,
    host: Host = "127.0.0.1",
    auth_token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Forget every version of NAME; its holders stop serving it at their next renewal."""
    node = _p2p_store(metadata, host, auth_token)
    try:
        gone = node.unpublish(name)
    finally:
        node.close()
    typer.echo(
        json.dumps({"name": name, "keys_removed": gone})
        if as_json
        else f"unpublished {name} ({gone} records removed)"
    )
