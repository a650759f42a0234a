"""The ``mooncake-connectors`` command line.

Each subcommand imports what it needs inside its function so ``--help`` stays fast.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Annotated, Any

import typer

from .config import DEFAULT_TRANSPORTS

if TYPE_CHECKING:
    from .p2p import P2PStore
    from .tls import TlsConfig

app = typer.Typer(
    name="mooncake-connectors",
    help="Mooncake's KV-cache transfer engine, store and scheduler as engine plugins.",
    no_args_is_help=True,
    add_completion=False,
)
bench_app = typer.Typer(help="Benchmarks (JSON on stdout).", no_args_is_help=True)
app.add_typer(bench_app, name="bench")
certs_app = typer.Typer(help="Development certificates for TLS.", no_args_is_help=True)
app.add_typer(certs_app, name="certs")


def _setup_logging(verbose: int) -> None:
    level = logging.WARNING if verbose <= 0 else logging.INFO if verbose == 1 else logging.DEBUG
    from rich.logging import RichHandler

    logging.basicConfig(
        level=level,
        format="%(name)s: %(message)s",
        handlers=[RichHandler(console=None, show_path=False, rich_tracebacks=False)],
    )


@contextlib.contextmanager
def _progress(what: str) -> Iterator[Callable[[int, int], None]]:
    """A progress bar on stderr (stdout carries the JSON result)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    with Progress(
        f"[bold]{what}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as bar:
        task = bar.add_task(what, total=None)

        def advance(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield advance


def _emit(result: object, output: str | None) -> None:
    """Print ``result`` as JSON on stdout, and also write it to ``output`` when given."""
    text = json.dumps(result, indent=2)
    if output:
        with open(output, "w") as fh:
            fh.write(text + "\n")
    typer.echo(text)


Verbose = Annotated[int, typer.Option("--verbose", "-v", count=True, help="-v info, -vv debug")]
Output = Annotated[str | None, typer.Option("--output", "-o", help="Also write JSON here.")]
WorkDir = Annotated[str | None, typer.Option(help="Keep the model and the engine logs here.")]
Lengths = Annotated[str, typer.Option(help="Comma-separated prompt lengths in tokens.")]
TlsCert = Annotated[
    str | None,
    typer.Option(
        help="PEM certificate: listen and connect over TLS [MOONCAKE_CONNECTORS_TLS_CERT]."
    ),
]
TlsKey = Annotated[
    str | None, typer.Option(help="PEM key of --tls-cert [MOONCAKE_CONNECTORS_TLS_KEY].")
]
TlsCa = Annotated[
    str | None,
    typer.Option(
        help="PEM CA: peers must present a certificate it signed, which stands in for the "
        "token (mutual TLS) [MOONCAKE_CONNECTORS_TLS_CA]."
    ),
]
Rounds = Annotated[int, typer.Option(min=1, max=100, help="Prompts per length.")]
MaxTokens = Annotated[int, typer.Option(min=1, help="Tokens generated per request.")]
Layers = Annotated[int, typer.Option(min=1, help="Layers of the locally built model.")]
KvHeads = Annotated[int, typer.Option(min=1, help="KV heads of the locally built model.")]
_DEFAULT_TRANSPORTS = ",".join(DEFAULT_TRANSPORTS)
OurTransports = Annotated[
    str, typer.Option(help="Our connector's transports, in preference order.")
]


def _tls(cert: str | None, key: str | None, ca: str | None) -> TlsConfig | None:
    """The TLS files from the flags, else the environment (None: TLS off)."""
    from .config import tls_from_env
    from .errors import ConfigError

    try:
        return tls_from_env(cert, key, ca)
    except ConfigError as exc:
        raise typer.BadParameter(str(exc), param_hint="--tls-cert/--tls-key/--tls-ca") from exc


@certs_app.command("init")
def certs_init(
    directory: Annotated[str, typer.Argument(help="Where to write ca.pem and NODE.pem/.key.")],
    nodes: Annotated[str, typer.Option(help="Comma-separated node names.")] = "node",
) -> None:
    """Make a development CA (reused if DIR has one) and a certificate per node."""
    from . import certs

    paths = certs.init(directory, tuple(_csv(nodes)))
    typer.echo(json.dumps({name: str(p) for name, p in paths.items()}))


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


@app.command()
def version() -> None:
    """Print the package version."""
    from . import __version__

    typer.echo(__version__)


@app.command()
def plugins() -> None:
    """List the transports and metadata backends found through entry points."""
    from .transfer_core.metadata import METADATA_BACKENDS
    from .transfer_core.transport import TRANSPORTS

    typer.echo(
        json.dumps({"transports": TRANSPORTS.names(), "metadata": METADATA_BACKENDS.names()})
    )


@app.command()
def doctor(
    as_json: Annotated[bool, typer.Option("--json", help="Findings as a JSON list.")] = False,
    metadata: Annotated[
        str | None, typer.Option(help="Also probe this metadata URL (etcd://… or http://…).")
    ] = None,
    master: Annotated[str | None, typer.Option(help="Also probe this store master.")] = None,
) -> None:
    """What this host can use for transfers (GPUs, RDMA, /dev/shm, NUMA), and the fix for
    what it cannot: one line per finding."""
    from .transfer_core import doctor as checks

    findings = checks.run(metadata=metadata, master=master)
    if as_json:
        typer.echo(json.dumps(checks.as_json(findings), indent=2))
        return
    for f in findings:
        typer.echo(f.line())


@app.command("metadata-server")
def metadata_server(
    host: Annotated[str, typer.Option(help="Bind address (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8080,
    path: Annotated[str, typer.Option(help="URL path of the endpoint.")] = "/metadata",
    auth_token: Annotated[
        str | None,
        typer.Option(
            envvar=["MOONCAKE_CONNECTORS_TOKEN", "MOONCAKE_CONNECTORS_STORE_TOKEN"],
            help="Shared secret every request must carry as 'Authorization: Bearer' (the "
            "engines' or the store's token, >= 8 characters).",
        ),
    ] = None,
    tls_cert: TlsCert = None,
    tls_key: TlsKey = None,
    tls_ca: TlsCa = None,
    verbose: Verbose = 0,
) -> None:
    """Run the embedded HTTP metadata server (the single-machine default) in the foreground."""
    _setup_logging(max(verbose, 1))
    from .transfer_core.metadata.http import MetadataHTTPServer

    if auth_token is not None and len(auth_token) < 8:
        raise typer.BadParameter("must be at least 8 characters", param_hint="--auth-token")
    tls = _tls(tls_cert, tls_key, tls_ca)
    server = MetadataHTTPServer(host, port, path=path, token=auth_token, tls=tls)
    server.start()
    logging.getLogger("mooncake_connectors").info("metadata server on %s", server.url)
    try:
        server.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


def _split_urls(values: list[str]) -> list[str]:
    return [u.strip() for arg in values for u in arg.split(",") if u.strip()]


def _floats(text: str, n: int, what: str) -> list[float]:
    parts = [p for p in text.split(",") if p.strip()]
    if len(parts) != n:
        raise typer.BadParameter(f"{what} takes {n} comma-separated numbers, got {text!r}")
    try:
        return [float(p) for p in parts]
    except ValueError as exc:
        raise typer.BadParameter(f"{what}: {exc}") from exc


@app.command()
def proxy(
    prefill: Annotated[
        list[str], typer.Option("--prefill", help="Prefill base URL; repeat or comma-separate.")
    ],
    decode: Annotated[
        list[str], typer.Option("--decode", help="Decode base URL; repeat or comma-separate.")
    ],
    host: Annotated[str, typer.Option(help="Bind address (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    timeout: Annotated[float, typer.Option(help="Seconds allowed for one upstream call.")] = 600.0,
    policy: Annotated[
        str,
        typer.Option(
            help="round-robin, or the conductor's placement: local-cache (cache-aware), "
            "load-balance, random; with the store (--store-master, --store-keys) also "
            "global-cache and adaptive, which load prefixes from the store."
        ),
    ] = "round-robin",
    admission: Annotated[
        str, typer.Option(help="When to answer 429: none, early, predictive, adaptive.")
    ] = "early",
    ttft_slo: Annotated[float, typer.Option(help="TTFT SLO in seconds.")] = 10.0,
    tbt_slo: Annotated[float, typer.Option(help="Time-between-tokens SLO in seconds.")] = 1.0,
    kv_events: Annotated[
        list[str] | None,
        typer.Option(
            "--kv-events",
            help="PREFILL_URL=ENDPOINT of that engine's KV event publisher (ipc://PATH or "
            "tcp://HOST:PORT); one per prefill instance.",
        ),
    ] = None,
    cache_source: Annotated[
        str,
        typer.Option(
            help="events (vLLM KV events, needs --kv-events) or optimistic (the proxy's own "
            "placements, never evicted: a guess)."
        ),
    ] = "events",
    block_size: Annotated[
        int | None, typer.Option(help="Engine KV block size (default: read from /metrics).")
    ] = None,
    prefill_model: Annotated[
        str | None,
        typer.Option(help="A,B,C of prefill seconds = A + B*new + C*(n^2-p^2); default: profile."),
    ] = None,
    decode_model: Annotated[
        str | None,
        typer.Option(help="BASE,PER_SEQ,PER_KV_TOKEN,CAPACITY_TOKENS of a decode step."),
    ] = None,
    expected_output_tokens: Annotated[
        float, typer.Option(help="Output length assumed until finished requests teach it.")
    ] = 64.0,
    metrics_interval: Annotated[
        float, typer.Option(help="Seconds between polls of the instances' /metrics.")
    ] = 1.0,
    learn_instance_speed: Annotated[
        bool,
        typer.Option(
            help="Scale each prefill instance's estimates by how slow its prefill legs really "
            "ran (instances that share hardware or drift from their profile)."
        ),
    ] = False,
    store_master: Annotated[
        str | None,
        typer.Option(help="The store's master (host:port or etcd://...): the global cache index."),
    ] = None,
    store_keys: Annotated[
        str | None,
        typer.Option(
            help="Store key of one layer of a block, {block} for the block hash, e.g. "
            "vllm/MODEL/LAYOUT/tp0-1.pp0-1/{block}/model.layers.0.self_attn.attn."
        ),
    ] = None,
    store_load: Annotated[
        str | None,
        typer.Option(help="PER_TOKEN_S,LATENCY_S of a store load (default: measured at start)."),
    ] = None,
    layerwise_push: Annotated[
        bool,
        typer.Option(
            help="Run both legs at once and have the prefill push each layer's KV into the "
            "decode's blocks as it is computed (decode instances need accept_push)."
        ),
    ] = False,
    tls_cert: TlsCert = None,
    tls_key: TlsKey = None,
    tls_ca: TlsCa = None,
    verbose: Verbose = 0,
) -> None:
    """OpenAI-compatible PD proxy: prefill leg, then decode leg with the KV transfer params."""
    _setup_logging(verbose)
    try:
        from .conductor.proxy import run_proxy
    except ImportError as exc:
        raise SystemExit(
            f"the proxy needs aiohttp ({exc}): pip install 'mooncake-connectors[proxy]'"
        ) from exc
    from .conductor.estimators import DecodeModel, PrefillModel, TransferModel
    from .conductor.live import CacheSource
    from .conductor.proxy import ConductorOptions
    from .conductor.types import Admission, PlacementPolicy
    from .errors import ConfigError

    prefill = _split_urls(prefill)
    decode = _split_urls(decode)
    options = None
    if policy != "round-robin":
        events: dict[str, str] = {}
        for item in kv_events or []:
            url, sep, endpoint = item.rpartition("=")
            if not sep or not url or not endpoint:
                raise typer.BadParameter(f"--kv-events takes PREFILL_URL=ENDPOINT, got {item!r}")
            events[url.rstrip("/")] = endpoint
        try:
            pm = (
                PrefillModel(*_floats(prefill_model, 3, "--prefill-model"))
                if prefill_model
                else None
            )
            dm = None
            if decode_model:
                b, s, k, cap = _floats(decode_model, 4, "--decode-model")
                dm = DecodeModel(b, s, k, int(cap))
            load = None
            if store_load:
                per_token, latency = _floats(store_load, 2, "--store-load")
                load = TransferModel(1.0 / per_token if per_token > 0 else 0.0, 1, latency)
            options = ConductorOptions(
                placement=PlacementPolicy(policy),
                admission=Admission(admission),
                ttft_slo_s=ttft_slo,
                tbt_slo_s=tbt_slo,
                cache_source=CacheSource(cache_source),
                kv_events=events,
                block_size=block_size,
                prefill_model=pm,
                decode_model=dm,
                expected_output_tokens=expected_output_tokens,
                metrics_interval_s=metrics_interval,
                learn_instance_speed=learn_instance_speed,
                store_master=store_master,
                store_keys=store_keys,
                store_load=load,
            )
        except (ValueError, ConfigError) as exc:
            raise typer.BadParameter(str(exc)) from exc
    elif kv_events or store_master or store_keys:
        raise typer.BadParameter(
            "--kv-events (or --store-*) needs a conductor policy (e.g. --policy local-cache)"
        )
    typer.echo(
        f"PD proxy on http://{host}:{port} policy={policy} prefill={prefill} decode={decode}",
        err=True,
    )
    try:
        run_proxy(
            prefill,
            decode,
            host=host,
            port=port,
            timeout=timeout,
            options=options,
            push=layerwise_push,
            tls=_tls(tls_cert, tls_key, tls_ca),
        )
    except ConfigError as exc:
        raise SystemExit(f"proxy: {exc}") from exc


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
    _setup_logging(verbose)
    import importlib.util
    from pathlib import Path

    from rich.console import Console

    from .bench.demo import render, run_demo

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
def master(
    host: Annotated[str, typer.Option(help="Bind address (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Control-plane port.")] = 50051,
    metrics_port: Annotated[
        int | None, typer.Option(help="Serve /metrics and /health on this port.")
    ] = None,
    metadata: Annotated[
        str, typer.Option(help="Engines' metadata: p2p (no service), http://… or etcd://….")
    ] = "p2p",
    ha: Annotated[
        str | None, typer.Option(help="etcd://HOST:PORT/PREFIX: elect a leader among masters.")
    ] = None,
    ha_lease_ttl: Annotated[float, typer.Option(help="Leader lease TTL in seconds.")] = 5.0,
    advertise: Annotated[
        str | None, typer.Option(help="HOST:PORT written to the leader key (default host:port).")
    ] = None,
    stripe_size: Annotated[str, typer.Option(help="Values above this are striped.")] = "64M",
    high_watermark: Annotated[float, typer.Option(help="Eviction starts above this.")] = 0.95,
    low_watermark: Annotated[float, typer.Option(help="Eviction stops at this.")] = 0.85,
    put_lease_ttl: Annotated[float, typer.Option(help="Seconds to commit a put.")] = 60.0,
    read_lease_ttl: Annotated[float, typer.Option(help="Seconds a get protects.")] = 5.0,
    heartbeat_interval: Annotated[float, typer.Option(help="Server heartbeat period.")] = 1.0,
    server_ttl: Annotated[float, typer.Option(help="Silence before a server is dead.")] = 5.0,
    promote_hits: Annotated[
        int, typer.Option(help="Reads from SSD before an object is promoted to memory (0: never).")
    ] = 1,
    key_budget: Annotated[
        str, typer.Option(help="Bytes of keys and per-key records the master keeps.")
    ] = "2G",
    frame_timeout: Annotated[
        float, typer.Option(help="Seconds a control frame may take to arrive (plus 1 s/MiB).")
    ] = 10.0,
    auth_token: Annotated[
        str | None,
        typer.Option(
            envvar="MOONCAKE_CONNECTORS_STORE_TOKEN",
            help="Shared secret every control connection must prove; off 127.0.0.1 it also "
            "guards /metrics and /health (>= 8 characters).",
        ),
    ] = None,
    tls_cert: TlsCert = None,
    tls_key: TlsKey = None,
    tls_ca: TlsCa = None,
    verbose: Verbose = 0,
) -> None:
    """Run the store master (metadata and allocation only) in the foreground."""
    _setup_logging(max(verbose, 1))
    from .store.config import MasterConfig, parse_size
    from .store.master import Master

    cfg = MasterConfig(
        host=host,
        port=port,
        metrics_port=metrics_port,
        metadata=metadata,
        ha=ha,
        ha_lease_ttl=ha_lease_ttl,
        advertise=advertise,
        stripe_size=parse_size(stripe_size),
        high_watermark=high_watermark,
        low_watermark=low_watermark,
        put_lease_ttl=put_lease_ttl,
        read_lease_ttl=read_lease_ttl,
        heartbeat_interval=heartbeat_interval,
        server_ttl=server_ttl,
        promote_hits=promote_hits,
        key_budget=parse_size(key_budget),
        frame_timeout=frame_timeout,
        auth_token=auth_token,
        tls=_tls(tls_cert, tls_key, tls_ca),
    )
    m = Master(cfg).start()
    typer.echo(json.dumps({"master": m.address, "metrics_port": m.metrics_port}), err=True)
    try:
        m.wait()
    except KeyboardInterrupt:
        pass
    finally:
        m.close()


@app.command("store-server")
def store_server(
    memory: Annotated[str, typer.Option(help="Memory to contribute, e.g. 4G.")],
    master: Annotated[
        str, typer.Option(help="HOST:PORT, or etcd://HOST:PORT/PREFIX to follow the leader.")
    ] = "127.0.0.1:50051",
    host: Annotated[str, typer.Option(help="Address to bind and advertise.")] = "127.0.0.1",
    ssd_dir: Annotated[str | None, typer.Option(help="Spill evicted objects here.")] = None,
    ssd_size: Annotated[str, typer.Option(help="SSD budget, e.g. 100G.")] = "0",
    metadata: Annotated[
        str | None, typer.Option(help="Override the engines' metadata backend.")
    ] = None,
    auth_token: Annotated[
        str | None,
        typer.Option(
            envvar="MOONCAKE_CONNECTORS_STORE_TOKEN",
            help="Shared secret every control and data connection must prove (>= 8 characters).",
        ),
    ] = None,
    transports: Annotated[
        str,
        typer.Option(help="Transports, in preference order; without shm, control is TCP too."),
    ] = _DEFAULT_TRANSPORTS,
    tls_cert: TlsCert = None,
    tls_key: TlsKey = None,
    tls_ca: TlsCa = None,
    verbose: Verbose = 0,
) -> None:
    """Contribute memory (and SSD) to the store and hold the data, in the foreground."""
    _setup_logging(max(verbose, 1))
    import signal
    import threading

    from .config import parse_transports
    from .store.config import ServerConfig, parse_size
    from .store.server import StoreServer

    cfg = ServerConfig(
        master=master,
        memory=parse_size(memory),
        host=host,
        ssd_dir=ssd_dir,
        ssd_size=parse_size(ssd_size),
        metadata=metadata,
        auth_token=auth_token,
        transports=parse_transports(transports),
        tls=_tls(tls_cert, tls_key, tls_ca),
    )
    server = StoreServer(cfg).start()
    typer.echo(json.dumps({"segment": server.segment, "pid": os.getpid()}), err=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    try:
        while not done.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        server.close()


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
    tls: Annotated[
        bool, typer.Option(help="Also run tcp over mutual TLS (a fresh development CA).")
    ] = False,
    output: Output = None,
    verbose: Verbose = 0,
) -> None:
    """Target and initiator in two processes on loopback; GB/s per op, size and transport.
    rdma is measured apart, in µs per rdma slice against its verbs' own floor."""
    _setup_logging(verbose)
    from .bench.transfer import parse_size, run_transfer_benchmark

    names = [t.strip() for t in transports.split(",") if t.strip()]
    result: dict[str, object] = {}
    if "rdma" in names:
        from .bench.rdma import run_rdma_overhead

        names.remove("rdma")
        with _progress("bench transfer (rdma)") as advance:
            result["rdma"] = run_rdma_overhead(
                rdma_verbs, [parse_size(s) for s in sizes.split(",") if s.strip()], rounds,
                progress=advance,
            )  # fmt: skip
    if names:
        with _progress("bench transfer") as advance:
            result["transfer"] = run_transfer_benchmark(
                transports=names,
                rounds=rounds,
                sizes=sizes,
                batch=batch,
                with_mooncake=mooncake,
                progress=advance,
                tls=tls,
            )
    _emit(result.get("transfer", result) if len(result) == 1 else result, output)


@bench_app.command("moe")
def bench_moe(
    rounds: Annotated[
        int, typer.Option(min=1, max=100000, help="Routing repetitions; median reported.")
    ] = 100,
    seed: Annotated[int, typer.Option(help="Seed of the synthetic Zipf loads.")] = 0,
    threads: Annotated[
        int, typer.Option(min=0, max=1024, help="torch intra-op threads (0: torch's default).")
    ] = 0,
    output: Output = None,
    verbose: Verbose = 0,
) -> None:
    """MoE router: routing µs vs plain indexing, placement ms, balance vs DeepSeek's EPLB."""
    _setup_logging(verbose)
    from .bench.moe import run_moe_benchmark

    _emit(run_moe_benchmark(rounds=rounds, seed=seed, threads=threads), output)


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

    from .conductor.replay import ReplayOptions, replay
    from .errors import ConfigError

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
    _emit(result, output)


@bench_app.command("vllm-pd")
def bench_vllm_pd(
    lengths: Lengths = "512,1024,2048,4096,8192",
    rounds: Rounds = 3,
    max_tokens: MaxTokens = 16,
    mooncake: Annotated[
        bool, typer.Option(help="Also run vLLM's MooncakeConnector when Mooncake's wheel is there.")
    ] = True,
    layers: Layers = 4,
    kv_heads: KvHeads = 4,
    work_dir: WorkDir = None,
    transports: OurTransports = _DEFAULT_TRANSPORTS,
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
    output: Output = None,
    verbose: Verbose = 0,
) -> None:
    """vLLM prefill/decode: KV transfer time per request, ours beside vLLM's MooncakeConnector."""
    _setup_logging(verbose)
    from pathlib import Path

    from .bench.vllm_pd import run_pd_benchmark

    with _progress("bench vllm-pd") as advance:
        result = run_pd_benchmark(
            lengths=[int(x) for x in _csv(lengths)],
            rounds=rounds,
            max_tokens=max_tokens,
            with_mooncake=mooncake,
            layers=layers,
            kv_heads=kv_heads,
            work_dir=Path(work_dir) if work_dir else None,
            transports=tuple(_csv(transports)),
            push=push,
            tcp_only=tcp_only,
            pin=pin,
            progress=advance,
        )
    _emit(result, output)


@bench_app.command("vllm-store")
def bench_vllm_store(
    lengths: Lengths = "512,1024,2048,4096,8192",
    rounds: Rounds = 3,
    max_tokens: MaxTokens = 16,
    mooncake: Annotated[
        bool,
        typer.Option(help="Also run vLLM's MooncakeStoreConnector when Mooncake's wheel is there."),
    ] = True,
    ours: Annotated[bool, typer.Option(help="Run our MooncakeConnectorsStore.")] = True,
    ours_async: Annotated[
        bool, typer.Option(help="Also run ours with load_async (loads on a worker thread).")
    ] = False,
    transports: OurTransports = _DEFAULT_TRANSPORTS,
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
    work_dir: WorkDir = None,
    output: Output = None,
    verbose: Verbose = 0,
) -> None:
    """vLLM prefix reuse through a store: TTFT on store hits, ours beside MooncakeStoreConnector."""
    _setup_logging(verbose)
    from pathlib import Path

    from .bench.vllm_store import run_store_benchmark

    with _progress("bench vllm-store") as advance:
        result = run_store_benchmark(
            lengths=[int(x) for x in _csv(lengths)],
            rounds=rounds,
            max_tokens=max_tokens,
            with_mooncake=mooncake,
            with_ours=ours,
            with_ours_async=ours_async,
            transports=tuple(_csv(transports)),
            tcp_only=tcp_only,
            baseline=baseline,
            layers=layers,
            kv_heads=kv_heads,
            memory=memory,
            settle=settle,
            work_dir=Path(work_dir) if work_dir else None,
            progress=advance,
        )
    _emit(result, output)


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
    _setup_logging(verbose)
    from pathlib import Path

    from .bench.conductor_live import POLICIES, run_conductor_benchmark

    chosen = tuple(policy or POLICIES)
    for p in chosen:
        if p not in POLICIES:
            raise typer.BadParameter(f"--policy {p!r}: one of {', '.join(POLICIES)}")

    with _progress("bench conductor-live") as advance:
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
    _emit(result, output)


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
    _setup_logging(verbose)
    from .bench.conductor_scale import run_scale

    _emit(run_scale(instances=instances, decode=decode, blocks=blocks, decisions=decisions), output)


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
    _setup_logging(verbose)
    from .bench.store import run_store_benchmark
    from .errors import ConfigError

    try:
        result = run_store_benchmark(
            rounds=rounds,
            sizes=sizes,
            batches=batches,
            memory=memory,
            scale=scale,
            with_mooncake=mooncake,
            ours=tuple(_csv(ours)),
        )
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    _emit(result, output)


@bench_app.command("store-memory")
def bench_store_memory(
    keys: Annotated[int, typer.Option(min=1, help="Keys to commit.")] = 1_000_000,
    key_len: Annotated[int, typer.Option(min=1, max=4096, help="Key length (hex chars).")] = 32,
    batch: Annotated[int, typer.Option(min=1, max=65536, help="Keys per control call.")] = 1000,
) -> None:
    """The master's resident memory per key (a real master process, RSS before and after)."""
    from .bench.store_memory import run_memory_benchmark

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
    from .bench.store_ssd import run_ssd_benchmark
    from .store.config import parse_size

    result = run_ssd_benchmark(
        [parse_size(s) for s in sizes.split(",") if s.strip()], parse_size(memory), ops, ssd_dir
    )
    _emit(result, output)


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
    output: Output = None,
    verbose: Verbose = 0,
) -> None:
    """HiCache page batches through our SGLang backend and SGLang's Mooncake backend (needs
    SGLang installed)."""
    _setup_logging(verbose)
    from .bench.sglang import run_sglang_benchmark

    result = run_sglang_benchmark(
        rounds=rounds,
        cases=cases,
        pages=pages,
        memory=memory,
        with_mooncake=mooncake,
        with_layer_first=layer_first,
    )
    text = json.dumps(result, indent=2)
    if output:
        with open(output, "w") as fh:
            fh.write(text + "\n")
    typer.echo(text)


@app.command()
def fuzz(
    frames: Annotated[int, typer.Option(min=1, help="Frames sent to each port.")] = 100_000,
    port: Annotated[
        list[str] | None,
        typer.Option(help="Targets to fuzz (te, master, load, metadata, side, proxy); all."),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the frame generator (a run replays).")] = 0,
    output: Output = None,
    verbose: Verbose = 0,
) -> None:
    """Hostile frames at every listening port, each target in its own process (JSON report);
    exits 1 when any port crashed, stopped serving, grew its memory or wrote outside a region."""
    _setup_logging(verbose)
    from .bench.fuzz import run_fuzz
    from .bench.fuzz_frames import PORTS

    kinds = _split_urls(port or []) or list(PORTS)
    unknown = [k for k in kinds if k not in PORTS]
    if unknown:
        raise typer.BadParameter(f"unknown target(s) {unknown}; known: {list(PORTS)}")
    with _progress("fuzz") as advance:
        result = run_fuzz(frames, kinds, seed=seed, progress=lambda _p, n, t: advance(n, t))
    _emit(result, output)
    if not result["ok"]:
        raise typer.Exit(1)


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
    from .bench.p2p import run_p2p_benchmark
    from .store.config import parse_size

    counts = [int(x) for x in _csv(ns)]
    if not counts or min(counts) < 1:
        raise typer.BadParameter("give positive counts, e.g. 2,4,8", param_hint="--ns")
    result = run_p2p_benchmark(
        counts, parse_size(size), parse_size(rate), parse_size(chunk), k=k, rounds=rounds
    )
    _emit(result, output)


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
    from .config import engine_config_from_env
    from .p2p import P2PStore
    from .store.config import parse_size

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
        from .errors import MooncakeConnectorsError

        try:
            fn(*args, **kwargs)
        except MooncakeConnectorsError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from exc

    return run


def _serve_until_stopped() -> None:
    import signal
    import threading

    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    with contextlib.suppress(KeyboardInterrupt):
        while not done.wait(1.0):
            pass


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
    _setup_logging(verbose)
    from .store.config import parse_size

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
        _serve_until_stopped()
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
    _setup_logging(verbose)
    import dataclasses

    from .p2p import FetchStats

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
            _serve_until_stopped()
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
    _setup_logging(verbose)
    from .bench.soak import run_soak

    result = run_soak(minutes, rate=rate, fault_every=fault_every, seed=seed)
    _emit(result, output)
    if result["acknowledged_puts_lost"] or result["corrupt_reads"]:
        raise typer.Exit(1)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
