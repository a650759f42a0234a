"""Long-running services: the metadata server, the PD proxy, the store master and servers."""

from __future__ import annotations

import json
import logging
import os
from typing import Annotated

import typer

from ..netguard import HTTP_IDLE_TIMEOUT, HTTP_REQUEST_TIMEOUT
from .common import (
    DEFAULT_TRANSPORT_LIST,
    TlsCa,
    TlsCert,
    TlsKey,
    Verbose,
    app,
    serve_until_stopped,
    setup_logging,
    split_urls,
    tls_files,
)


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
    setup_logging(max(verbose, 1))
    from ..transfer_core.metadata.http import MetadataHTTPServer

    if auth_token is not None and len(auth_token) < 8:
        raise typer.BadParameter("must be at least 8 characters", param_hint="--auth-token")
    tls = tls_files(tls_cert, tls_key, tls_ca)
    server = MetadataHTTPServer(host, port, path=path, token=auth_token, tls=tls)
    server.start()
    logging.getLogger("mooncake_connectors").info("metadata server on %s", server.url)
    try:
        server.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


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
    read_deadline: Annotated[
        float,
        typer.Option(
            min=0.001,
            help="Seconds a client has to send a whole request (request line, headers and "
            "body) from its first byte; the connection is closed after.",
        ),
    ] = HTTP_REQUEST_TIMEOUT,
    idle_timeout: Annotated[
        float,
        typer.Option(min=0.001, help="Seconds a client connection may sit with no request."),
    ] = HTTP_IDLE_TIMEOUT,
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
            "vllm/v2/MODEL/LAYOUT/tp0-1.pp0-1/{block}/model.layers.0.self_attn.attn."
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
    setup_logging(verbose)
    try:
        from ..conductor.proxy import run_proxy
    except ImportError as exc:
        raise SystemExit(
            f"the proxy needs aiohttp ({exc}): pip install 'mooncake-connectors[proxy]'"
        ) from exc
    from ..conductor.estimators import DecodeModel, PrefillModel, TransferModel
    from ..conductor.live import CacheSource
    from ..conductor.proxy import ConductorOptions
    from ..conductor.types import Admission, PlacementPolicy
    from ..errors import ConfigError

    prefill = split_urls(prefill)
    decode = split_urls(decode)
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
            tls=tls_files(tls_cert, tls_key, tls_ca),
            read_deadline=read_deadline,
            idle_timeout=idle_timeout,
        )
    except ConfigError as exc:
        raise SystemExit(f"proxy: {exc}") from exc


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
    max_buffered: Annotated[
        str, typer.Option(help="Bytes of unread answers held over all connections.")
    ] = "256M",
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
    setup_logging(max(verbose, 1))
    from ..store.config import MasterConfig, parse_size
    from ..store.master import Master

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
        max_buffered=parse_size(max_buffered),
        auth_token=auth_token,
        tls=tls_files(tls_cert, tls_key, tls_ca),
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
    ] = DEFAULT_TRANSPORT_LIST,
    tls_cert: TlsCert = None,
    tls_key: TlsKey = None,
    tls_ca: TlsCa = None,
    verbose: Verbose = 0,
) -> None:
    """Contribute memory (and SSD) to the store and hold the data, in the foreground."""
    setup_logging(max(verbose, 1))
    from ..config import parse_transports
    from ..store.config import ServerConfig, parse_size
    from ..store.server import StoreServer

    cfg = ServerConfig(
        master=master,
        memory=parse_size(memory),
        host=host,
        ssd_dir=ssd_dir,
        ssd_size=parse_size(ssd_size),
        metadata=metadata,
        auth_token=auth_token,
        transports=parse_transports(transports),
        tls=tls_files(tls_cert, tls_key, tls_ca),
    )
    server = StoreServer(cfg).start()
    typer.echo(json.dumps({"segment": server.segment, "pid": os.getpid()}), err=True)
    try:
        serve_until_stopped()
    finally:
        server.close()
