"""``mooncake-connectors doctor``: the host's findings, ``--peer`` an RDMA loop to a peer,
``--serve-rdma`` the peer side of that loop."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated

import typer

from .common import app

if TYPE_CHECKING:
    from ..transfer_core.transports.rdma.transport import RdmaSettings


def _rdma_settings(text: str | None) -> RdmaSettings | None:
    if text is None:
        return None
    import msgspec

    from ..transfer_core.transports.rdma.transport import RdmaSettings

    try:
        return msgspec.json.decode(text.encode(), type=RdmaSettings)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
        raise typer.BadParameter(str(exc), param_hint="--rdma-settings") from None


@app.command()
def doctor(
    as_json: Annotated[bool, typer.Option("--json", help="Findings as a JSON list.")] = False,
    metadata: Annotated[
        str | None, typer.Option(help="Also probe this metadata URL (etcd://… or http://…).")
    ] = None,
    master: Annotated[str | None, typer.Option(help="Also probe this store master.")] = None,
    rdma_settings: Annotated[
        str | None,
        typer.Option(
            help="transport_settings['rdma'] as JSON (nics, port, gid_index, gpu_mr, "
            "min_memlock, sysfs…): check what the transport would do with them."
        ),
    ] = None,
    peer: Annotated[
        str | None,
        typer.Option(
            help="Run an RDMA loop (READ, WRITE, READ back, round trip) to the "
            "`doctor --serve-rdma` at HOST:PORT; exit 1 when it fails."
        ),
    ] = None,
    serve_rdma: Annotated[
        bool,
        typer.Option(
            "--serve-rdma", help="Be the peer of `doctor --peer`: print HOST:PORT and serve."
        ),
    ] = False,
    host: Annotated[str, typer.Option(help="--serve-rdma: the address to listen on.")] = (
        "127.0.0.1"
    ),
    port: Annotated[int, typer.Option(min=0, max=65535, help="--serve-rdma: 0 picks one.")] = 0,
    timeout: Annotated[
        float, typer.Option(min=0.1, max=600, help="Seconds one loop may take, each side.")
    ] = 10.0,
    size: Annotated[
        int, typer.Option("--bytes", min=1, max=256 << 20, help="--peer: bytes each way.")
    ] = 1 << 20,
) -> None:
    """What this host can use for transfers (GPUs, RDMA NICs, /dev/shm, NUMA), and the fix for
    what it cannot: one line per finding."""
    st = _rdma_settings(rdma_settings)
    if serve_rdma:
        _serve(st, host, port, timeout, as_json)
        return
    from ..transfer_core import doctor as checks

    findings = checks.run(metadata=metadata, master=master, rdma=st)
    if peer:
        from ..transfer_core.doctor_rdma import check_peer

        findings += check_peer(peer, st, size, timeout)
    if as_json:
        typer.echo(json.dumps(checks.as_json(findings), indent=2))
    else:
        for f in findings:
            typer.echo(f.line())
    if peer and any(f.area == "rdma-peer" and f.verdict == "fail" for f in findings):
        raise typer.Exit(1)


def _serve(st: RdmaSettings | None, host: str, port: int, timeout: float, as_json: bool) -> None:
    import signal

    from ..errors import ConfigError
    from ..transfer_core.doctor_rdma import settings_for
    from ..transfer_core.transports.rdma.peercheck import PeerServer

    settings, _ = settings_for("/", st)
    try:
        srv = PeerServer(settings, host, port, timeout)
    except (ConfigError, OSError) as exc:
        typer.echo(f"error: cannot serve the rdma doctor loop: {exc}", err=True)
        raise typer.Exit(1) from None
    signal.signal(signal.SIGTERM, lambda *_: srv.stop.set())
    nics = [n.name for n in srv.nics]
    where = f"[{srv.host}]:{srv.port}" if ":" in srv.host else f"{srv.host}:{srv.port}"
    if as_json:
        typer.echo(json.dumps({"serving": where, "port": srv.port, "nics": nics}))
    else:
        typer.echo(f"rdma doctor peer on {where} (NICs {', '.join(nics)}); Ctrl-C stops it")
    try:
        srv.serve()
    except KeyboardInterrupt:
        srv.close()
